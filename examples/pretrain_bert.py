"""Pretrain a BERT with Megatron-LM's command line (Megatron's ``pretrain_bert.py``).

Take a Megatron-LM BERT launch script and change only the script path::

    # CPU, 2 processes (gloo), tensor parallel 2, on a sentence-split corpus
    torchrun --nproc_per_node 2 examples/pretrain_bert.py --device-backend cpu \
        --tensor-model-parallel-size 2 --num-layers 2 --hidden-size 64 --num-attention-heads 4 \
        --seq-length 128 --max-position-embeddings 128 --micro-batch-size 4 --global-batch-size 8 \
        --train-iters 100 --lr 1e-4 --data-path bert/docs_text_sentence --vocab-file bert/vocab.txt

As in Megatron: ``--tokenizer-type`` defaults to ``BertWordPieceLowerCase`` (give ``--vocab-file``);
the data is the sentence-level dataset of ``mcore-preprocess-data --split-sentences``, sampled into
sentence pairs (``--short-seq-prob`` 0.1) with ``--mask-prob`` 0.15 of the tokens masked (80% [MASK],
10% random, 10% kept); the loss is the masked-LM loss plus the sentence-order loss of the binary head,
logged as ``lm loss`` and ``sop loss``; ``--bert-no-binary-head`` trains the masked-LM alone (no pooler,
no binary head, no token types).

Top to bottom: the model provider builds one pipeline chunk of the BERT; the forward step reads a
micro-batch (every pipeline stage reads it: each encoder layer needs its padding mask) and returns
the per-token loss and the binary logits with the loss closure; ``pretrain`` does the rest.
"""

from mcore.data import bert_datasets_provider
from mcore.training.bert import bert_flops_per_sample, forward_step, model_provider
from mcore.training.pretrain import pretrain

if __name__ == "__main__":
    pretrain(
        model_provider,
        forward_step,
        bert_datasets_provider,
        args_defaults={"tokenizer_type": "BertWordPieceLowerCase"},
        data_on_every_stage=True,
        flops_per_sample=bert_flops_per_sample,
    )
