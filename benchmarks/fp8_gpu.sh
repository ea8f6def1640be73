#!/usr/bin/env bash
# FP8 on one GPU: the FP8 op/linear tests on CUDA, then bf16 vs FP8 training throughput at the
# 24-layer config (the plain+compile reference in the bf16 run's process). Writes under $OUT.
# Usage: OUT=dir bash benchmarks/fp8_gpu.sh [tests|big|all]
set -u
OUT=${OUT:-/tmp/fp8_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
BIG="--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 4 --vocab-size 50257"
PA="--use-precision-aware-optimizer --main-grads-dtype bf16 --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16"
G="--cuda-graph-impl local"
TT="python benchmarks/train_throughput.py --device-backend cuda --bf16 --no-log-memory"
what=${1:-all}
if [[ $what == tests || $what == all ]]; then
  MCORE_TEST_BACKEND=cuda python -m pytest -q -x tests/ops/test_scaled_linear.py 2>&1 | tail -15 | tee "$OUT/pytest.log"
fi
if [[ $what == big || $what == all ]]; then
  $TT $BIG $PA $G --reference plain --iters 20 --out "$OUT/big.jsonl" --label bf16 2>&1 | grep '^{' | cut -c1-400
  $TT $BIG $PA $G --fp8-format hybrid --fp8-recipe tensorwise --iters 20 --out "$OUT/big.jsonl" --label fp8-tensorwise 2>&1 | grep -v '^ *iteration' | tail -5 | cut -c1-600
  $TT $BIG $PA $G --fp8-format hybrid --fp8-recipe delayed --iters 20 --out "$OUT/big.jsonl" --label fp8-delayed --profile-steps 2 2>&1 | grep -v '^ *iteration' | tail -40 | cut -c1-300
fi
