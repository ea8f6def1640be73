"""The command line generated from config dataclasses: Megatron spellings, unknown flags, validation."""

from dataclasses import dataclass

import pytest

from mcore.config.cli import build_parser, parse_config
from mcore.config.fields import ConfigError, check, flag
from mcore.config.parallel import ParallelConfig


@dataclass(frozen=True, kw_only=True)
class _Toy:
    """Toy config."""

    num_layers: int = flag(2, "layers")
    ratio: float = flag(0.5, "a ratio")
    name: str | None = flag(None, "a name")
    paths: tuple[str, ...] = flag((), "paths", nargs="*")
    fused: bool = flag(True, "fusion on", name="--no-fused")
    verbose: bool = flag(False, "talk")
    style: str = flag("cosine", "style", choices=("cosine", "linear"))

    def __post_init__(self):
        check(self.num_layers > 0, f"num_layers={self.num_layers} must be positive")


GROUPS = {"toy": _Toy, "parallel": ParallelConfig}


def test_megatron_spellings_parse_into_typed_configs():
    cfg = parse_config(
        GROUPS,
        [
            "--num-layers",
            "4",
            "--ratio",
            "0.25",
            "--paths",
            "a",
            "b",
            "--no-fused",
            "--verbose",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
        ],
    )
    toy, par = cfg["toy"], cfg["parallel"]
    assert (toy.num_layers, toy.ratio, toy.paths, toy.fused, toy.verbose) == (
        4,
        0.25,
        ("a", "b"),
        False,
        True,
    )
    assert par.tensor_model_parallel_size == 2 and par.sequence_parallel
    assert parse_config(GROUPS, [])["toy"] == _Toy()


def test_unknown_flag_is_named_with_a_suggestion(capsys):
    with pytest.raises(SystemExit) as err:
        parse_config(GROUPS, ["--num-layres", "3"])
    assert err.value.code == 2
    assert "unknown flag --num-layres (did you mean --num-layers?)" in capsys.readouterr().err


def test_unsupported_megatron_flag_says_so(capsys):
    with pytest.raises(SystemExit):
        parse_config(GROUPS, ["--use-mup"])
    assert "--use-mup is a Megatron-LM flag mcore does not support: muP" in capsys.readouterr().err


def test_ignored_megatron_flags_are_accepted():
    cfg = parse_config(GROUPS, ["--use-mcore-models", "--transformer-impl", "local", "--num-layers", "3"])
    assert cfg["toy"].num_layers == 3


def test_validation_error_is_one_line_not_a_traceback(capsys):
    with pytest.raises(SystemExit) as err:
        parse_config(GROUPS, ["--num-layers", "0"])
    assert err.value.code == 2
    assert "num_layers=0 must be positive" in capsys.readouterr().err


def test_bad_choice_and_type(capsys):
    with pytest.raises(SystemExit):
        parse_config(GROUPS, ["--style", "zigzag"])
    assert "invalid choice" in capsys.readouterr().err


def test_duplicate_flag_between_groups_is_a_programming_error():
    @dataclass(frozen=True, kw_only=True)
    class Clash:
        """Clash."""

        num_layers: int = flag(1, "again")

    with pytest.raises(TypeError, match="--num-layers is declared by both"):
        build_parser({"toy": _Toy, "clash": Clash})


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)
