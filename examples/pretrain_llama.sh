#!/usr/bin/env bash
# A Llama-style model (RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases, untied output)
# with Megatron-LM's flags. Defaults are a ~1B Llama on 8 GPUs with TP=2; every size can be
# overridden from the environment (the test suite runs it scaled down on 2 CPU processes).
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "$0")" && pwd)"
# The interpreter that has mcore installed (torchrun is its torch.distributed.run module).
PYTHON=${PYTHON:-python3}
NPROC=${NPROC:-8}
DEVICE_BACKEND=${DEVICE_BACKEND:-auto}
PRECISION=${PRECISION:---bf16}
OUTPUT_DIR=${OUTPUT_DIR:-experiments/llama}

if [ -n "${DATA_PATH:-}" ]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --tokenizer-type HuggingFaceTokenizer
               --tokenizer-model "$TOKENIZER_MODEL" --split 969,30,1)
else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 32000)
fi

"$PYTHON" -m torch.distributed.run --nproc_per_node "$NPROC" "$SCRIPT_DIR/pretrain_gpt.py" \
    --device-backend "$DEVICE_BACKEND" \
    --tensor-model-parallel-size "${TP:-2}" --pipeline-model-parallel-size "${PP:-1}" --sequence-parallel \
    --num-layers "${NUM_LAYERS:-16}" --hidden-size "${HIDDEN:-2048}" --ffn-hidden-size "${FFN:-5504}" \
    --num-attention-heads "${HEADS:-16}" --group-query-attention --num-query-groups "${GROUPS:-4}" \
    --seq-length "${SEQ:-4096}" --max-position-embeddings "${SEQ:-4096}" \
    --position-embedding-type rope --rotary-base 10000 --normalization RMSNorm --norm-epsilon 1e-5 \
    --swiglu --disable-bias-linear --untie-embeddings-and-output-weights \
    --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02 \
    --micro-batch-size "${MBS:-1}" --global-batch-size "${GBS:-256}" --train-iters "${TRAIN_ITERS:-100000}" \
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters "${WARMUP:-2000}" \
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 $PRECISION \
    --use-distributed-optimizer --overlap-grad-reduce \
    --log-interval "${LOG_INTERVAL:-10}" --eval-interval 1000 --eval-iters "${EVAL_ITERS:-10}" --num-workers "${NUM_WORKERS:-2}" \
    --save "$OUTPUT_DIR/checkpoints" --save-interval "${SAVE_INTERVAL:-1000}" --load "$OUTPUT_DIR/checkpoints" \
    "${DATA_ARGS[@]}"
