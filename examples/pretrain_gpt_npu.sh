#!/usr/bin/env bash
# GPT pretraining on Ascend NPUs with Megatron-LM's flags (the adaptor is imported by the script).
# The variables of MindSpeed's pretrain_gpt_distributed.sh are honoured as set there:
#   CHECKPOINT_PATH   --save and --load (unset: no checkpoints)
#   VOCAB_FILE        GPT-2 vocab.json     } with DATA_PATH: GPT2BPETokenizer
#   MERGE_FILE        GPT-2 merges.txt     }
#   DATA_PATH         <prefix>_text_document (unset: mock data, said at start)
# MCORE_SIMULATED_NPU=1 runs the same launch on the CPU against the simulated torch_npu (a check of
# the launch path only). Sizes can be overridden from the environment.
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "$0")" && pwd)"
# The interpreter that has mcore installed (torchrun is its torch.distributed.run module).
PYTHON=${PYTHON:-python3}
NPROC=${NPROC:-8}
export HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-1200}

if [ -n "${DATA_PATH:-}" ]; then
    : "${VOCAB_FILE:?DATA_PATH is set: set VOCAB_FILE to the GPT-2 vocab.json the data was made with}"
    : "${MERGE_FILE:?DATA_PATH is set: set MERGE_FILE to the GPT-2 merges.txt the data was made with}"
    DATA_ARGS=(--data-path "$DATA_PATH" --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE"
               --tokenizer-type GPT2BPETokenizer --split "${SPLIT:-949,50,1}")
else
    echo "DATA_PATH is not set: training on mock data (set DATA_PATH, VOCAB_FILE and MERGE_FILE for real data)"
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size "${VOCAB_SIZE:-32000}")
fi
CKPT_ARGS=()
if [ -n "${CHECKPOINT_PATH:-}" ]; then
    CKPT_ARGS=(--save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval "${SAVE_INTERVAL:-10000}")
fi

"$PYTHON" -m torch.distributed.run --nproc_per_node "$NPROC" "$SCRIPT_DIR/pretrain_gpt_npu.py" \
    --tensor-model-parallel-size "${TP:-2}" --pipeline-model-parallel-size "${PP:-1}" --sequence-parallel \
    --num-layers "${NUM_LAYERS:-24}" --hidden-size "${HIDDEN:-2048}" --num-attention-heads "${HEADS:-16}" \
    --seq-length "${SEQ:-2048}" --max-position-embeddings "${SEQ:-2048}" \
    --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear \
    --micro-batch-size "${MBS:-1}" --global-batch-size "${GBS:-64}" --train-iters "${TRAIN_ITERS:-1000}" \
    --lr 3e-4 --lr-decay-style cosine --lr-warmup-iters "${WARMUP:-100}" ${PRECISION:---bf16} \
    --attention-dropout 0.0 --hidden-dropout 0.0 \
    --log-interval 1 --eval-interval 1000 --eval-iters "${EVAL_ITERS:-10}" --num-workers 0 \
    "${DATA_ARGS[@]}" "${CKPT_ARGS[@]}"
