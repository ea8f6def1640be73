"""Export an mcore checkpoint (saved at any TP/PP layout) to a Hugging Face directory, checked for parity.

    python examples/convert_to_hf.py --load CKPT_DIR --save HF_DIR [--dtype bfloat16]

The same as ``python -m mcore.hf.export`` (see :mod:`mcore.hf.export` for every flag);
docs/hf_workflow.md shows the whole train -> export -> transformers -> generate sequence.
"""

from mcore.hf.export import main

if __name__ == "__main__":
    raise SystemExit(main())
