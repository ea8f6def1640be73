"""Import a local Hugging Face GPT-2 or Llama directory as an mcore checkpoint, checked for parity.

    python examples/convert_from_hf.py --hf-dir HF_DIR --save CKPT_DIR --tensor-model-parallel-size 2

The same as ``python -m mcore.hf.importer``; it prints the Megatron flags that continue training the
model with ``examples/pretrain_gpt.py ... --load CKPT_DIR --finetune``.
"""

from mcore.hf.importer import main

if __name__ == "__main__":
    raise SystemExit(main())
