#!/usr/bin/env bash
# FP8 on one GPU (the commands of benchmarks/README.md's FP8 section): the FP8 op/linear tests on
# CUDA, then bf16 vs FP8 training throughput at 24L h2048 (the plain+compile reference in the FP8
# run's process) and at a Llama-style 12L h4096. JSON lines under $OUT.
# Usage: OUT=dir bash benchmarks/fp8_gpu.sh [tests|kernels|big|pg|ratio|margin|rowwise|profile|llama|llama32|all]
# (ratio: FP8 delayed / bf16 step-time pairs in the order bf16 FP8 FP8 bf16, PAIRS=2 times, ITERS=60 steps each)
# (llama32: 32L h4096 s4096, ~7.4B parameters: needs the 141 GB of an H200)
set -u
OUT=${OUT:-/tmp/fp8_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
BIG="--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 4 --vocab-size 50257"
LLAMA="--num-layers 12 --hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups 8 --swiglu --ffn-hidden-size 14336 --seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1 --normalization RMSNorm --position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights --vocab-size 50257"
PA="--use-precision-aware-optimizer --main-grads-dtype bf16 --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16"
G="--cuda-graph-impl local"
RC="--recompute-granularity selective --recompute-modules layernorm mlp_act"
TT="python benchmarks/train_throughput.py --device-backend cuda --bf16 --no-log-memory"
what=${1:-all}
if [[ $what == tests || $what == all ]]; then
  MCORE_TEST_BACKEND=cuda python -m pytest -q --tb=short tests/ops/test_scaled_linear.py tests/ops/test_fp8_cast_interpret.py \
    tests/ops/test_act_fp8_interpret.py tests/ops/test_norm_fp8_interpret.py tests/tensor_parallel/test_fp8_fused.py \
    tests/model/test_layer_graphs.py 2>&1 | tail -40 | tee "$OUT/pytest.log"
fi
if [[ $what == big || $what == all ]]; then
  $TT $BIG $PA $G --fp8-format hybrid --fp8-recipe delayed --reference plain --iters 20 --out "$OUT/fp8.jsonl" --label fp8-delayed
  $TT $BIG $PA $G --iters 20 --out "$OUT/fp8.jsonl" --label bf16
  $TT $BIG $PA $G --fp8-format hybrid --fp8-recipe tensorwise --iters 20 --out "$OUT/fp8.jsonl" --label fp8-tensorwise
  $TT $BIG $PA $G --fp8-format hybrid --fp8-recipe delayed --no-fp8-fused-producers --iters 20 --out "$OUT/fp8.jsonl" --label fp8-delayed-unfused
  # the reference model's GeLU (tanh; Megatron's fused bias-GeLU and Transformer Engine compute it too)
  $TT $BIG $PA $G --openai-gelu --fp8-format hybrid --fp8-recipe delayed --iters 20 --out "$OUT/fp8.jsonl" --label fp8-delayed-tanh
  $TT $BIG $PA $G --openai-gelu --iters 20 --out "$OUT/fp8.jsonl" --label bf16-tanh
fi
if [[ $what == pg || $what == all ]]; then
  # --fp8-param-gather with the delayed recipe: the optimizer step writes the FP8 weights (no cast in
  # the forward); the distributed optimizer it needs (one GPU: nothing to shard) on both sides
  DO="--use-distributed-optimizer"
  $TT $BIG $PA $G $DO --iters 20 --out "$OUT/fp8.jsonl" --label bf16-distopt
  $TT $BIG $PA $G $DO --fp8-param-gather --fp8-format hybrid --fp8-recipe delayed --iters 20 --out "$OUT/fp8.jsonl" --label fp8-delayed-param-gather
  $TT $BIG $PA $G $DO --fp8-format hybrid --fp8-recipe delayed --iters 20 --out "$OUT/fp8.jsonl" --label fp8-delayed-distopt
  # tensorwise: the scale needs the new weights' amax, so the quantization is a pass after the step
  # (one _foreach_norm and one fp8_quantize_flat launch)
  $TT $BIG $PA $G $DO --fp8-param-gather --fp8-format hybrid --fp8-recipe tensorwise --iters 20 --out "$OUT/fp8.jsonl" --label fp8-tensorwise-param-gather
  $TT $BIG $PA $G $DO --fp8-format hybrid --fp8-recipe tensorwise --iters 20 --out "$OUT/fp8.jsonl" --label fp8-tensorwise-distopt
fi
if [[ $what == ratio ]]; then
  # A 20-step run times ~2 s of work, and the GPU's state before it moves a pair by up to 2.5%: longer
  # runs, each precision first in half of the pairs, and the ratio of the summed times
  for ((p = 1; p <= ${PAIRS:-2}; p++)); do
    for label in bf16 fp8 fp8 bf16; do
      extra=""; [[ $label == fp8 ]] && extra="--fp8-format hybrid --fp8-recipe delayed"
      $TT $BIG $PA $G $extra --iters "${ITERS:-60}" --out "$OUT/ratio.jsonl" --label "$label" > /dev/null
    done
  done
  python - "$OUT/ratio.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
times = {"bf16": [], "fp8": []}
for row in rows:
    times[row["peer"]].append(row["step_s"] * 1000)
for label, ms in times.items():
    print(label, "ms per step:", " ".join(f"{t:.2f}" for t in ms))
print(f"FP8 delayed over bf16: {sum(times['bf16']) / sum(times['fp8']):.4f}x ({len(times['fp8'])} runs each)")
PY
fi
if [[ $what == margin || $what == all ]]; then
  # the delayed recipe's output-gradient scales lag a fast-growing amax on the fixed batch: headroom
  $TT $BIG $PA $G --fp8-format hybrid --fp8-recipe delayed --fp8-margin 3 --iters 20 --out "$OUT/fp8.jsonl" --label fp8-delayed-margin3
fi
if [[ $what == rowwise || $what == all ]]; then
  $TT $BIG $PA $G --fp8-format hybrid --fp8-recipe rowwise --iters 20 --out "$OUT/fp8.jsonl" --label fp8-rowwise
fi
if [[ $what == profile || $what == all ]]; then
  $TT $BIG $PA $G --fp8-format hybrid --fp8-recipe tensorwise --iters 20 --out "$OUT/fp8.jsonl" --label fp8-tensorwise-profiled \
    --profile-steps 2 --profile-out "$OUT/profile.txt" --profile-top 30
fi
if [[ $what == kernels || $what == all ]]; then
  python benchmarks/kernels/bench_fp8_cast.py --json "$OUT/fp8_cast.json" | tee "$OUT/fp8_cast.log"
fi
if [[ $what == llama || $what == all ]]; then
  $TT $LLAMA $PA $G $RC --iters 10 --out "$OUT/fp8.jsonl" --label llama-bf16
  $TT $LLAMA $PA $G $RC --fp8-format hybrid --fp8-recipe tensorwise --iters 10 --out "$OUT/fp8.jsonl" --label llama-fp8-tensorwise
  # the peak memory with and without the kept W_q^T (1 byte a weight element held forward -> backward)
  $TT $LLAMA $PA $G $RC --fp8-format hybrid --fp8-recipe delayed --iters 10 --out "$OUT/fp8.jsonl" --label llama-fp8-delayed
  $TT $LLAMA $PA $G $RC --fp8-format hybrid --fp8-recipe delayed --no-fp8-keep-weight-transpose --iters 10 --out "$OUT/fp8.jsonl" --label llama-fp8-delayed-notrans
fi
LLAMA32="--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups 8 --swiglu --ffn-hidden-size 14336 --seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1 --normalization RMSNorm --position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights --vocab-size 50257"
if [[ $what == llama32 ]]; then
  $TT $LLAMA32 $PA $G $RC --iters 10 --out "$OUT/fp8.jsonl" --label llama32-bf16
  $TT $LLAMA32 $PA $G $RC --fp8-format hybrid --fp8-recipe delayed --iters 10 --out "$OUT/fp8.jsonl" --label llama32-fp8-delayed
  $TT $LLAMA32 $PA $G $RC --fp8-format hybrid --fp8-recipe delayed --no-fp8-keep-weight-transpose --iters 10 --out "$OUT/fp8.jsonl" --label llama32-fp8-delayed-notrans
fi
