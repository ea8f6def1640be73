#!/usr/bin/env bash
# The CodeParrot GPT-2 small run, in Megatron-LM's style (the well-known HF/Megatron example:
# 12 layers, 768 hidden, 12 heads, seq 1024, global batch 192, cosine decay, fp16).
# Point DATA_PATH/VOCAB_FILE/MERGE_FILE at your preprocessed data; without them it uses mock data.
# Every size can be overridden from the environment (the test suite runs it scaled down).
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "$0")" && pwd)"
# The interpreter that has mcore installed (torchrun is its torch.distributed.run module).
PYTHON=${PYTHON:-python3}
NPROC=${NPROC:-8}
DEVICE_BACKEND=${DEVICE_BACKEND:-auto}
PRECISION=${PRECISION:---fp16}
OUTPUT_DIR=${OUTPUT_DIR:-experiments/codeparrot-small}

if [ -n "${DATA_PATH:-}" ]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE"
               --tokenizer-type GPT2BPETokenizer --split 969,30,1)
else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50256)
fi

"$PYTHON" -m torch.distributed.run --nproc_per_node "$NPROC" "$SCRIPT_DIR/pretrain_gpt.py" \
    --device-backend "$DEVICE_BACKEND" \
    --tensor-model-parallel-size "${TP:-1}" --pipeline-model-parallel-size "${PP:-1}" \
    --num-layers "${NUM_LAYERS:-12}" --hidden-size "${HIDDEN:-768}" --num-attention-heads "${HEADS:-12}" \
    --seq-length "${SEQ:-1024}" --max-position-embeddings "${SEQ:-1024}" \
    --micro-batch-size "${MBS:-12}" --global-batch-size "${GBS:-192}" \
    --lr 0.0005 --train-iters "${TRAIN_ITERS:-150000}" --lr-decay-iters "${TRAIN_ITERS:-150000}" \
    --lr-decay-style cosine --lr-warmup-iters "${WARMUP:-2000}" --weight-decay .1 --adam-beta2 .999 \
    $PRECISION --log-interval "${LOG_INTERVAL:-10}" --save-interval "${SAVE_INTERVAL:-2000}" --eval-interval 200 \
    --eval-iters "${EVAL_ITERS:-10}" --num-workers "${NUM_WORKERS:-2}" \
    --save "$OUTPUT_DIR/checkpoints" --load "$OUTPUT_DIR/checkpoints" \
    --tensorboard-dir "$OUTPUT_DIR/tensorboard" \
    "${DATA_ARGS[@]}"
