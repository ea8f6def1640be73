"""The encoder-decoder pipeline layout (pure), its flags, and the T5 data's clear errors."""

import pickle

import numpy as np
import pytest

from mcore.config.fields import ConfigError
from mcore.config.parallel import ParallelConfig
from mcore.data.config import DataConfig
from mcore.data.errors import DataError
from mcore.data.t5_dataset import MockSentenceDataset, T5Dataset, T5DatasetConfig, T5Vocab, build_t5_datasets
from mcore.data.tokenizers import BertWordPieceTokenizer
from mcore.distributed.topology import Topology
from mcore.pipeline.encoder_decoder import encoder_decoder_stages, encoder_decoder_tensor_shapes


def test_stages_split_the_encoder_and_the_decoder_at_the_split_rank():
    stages = encoder_decoder_stages(6, 4, 4, 2)
    assert [(s.add_encoder, s.add_decoder) for s in stages] == [(True, False)] * 2 + [(False, True)] * 2
    assert [s.pre_process for s in stages] == [True, False, True, False]
    assert [s.post_process for s in stages] == [False, True, False, True]
    assert [list(s.encoder_layers) for s in stages] == [[0, 1, 2], [3, 4, 5], [], []]
    assert [list(s.decoder_layers) for s in stages] == [[], [], [0, 1], [2, 3]]
    whole = encoder_decoder_stages(6, 4, 1, None)
    assert len(whole) == 1 and whole[0].add_encoder and whole[0].add_decoder
    shapes = encoder_decoder_tensor_shapes(
        stages, encoder_seq_length=64, decoder_seq_length=32, micro_batch_size=2, hidden_size=8,
        tensor_model_parallel_size=2, sequence_parallel=True,
    )  # fmt: skip
    assert shapes == [[(32, 2, 8)], [(32, 2, 8)], [(16, 2, 8), (32, 2, 8)], [(16, 2, 8), (32, 2, 8)]]


@pytest.mark.parametrize(
    "args,message",
    [
        ((2, 2, 2, None), "needs --pipeline-model-parallel-split-rank"),
        ((3, 2, 3, 2), "encoder_num_layers=3 does not divide evenly over the 2 encoder"),
        ((2, 3, 4, 2), "decoder_num_layers=3 does not divide evenly over the 2 decoder"),
    ],
)
def test_impossible_layouts_are_refused(args, message):
    with pytest.raises(ConfigError, match=message):
        encoder_decoder_stages(*args)


def test_split_rank_flags():
    assert (
        ParallelConfig(
            pipeline_model_parallel_size=2, encoder_pipeline_model_parallel_size=1
        ).pipeline_model_parallel_split_rank
        == 1
    )
    combined = ParallelConfig(pipeline_model_parallel_size=2, encoder_pipeline_model_parallel_size=1)
    assert combined.pipeline_model_parallel_size == 3  # Megatron: encoder stages come on top
    with pytest.raises(ConfigError, match="pipeline_model_parallel_split_rank=2 must lie between 1 and"):
        ParallelConfig(pipeline_model_parallel_size=2, pipeline_model_parallel_split_rank=2)
    with pytest.raises(ConfigError, match="no interleaved"):
        ParallelConfig(
            pipeline_model_parallel_size=4, pipeline_model_parallel_split_rank=2,
            virtual_pipeline_model_parallel_size=2,
        )  # fmt: skip
    # The tied embedding lives on the first encoder stage, the first decoder stage and the last stage.
    topology = Topology.create(8, 0, tp=2, pp=4)
    assert topology.embedding_groups(2) == [[0, 4, 6], [1, 5, 7]]


def _config(tokenizer, **kw):
    return T5DatasetConfig(
        random_seed=5, sequence_length=kw.pop("enc", 64), sequence_length_decoder=kw.pop("dec", 32),
        tokenizer=tokenizer, **kw,
    )  # fmt: skip


def test_mock_data_serves_t5_batches(t5_corpus):
    tokenizer = BertWordPieceTokenizer(t5_corpus["vocab"], vocab_extra_ids=100)
    train, valid, test = build_t5_datasets(
        DataConfig(mock_data=True, split="98,2,0"), tokenizer, 64, 32, 3, [8, 4, 0]
    )
    assert test is None and len(train) >= 8 and len(valid) >= 4
    sample = train[0]
    assert {k: tuple(v.shape) for k, v in sample.items()} == {
        "text_enc": (64,), "text_dec": (32,), "labels": (32,), "loss_mask": (32,), "truncated": (),
        "enc_mask": (64,), "dec_mask": (32,),
    }  # fmt: skip
    sentinels = set(tokenizer.additional_special_tokens_ids)
    assert sentinels & set(sample["text_enc"].tolist()) and int(sample["text_dec"][0]) == tokenizer.bos
    n = int(sample["loss_mask"].sum())
    assert int(sample["labels"][n - 1]) == tokenizer.eos and (sample["labels"][n:] == -1).all()


def test_bad_t5_inputs_get_one_clear_error(t5_corpus):
    without = BertWordPieceTokenizer(t5_corpus["vocab"])  # no --vocab-extra-ids
    with pytest.raises(DataError, match="--vocab-extra-ids"):
        T5Vocab.from_tokenizer(without)
    tokenizer = BertWordPieceTokenizer(t5_corpus["vocab"], vocab_extra_ids=100)
    low = MockSentenceDataset(tokenizer)
    docs = np.arange(50, dtype=np.int32)
    short = T5Dataset(low, None, docs, 4, "train", _config(tokenizer, enc=256, dec=8))
    with pytest.raises(DataError, match="raise --decoder-seq-length"):
        [short[i] for i in range(len(short))]
    few = T5Dataset(
        low,
        None,
        docs,
        4,
        "train",
        _config(BertWordPieceTokenizer(t5_corpus["vocab"], vocab_extra_ids=1), enc=256, dec=128),
    )
    with pytest.raises(DataError, match="raise --vocab-extra-ids"):
        [few[i] for i in range(len(few))]


def _t5_style_tokenizer(folder, words):
    """A local Hugging Face tokenizer laid out like T5's: <pad>=0 (the decoder start), </s>, <unk>, the
    words, then <extra_id_99> .. <extra_id_0> at the end (T5 counts its sentinels down)."""
    import json

    import tokenizers as tk

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for word in words:
        vocab.setdefault(word, len(vocab))
    tok = tk.Tokenizer(tk.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    tok.add_special_tokens([f"<extra_id_{i}>" for i in range(99, -1, -1)])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_a_hugging_face_t5_vocabulary_brings_its_own_sentinels(t5_corpus, tmp_path):
    from mcore.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    from mcore.data.tokenizers import HuggingFaceTokenizer

    docs = t5_corpus["documents"][:40]
    words = sorted({w for d in docs for s in d for w in s.lower().split()})
    tokenizer = HuggingFaceTokenizer(str(_t5_style_tokenizer(tmp_path / "t5tok", words)))
    view = pickle.loads(pickle.dumps(_config(tokenizer).tokenizer))  # data loader workers pickle it
    assert view.eos == 1 and view.vocab_size == tokenizer.vocab_size
    vocab = T5Vocab.from_tokenizer(tokenizer)
    assert vocab.sentinels[0] == tokenizer._tok.token_to_id("<extra_id_0>") == tokenizer.vocab_size - 1
    assert vocab.sentinels[:3] == (
        tokenizer.vocab_size - 1,
        tokenizer.vocab_size - 2,
        tokenizer.vocab_size - 3,
    )
    assert (vocab.bos, vocab.pad, vocab.eos) == (0, 0, 1)
    prefix = str(tmp_path / "hf_text_sentence")
    builder = IndexedDatasetBuilder(prefix + ".bin")
    for doc in docs:
        for sentence in doc:
            builder.add_item(tokenizer.tokenize(sentence.lower()))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    low = IndexedDataset(prefix)
    ds = T5Dataset(
        low, prefix, np.arange(len(docs), dtype=np.int32), 10, "train", _config(tokenizer, enc=64, dec=48)
    )
    sample = ds[0]
    n = int(sample["dec_mask"].sum())
    assert int(sample["text_dec"][0]) == 0 and n == int(sample["loss_mask"].sum()) > 1  # BOS = <pad> counts
    assert int(sample["labels"][n - 1]) == 1
    assert int(sample["text_dec"][1]) == int(sample["labels"][0]) == vocab.sentinels[0]
    assert vocab.sentinels[0] in sample["text_enc"].tolist()


def test_a_split_rank_for_a_one_stack_model_is_refused():
    from mcore.backend import current_backend
    from mcore.distributed.groups import ProcessGroups
    from mcore.training.gpt import model_provider
    from mcore.training.pretrain import build_training
    from mcore.training.run_config import parse_run_config

    cfg = parse_run_config(
        "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
        "--train-iters 1 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 100 "
        "--pipeline-model-parallel-size 2 --pipeline-model-parallel-split-rank 1".split()
    )
    with pytest.raises(ConfigError, match="split an encoder-decoder model"):
        build_training(cfg, ProcessGroups.single(), current_backend(), model_provider)


def test_fp8_on_t5_is_refused_by_name_and_bert_gets_fp8_linears():
    """``--fp8-format`` is never silently dropped: BERT's encoder linears take it (as GPT's), T5 refuses it."""
    from mcore.distributed.groups import ProcessGroups
    from mcore.training import bert, t5
    from mcore.training.run_config import parse_run_config

    base = "--hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 --fp8-format hybrid"
    t5_cfg = parse_run_config(
        f"{base} --encoder-num-layers 2 --decoder-num-layers 2 --decoder-seq-length 8".split()
    )
    with pytest.raises(ConfigError, match="--fp8-format hybrid: T5 has no FP8 layers"):
        t5.model_provider(t5_cfg, ProcessGroups.single(), 128)
    bert_cfg = parse_run_config(f"{base} --num-layers 2".split())
    model = bert.model_provider(bert_cfg, ProcessGroups.single(), 128)
    assert any(type(m).__name__.startswith("Fp8") for m in model.modules()), "BERT built without FP8 linears"
