"""``--no-fp8-keep-weight-transpose``: the FP8 linears do not keep ``W_q^T`` from forward to backward.

By default the tensorwise/delayed forward's one cast of a weight writes ``W_q`` and ``W_q^T`` and keeps
``W_q^T`` for the input gradient (1 byte a weight element held until the backward). With the flag the
forward casts ``W_q`` only and saves its scale (delayed: the WEIGHT scale; tensorwise: the amax); the
backward casts ``W^T`` again with it (:func:`mcore.fp8.linear.weight_transpose_for_backward`).

1. Bit for bit (CPU, reference ops): a GPT (LayerNorm, GeLU, biases, dropout 0.1) and a Llama-style
   model (RMSNorm, SwiGLU: the fused MLP's two weights), tensorwise, delayed unfused and delayed with
   the fused producers (``Fp8NormLinear``/``Fp8NormMLP``), in the DDP (``main_grad``), three steps of
   two micro-batches with SGD and a scale update between them (the delayed history moves): per-token
   losses, every ``main_grad`` after each step and the delayed states (amax histories, scales) are
   identical with the flag and without; also under full and ``--recompute-modules mlp``
   recomputation, and at TP=2 (2 gloo processes, on each rank; also with sequence parallelism; there
   the saved bytes drop by the rank's weight shards, as in 3.). Each run with the flag must have
   cast the weights again in its backward (else the comparison proves nothing).
2. The casts: with the flag every FP8 weight is cast row-wise in the forward (recording its amax,
   delayed) and column-wise in the backward, which records nothing: the amax records (casts with an
   ``amax_record``) are the same calls with and without the flag.
3. The bytes saved for backward (``saved_tensors_hooks``): the FP8 bytes a training forward saves drop
   by exactly the FP8 linears' weight elements (1 byte each), on the unfused and the fused path.
4. ``--fp8-param-gather``: the layer with a gathered FP8 weight gives the same output and input
   gradient and saves no transposed copy (the gathered bytes are transposed in the backward); and
   ``pretrain`` at DP=2 with the distributed optimizer, the delayed recipe (fused producers) and the
   gathered weights: losses equal without the flag, and the flag reached every FP8 linear.
5. A delayed WEIGHT scale changed in place between forward and backward is refused by autograd's
   version check (the backward would cast with another scale).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mcore.config.parallel import ParallelConfig
from mcore.distributed.ddp import DDPConfig, DistributedDataParallel
from mcore.distributed.groups import ProcessGroups, initialize_parallel
from mcore.fp8 import fused as fp8_fused
from mcore.fp8 import linear as fp8_module
from mcore.fp8.config import Fp8Config
from mcore.fp8.scaling import delayed_states
from mcore.models.gpt.gpt_model import GPTModel
from mcore.models.transformer.model_config import ModelConfig, padded_vocab_size
from mcore.testing.ddp_steps import sgd_steps_on_main_grad
from mcore.testing.distributed import run_distributed

VOCAB, SEQ, BATCH = 100, 16, 2
COMMON = dict(
    num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=SEQ,
    max_position_embeddings=SEQ, make_vocab_size_divisible_by=32, attention_dropout=0.0,
)  # fmt: skip
MODELS = {
    "gpt": dict(COMMON, hidden_dropout=0.1),
    "llama": dict(
        COMMON, hidden_dropout=0.0, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
        disable_bias_linear=True, group_query_attention=True, num_query_groups=2,
        untie_embeddings_and_output_weights=True,
    ),
}  # fmt: skip
PATHS = {
    "tensorwise": dict(fp8_recipe="tensorwise"),
    "delayed": dict(fp8_recipe="delayed", fp8_fused_producers=False),
    "delayed-fused": dict(fp8_recipe="delayed", fp8_fused_producers=True),
}
RECOMPUTE = {
    "none": {},
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "mlp": dict(recompute_granularity="selective", recompute_modules=("mlp",)),
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class _WeightCasts:
    """Records, through the FP8 modules' op tables, every ``fp8_cast`` of a parameter:
    ``(name, rowwise, columnwise, records an amax)``; ``names`` maps data pointers to names."""

    def __init__(self, monkeypatch):
        self.names: dict[int, str] = {}
        self.casts: list[tuple[str, bool, bool, bool]] = []
        self.records = 0  # casts of anything with an amax_record
        recorder = self

        class Recording:
            def __getattr__(self, name):
                from mcore.backend import get_ops

                op = getattr(get_ops(), name)
                if name != "fp8_cast":
                    return op

                def fp8_cast(x, *args, **kwargs):
                    recorded = kwargs.get("amax_record") is not None
                    recorder.records += recorded
                    if x.data_ptr() in recorder.names:
                        rowwise, columnwise = kwargs.get("rowwise", True), kwargs.get("columnwise", False)
                        recorder.casts.append((recorder.names[x.data_ptr()], rowwise, columnwise, recorded))
                    return op(x, *args, **kwargs)

                return fp8_cast

        for module in (fp8_module, fp8_fused):
            monkeypatch.setattr(module, "get_ops", Recording)

    def watch(self, model) -> None:
        self.names = {p.data_ptr(): n for n, p in model.named_parameters() if p.dim() == 2}
        self.casts.clear()
        self.records = 0


def _build(groups, model_name: str, path: str, keep: bool, recompute: str = "none"):
    """``path``: one of :data:`PATHS`, with ``-sp``: sequence parallelism (the FP8 input gather)."""
    sequence_parallel = path.endswith("-sp")
    path = path.removesuffix("-sp")
    fp8 = Fp8Config(
        fp8_format="hybrid",
        fp8_amax_history_len=2,
        fp8_margin=1,
        fp8_keep_weight_transpose=keep,
        **PATHS[path],
    )
    cfg = ModelConfig(**MODELS[model_name], **RECOMPUTE[recompute])
    torch.manual_seed(0)
    vocab = padded_vocab_size(VOCAB, 32, groups.tp_size)
    model = GPTModel(
        cfg, groups, vocab, device=torch.device("cpu"), fp8=fp8, sequence_parallel=sequence_parallel
    )
    fused = path == "delayed-fused"
    assert all(layer.fp8_fused_mlp == fused for layer in model.decoder.layers)
    return model


def _fp8_weights(model) -> dict[str, int]:
    """``{name: elements}`` of the FP8 linears' weights."""
    return {
        name: module.weight.numel()
        for name, module in model.named_modules()
        if getattr(module, "_fp8_call", None) is not None
    }


def _train(
    groups, model_name: str, path: str, keep: bool, recompute="none", casts: _WeightCasts | None = None
):
    """Three DDP steps of two micro-batches (SGD on ``main_grad``, the FP8 scale update after each):
    per-token losses, ``[{name: main_grad}]`` per step, ``{name: state tensor}`` of the delayed states."""
    model = _build(groups, model_name, path, keep, recompute)
    ddp = DistributedDataParallel(model, DDPConfig(), groups)
    if casts is not None:
        casts.watch(model)
    data = torch.randint(0, VOCAB, (3, 2, 2, BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    torch.manual_seed(3)  # the dropout masks
    losses, grads = sgd_steps_on_main_grad(ddp, model, data, groups)
    states = {}
    for name, state in delayed_states(model):
        for key in ("amax_history", "scale", "pending_amax"):
            states[f"{name}.{key}"] = getattr(state, key).clone()
    return losses, grads, states


def _compare(got, want) -> None:
    (losses, grads, states), (want_losses, want_grads, want_states) = got, want
    assert torch.equal(losses, want_losses), (losses - want_losses).abs().max()
    for step, (g, w) in enumerate(zip(grads, want_grads, strict=True)):
        assert g.keys() == w.keys()
        for name in g:
            assert torch.equal(g[name], w[name]), (step, name, (g[name] - w[name]).abs().max())
    assert states.keys() == want_states.keys()
    for name in states:
        assert torch.equal(states[name], want_states[name]), name


def _assert_recast(casts: _WeightCasts, model_name: str, path: str, keep: bool) -> None:
    """Every FP8 weight: one cast a forward (``W_q``, with ``W_q^T`` when kept), and without the kept
    transpose one more, column-wise only, in the backward, recording no amax."""
    fp8_weights = {
        f"{n}.weight" for n in _fp8_weights(_build(ProcessGroups.single(), model_name, path, keep))
    }
    delayed = path != "tensorwise"
    forward = {(n, True, keep, delayed) for n in fp8_weights}
    backward = set() if keep else {(n, False, True, False) for n in fp8_weights}
    assert set(casts.casts) == forward | backward
    # 3 steps x 2 micro-batches, one forward (and one backward) cast of each weight each
    assert len(casts.casts) == len(forward | backward) * 6


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("path", list(PATHS))
def test_dropping_the_weight_transpose_is_bit_identical(monkeypatch, path, model_name):
    single = ProcessGroups.single()
    casts = _WeightCasts(monkeypatch)
    want = _train(single, model_name, path, keep=True, casts=casts)
    _assert_recast(casts, model_name, path, keep=True)
    kept_records = casts.records
    got = _train(single, model_name, path, keep=False, casts=casts)
    _assert_recast(casts, model_name, path, keep=False)
    # the same amax records (no second record of a weight's amax in the backward)
    assert casts.records == kept_records
    _compare(got, want)
    if path != "tensorwise":
        assert any(s.abs().sum() > 0 for s in got[2].values())


@pytest.mark.parametrize("recompute", ["full", "mlp"])
@pytest.mark.parametrize("path", ["tensorwise", "delayed-fused"])
def test_dropping_the_weight_transpose_under_recomputation(monkeypatch, path, recompute):
    single = ProcessGroups.single()
    casts = _WeightCasts(monkeypatch)
    want = _train(single, "gpt", path, keep=True, recompute=recompute)
    got = _train(single, "gpt", path, keep=False, recompute=recompute, casts=casts)
    assert any(not rowwise and columnwise for _, rowwise, columnwise, _ in casts.casts)
    _compare(got, want)


def _saved_fp8_bytes(groups, model_name: str, path: str, keep: bool) -> tuple[int, int]:
    """FP8 bytes one training forward saves for backward, and the FP8 linears' weight elements (this
    rank's shards)."""
    model = _build(groups, model_name, path, keep)
    saved = 0

    def pack(t):
        nonlocal saved
        if t.dtype in FP8_DTYPES:
            saved += t.numel() * t.element_size()
        return t

    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, None, None, labels=tokens)
    loss.mean().backward()
    return saved, sum(_fp8_weights(model).values())


@pytest.mark.parametrize(("model_name", "path"), [("gpt", "tensorwise"), ("llama", "delayed-fused")])
def test_the_saved_fp8_bytes_drop_by_the_weight_elements(model_name, path):
    single = ProcessGroups.single()
    kept, weight_elements = _saved_fp8_bytes(single, model_name, path, keep=True)
    dropped, _ = _saved_fp8_bytes(single, model_name, path, keep=False)
    assert weight_elements > 0 and dropped > 0
    assert kept - dropped == weight_elements, (kept, dropped, weight_elements)


TP2_CASES = (
    ("gpt", "tensorwise"),
    ("llama", "delayed-fused"),
    ("gpt", "delayed"),
    ("llama", "tensorwise-sp"),
)


def _tp2_cases():
    groups = initialize_parallel(ParallelConfig(tensor_model_parallel_size=2))
    out = {}
    for model_name, path in TP2_CASES:
        want = _train(groups, model_name, path, keep=True)
        got = _train(groups, model_name, path, keep=False)
        try:
            _compare(got, want)
            out[f"{model_name}-{path}"] = "ok"
        except AssertionError as error:
            out[f"{model_name}-{path}"] = str(error)
        (kept, shard_elements), (dropped, _) = (
            _saved_fp8_bytes(groups, model_name, path, keep) for keep in (True, False)
        )
        out[f"{model_name}-{path}-bytes"] = kept - dropped == shard_elements > 0
    return out


def test_dropping_the_weight_transpose_at_tp2():
    for rank in run_distributed(_tp2_cases, 2, timeout=300):
        cases = [f"{model_name}-{path}" for model_name, path in TP2_CASES]
        assert rank == {**dict.fromkeys(cases, "ok"), **{f"{c}-bytes": True for c in cases}}, rank


# -- --fp8-param-gather ------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_a_gathered_weight_is_transposed_in_the_backward(recipe):
    """The layer with a gathered FP8 weight: the same output and input gradient with the flag, and the
    forward saves no transposed copy (only the gathered bytes themselves, no new storage)."""
    from mcore.fp8.operand import Fp8Tensor
    from mcore.ops import reference
    from mcore.tensor_parallel.layers import ColumnParallelLinear

    torch.manual_seed(0)
    weight = torch.randn(16, 32).to(torch.bfloat16)
    scale = reference.fp8_scale_from_amax(reference.fp8_amax(weight), torch.float8_e4m3fn, 0)
    gathered = Fp8Tensor(reference.fp8_quantize(weight, scale, torch.float8_e4m3fn), scale.reciprocal())
    x = torch.randn(4, 32, dtype=torch.bfloat16)

    def run(keep: bool):
        fp8 = Fp8Config(fp8_format="hybrid", fp8_recipe=recipe, fp8_keep_weight_transpose=keep)
        layer = ColumnParallelLinear(32, 16, bias=False, fp8=fp8, params_dtype=torch.bfloat16)
        if recipe == "delayed":
            layer.fp8_state.scale[1] = scale
        with torch.no_grad():
            layer.weight.copy_(weight)
        layer.fp8_gathered_weight = gathered
        saved = []
        xg = x.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y, _ = layer(xg)
        y.float().square().sum().backward()
        fp8_saved = [t for t in saved if t.dtype in FP8_DTYPES]
        return y.detach(), xg.grad, fp8_saved

    want_y, want_dx, kept = run(True)
    got_y, got_dx, dropped = run(False)
    assert torch.equal(got_y, want_y) and torch.equal(got_dx, want_dx)
    gathered_ptr = gathered.data.untyped_storage().data_ptr()
    # kept: W_q^T [K, N], a copy of the gathered bytes; dropped: the gathered W_q [N, K] itself
    assert any(t.shape == (32, 16) and t.untyped_storage().data_ptr() != gathered_ptr for t in kept)
    assert not any(t.shape == (32, 16) for t in dropped)
    assert any(t.untyped_storage().data_ptr() == gathered_ptr for t in dropped)


sys.path.insert(0, str(Path(__file__).parents[1] / "checkpoint"))


def train_gathered(extra: list[str]) -> dict:
    """``pretrain`` (the tiny GPT of the checkpoint tests); also the ``keep_weight_transpose`` of every
    FP8 linear the run built and whether the gathered FP8 weights were in use."""
    from ckpt_runs import train

    import mcore.training.gpt as gpt_training

    models = []
    real_provider = gpt_training.model_provider

    def provider(*args, **kwargs):
        model = real_provider(*args, **kwargs)
        models.append(model)
        return model

    gpt_training.model_provider = provider
    try:
        result = train(extra)
    finally:
        gpt_training.model_provider = real_provider
    linears = [m for model in models for m in model.modules() if getattr(m, "_fp8_call", None) is not None]
    return {
        **result,
        "keep": sorted({m._fp8_call.config.fp8_keep_weight_transpose for m in linears}),
        "gathered": all(m.fp8_gathered_weight is not None for m in linears),
        "fused": all(layer.fp8_fused_mlp for model in models for layer in model.decoder.layers),
    }


def train_gathered_runs(runs: list[list[str]]) -> list[dict]:
    """Rank function: :func:`train_gathered` of each argv, one after another."""
    return [train_gathered(extra) for extra in runs]


def test_pretrain_flag_reaches_the_linears_and_gathered_losses_are_equal():
    """``--no-fp8-keep-weight-transpose`` through the real flag parsing, at DP=2 with the distributed
    optimizer and ``--fp8-param-gather`` (delayed, fused producers): the flag reached every FP8 linear
    and the losses equal a run without it."""
    from mcore.training.run_config import parse_run_config

    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]
    argv += ["--fp8-format", "hybrid"]
    assert parse_run_config(argv).fp8.fp8_keep_weight_transpose
    flagged = parse_run_config([*argv, "--no-fp8-keep-weight-transpose"]).fp8
    assert not flagged.fp8_keep_weight_transpose

    common = ["--bf16", "--use-distributed-optimizer", "--fp8-format", "hybrid", "--fp8-recipe", "delayed"]
    common += ["--fp8-param-gather", "--clip-grad", "0", "--train-iters", "3"]
    # both runs in a row in one launch (each pretrain builds its model and optimizer anew)
    kept, dropped = run_distributed(
        train_gathered_runs, 2, [common, [*common, "--no-fp8-keep-weight-transpose"]], timeout=300
    )[-1]
    assert kept["keep"] == [True] and dropped["keep"] == [False]
    assert dropped["gathered"] and dropped["fused"]
    assert len(dropped["losses"]) == 3 and dropped["losses"] == kept["losses"]


def test_a_scale_changed_between_forward_and_backward_is_refused():
    """The delayed WEIGHT scale is saved as the state's slot: an in-place change before the backward
    (a scale update in the middle of a step) fails autograd's version check instead of casting
    ``W^T`` with another scale than the forward's ``W_q``."""
    from mcore.tensor_parallel.layers import ColumnParallelLinear

    fp8 = Fp8Config(fp8_format="hybrid", fp8_recipe="delayed", fp8_keep_weight_transpose=False)
    layer = ColumnParallelLinear(32, 16, bias=False, fp8=fp8)
    y, _ = layer(torch.randn(4, 32, requires_grad=True))
    layer.fp8_state.scale.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
