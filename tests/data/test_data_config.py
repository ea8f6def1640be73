"""DataConfig / TokenizerConfig: Megatron's flag spellings through the generated parser, and validation."""

from __future__ import annotations

import pytest

from mcore.config.cli import build_configs, build_parser
from mcore.config.fields import ConfigError
from mcore.data.config import DataConfig, TokenizerConfig
from mcore.data.splits import DEFAULT_SPLIT

GROUPS = {"data": DataConfig, "tokenizer": TokenizerConfig}


def _parse(argv):
    return build_configs(GROUPS, build_parser(GROUPS).parse_args(argv))


def test_megatron_flags_parse():
    configs = _parse(
        [
            "--data-path", "0.3", "a_text_document", "0.7", "b_text_document",
            "--split", "949,50,1", "--data-cache-path", "/cache", "--num-workers", "4",
            "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss", "--no-mmap-bin-files",
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json", "--merge-file", "m.txt",
        ]
    )  # fmt: skip
    data, tok = configs["data"], configs["tokenizer"]
    assert data.data_path == ("0.3", "a_text_document", "0.7", "b_text_document")
    assert data.split == "949,50,1" and data.data_cache_path == "/cache" and data.num_workers == 4
    assert data.reset_position_ids and data.reset_attention_mask and data.eod_mask_loss
    assert data.mmap_bin_files is False
    assert (tok.tokenizer_type, tok.vocab_file, tok.merge_file) == ("GPT2BPETokenizer", "v.json", "m.txt")


def test_defaults():
    configs = _parse(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"])
    data = configs["data"]
    assert data.split == DEFAULT_SPLIT == "969, 30, 1"
    assert data.num_workers == 2 and data.mmap_bin_files is True and data.data_cache_path is None
    assert not (data.reset_position_ids or data.reset_attention_mask or data.eod_mask_loss)
    assert configs["tokenizer"].vocab_size == 128


def test_per_split_paths_parse():
    data = _parse(["--train-data-path", "t", "--valid-data-path", "1", "v1", "2", "v2"])["data"]
    assert data.train_data_path == ("t",) and data.valid_data_path == ("1", "v1", "2", "v2")
    assert data.test_data_path == ()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"data_path": ("a",), "train_data_path": ("b",)}, "not both"),
        ({"mock_data": True, "data_path": ("a",)}, "--mock-data generates its own samples"),
        ({"split": "1,2,3,4"}, "has 4 numbers"),
        ({"data_path": ("0", "a", "1", "b")}, "weight 0 for 'a' must be a positive number"),
        ({"num_workers": -1}, "num_workers=-1 must be >= 0"),
    ],
)
def test_validation(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        DataConfig(**kwargs)


def test_a_negative_split_is_refused_at_the_command_line():
    with pytest.raises(ConfigError, match=r"--split '100,-5,5': '-5' is not a proportion"):
        _parse(["--data-path", "a_text_document", "--split", "100,-5,5"])
