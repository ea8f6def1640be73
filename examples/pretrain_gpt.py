"""Pretrain a GPT (GPT-2/3 or Llama-style) with Megatron-LM's command line.

Take a Megatron-LM launch script and change only the script path::

    # CPU, 2 processes (gloo), tensor parallel 2
    torchrun --nproc_per_node 2 examples/pretrain_gpt.py --device-backend cpu \
        --tensor-model-parallel-size 2 --num-layers 2 --hidden-size 64 --num-attention-heads 4 \
        --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4 \
        --train-iters 50 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 1000

    # 8 GPUs: add --bf16 and --device-backend cuda (or auto); Ascend NPUs: --device-backend npu.

Top to bottom: the model provider builds one pipeline chunk of the GPT; the forward step reads a
micro-batch and returns the per-token loss with its closure; ``pretrain`` does the rest (backend,
process groups, data, optimizer, schedules, checkpoints, logging). As in Megatron's
``pretrain_gpt.py``, ``--tokenizer-type`` defaults to ``GPT2BPETokenizer`` (give ``--vocab-file`` and
``--merge-file``).
"""

from mcore.training.gpt import forward_step, model_provider
from mcore.training.pretrain import gpt_datasets_provider, pretrain

if __name__ == "__main__":
    pretrain(
        model_provider,
        forward_step,
        gpt_datasets_provider,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
    )
