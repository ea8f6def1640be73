"""Pretrain a T5 (encoder-decoder) with Megatron-LM's command line (Megatron's ``pretrain_t5.py``).

    # CPU, 2 processes (gloo): the encoder on stage 0, the decoder on stage 1
    torchrun --nproc_per_node 2 examples/pretrain_t5.py --device-backend cpu \
        --pipeline-model-parallel-size 2 --pipeline-model-parallel-split-rank 1 \
        --encoder-num-layers 2 --decoder-num-layers 2 --hidden-size 64 --num-attention-heads 4 \
        --kv-channels 16 --ffn-hidden-size 256 --encoder-seq-length 128 --decoder-seq-length 64 \
        --max-position-embeddings 128 --micro-batch-size 4 --global-batch-size 8 --train-iters 50 \
        --lr 1e-3 --vocab-file vocab.txt --vocab-extra-ids 100 --data-path corpus_text_sentence

As in Megatron's script, ``--tokenizer-type`` defaults to ``BertWordPieceLowerCase`` (with
``--vocab-extra-ids`` for the sentinels); a T5 SentencePiece vocabulary works through
``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR``. The data is the sentence-level
``.bin/.idx`` of ``mcore-preprocess-data --split-sentences`` (or ``--mock-data``).
"""

from mcore.pipeline.encoder_decoder import ModelType
from mcore.training.flops import t5_flops_per_sample
from mcore.training.pretrain import pretrain
from mcore.training.t5 import forward_step, model_provider, t5_datasets_provider

if __name__ == "__main__":
    pretrain(
        model_provider,
        forward_step,
        t5_datasets_provider,
        model_type=ModelType.encoder_and_decoder,
        flops_per_sample=t5_flops_per_sample,
        args_defaults={"tokenizer_type": "BertWordPieceLowerCase"},
    )
