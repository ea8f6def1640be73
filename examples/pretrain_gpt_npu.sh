#!/usr/bin/env bash
# GPT pretraining on Ascend NPUs with Megatron-LM's flags (the adaptor is imported by the script).
# MCORE_SIMULATED_NPU=1 runs the same launch on the CPU against the simulated torch_npu (a check of
# the launch path only). Sizes can be overridden from the environment.
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "$0")" && pwd)"
# The interpreter that has mcore installed (torchrun is its torch.distributed.run module).
PYTHON=${PYTHON:-python3}
NPROC=${NPROC:-8}
export HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-1200}

"$PYTHON" -m torch.distributed.run --nproc_per_node "$NPROC" "$SCRIPT_DIR/pretrain_gpt_npu.py" \
    --tensor-model-parallel-size "${TP:-2}" --pipeline-model-parallel-size "${PP:-1}" --sequence-parallel \
    --num-layers "${NUM_LAYERS:-24}" --hidden-size "${HIDDEN:-2048}" --num-attention-heads "${HEADS:-16}" \
    --seq-length "${SEQ:-2048}" --max-position-embeddings "${SEQ:-2048}" \
    --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear \
    --micro-batch-size "${MBS:-1}" --global-batch-size "${GBS:-64}" --train-iters "${TRAIN_ITERS:-1000}" \
    --lr 3e-4 --lr-decay-style cosine --lr-warmup-iters "${WARMUP:-100}" ${PRECISION:---bf16} \
    --attention-dropout 0.0 --hidden-dropout 0.0 \
    --log-interval 1 --eval-interval 1000 --eval-iters "${EVAL_ITERS:-10}" --num-workers 0 \
    --mock-data --tokenizer-type NullTokenizer --vocab-size 32000
