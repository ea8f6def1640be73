#!/usr/bin/env bash
# A GPT-3-style launch in Megatron-LM's style, scaled down to fit a laptop or a CI machine.
# Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh uses these flags at 96 layers, 12288
# hidden, 96 heads, TP 8, PP 16; here the same flags describe a model that runs on 2 CPU processes.
# Change NPROC/TP/PP/DEVICE_BACKEND (cpu|cuda|npu|auto) and the model sizes to scale it back up.
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "$0")" && pwd)"
# The interpreter that has mcore installed (torchrun is its torch.distributed.run module).
PYTHON=${PYTHON:-python3}
NPROC=${NPROC:-2}
TP=${TP:-2}
PP=${PP:-1}
DEVICE_BACKEND=${DEVICE_BACKEND:-cpu}
TRAIN_ITERS=${TRAIN_ITERS:-50}
OUTPUT_DIR=${OUTPUT_DIR:-/tmp/mcore-gpt3-small}

GPT_MODEL_ARGS=(
    --num-layers 4
    --hidden-size 128
    --num-attention-heads 8
    --seq-length 128
    --max-position-embeddings 128
    --attention-dropout 0.0
    --hidden-dropout 0.0
)
TRAINING_ARGS=(
    --micro-batch-size 2
    --global-batch-size 8
    --train-iters "$TRAIN_ITERS"
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.006
    --clip-grad 1.0
    --lr 6.0e-4
    --lr-decay-style cosine
    --min-lr 6.0e-5
    --lr-warmup-fraction .01
    --lr-decay-iters "$TRAIN_ITERS"
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --device-backend "$DEVICE_BACKEND"
)
if [ -n "${DATA_PATH:-}" ]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE"
               --tokenizer-type GPT2BPETokenizer --split 949,50,1)
else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 1024)
fi
EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --save-interval 1000
    --eval-interval 1000
    --eval-iters 2
    --num-workers 0
    --tensorboard-dir "$OUTPUT_DIR/tensorboard"
)

"$PYTHON" -m torch.distributed.run --nproc_per_node "$NPROC" "$SCRIPT_DIR/pretrain_gpt.py" \
    "${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}"
