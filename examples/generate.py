"""Generate text from an mcore checkpoint (greedy, sampling, beam search; KV cache; TP/PP).

    python examples/generate.py --load CKPT_DIR --prompt "Once upon a time" --max-new-tokens 32 --greedy
    torchrun --nproc_per_node 4 examples/generate.py --load CKPT_DIR --prompt "Hello" \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --top-k 40 --top-p 0.9 --seed 7

The same as ``python -m mcore.inference.generate`` (see :mod:`mcore.inference.generate`).
"""

from mcore.inference.generate import main

if __name__ == "__main__":
    raise SystemExit(main())
