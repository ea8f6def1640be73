"""``--fp8-param-gather``: the distributed optimizer all-gathers the FP8 linears' weights in FP8.

1. The FP8 linear computes with a gathered weight (``fp8_gathered_weight``) instead of casting its own:
   bit for bit the cast of that weight, forward and backward (one process).
2. ``pretrain`` at DP=2 with the distributed optimizer and bf16 parameters, 4 steps, tensorwise and
   delayed, without gradient clipping: the losses with the flag equal those without it. Tolerance:
   none (exact). Why: each rank quantizes its shard of the bf16 weight with the whole weight's scale
   (tensorwise: the amax max-reduced over DP; delayed: the replicated WEIGHT scale, its amax recorded
   at the quantization), so the gathered FP8 bytes and scale_inv are exactly what the per-forward
   cast of the same bf16 weight makes; the GEMMs get identical operands. (Megatron quantizes the
   fp32 master instead, which differs by one FP8 step wherever bf16 rounding crosses an FP8 rounding
   boundary.) With clipping (``--clip-grad 1.0``) the FP8 weights' own gradient buffer changes the
   fp32 summation order of the global gradient norm: the clip factor moves by about an fp32 ulp, a
   few bf16 weights round the other way and, through FP8 rounding, the loss moves by ~1e-5 relative
   at step 4 (measured 8.5e-6), as any other bucket layout change does: 1e-4 relative there.
   The parameter all-gathers of those weights move uint8 (FP8) bytes, half of bf16's; after training,
   the gathered FP8 weight is the cast of the (exactly gathered) bf16 weight with one scale.
   The same with ``--overlap-param-gather`` (the layers' forward pre-hooks wait for the FP8 gather),
   and at TP=2 (the weight's amax max-reduced over TP too).
   With the delayed recipe the flat optimizer step writes the FP8 copies (``adam_step_flat_fp8``)
   and the separate quantization runs only when the weights are set otherwise (construction, a
   checkpoint load); tensorwise keeps the quantization after the step. The same at DP=1 (one process:
   the distributed optimizer owns every piece): the losses equal those without the flag.
   Every weight's ``scale_inv`` is 16-byte aligned (cuBLASLt's FP8 GEMMs refuse other scale pointers).
3. Save at iteration 2 and resume: the resumed losses are bit for bit the uninterrupted run's (the
   resumed run's steps write the FP8 copies too); the saved model file equals the one a run without
   the flag saves; a weights-only load (``--no-load-optim``) re-quantizes the FP8 copies from the
   loaded weights.
4. Bad combinations are refused with one message naming the flags.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mcore.testing.distributed import run_distributed

sys.path.insert(0, str(Path(__file__).parents[1] / "checkpoint"))
from ckpt_runs import argv as ckpt_argv  # noqa: E402
from ckpt_runs import train  # noqa: E402

ITERS = 4
COMMON = ["--bf16", "--use-distributed-optimizer", "--fp8-format", "hybrid", "--train-iters", str(ITERS)]
NO_CLIP = ["--clip-grad", "0"]
GATHER = ["--fp8-param-gather"]


# -- 1. the layer uses the gathered weight ---------------------------------------------------------


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_linear_computes_with_the_gathered_weight(recipe):
    from mcore.fp8.config import Fp8Config
    from mcore.fp8.operand import Fp8Tensor
    from mcore.ops import reference
    from mcore.tensor_parallel.layers import ColumnParallelLinear

    torch.manual_seed(0)
    fp8 = Fp8Config(fp8_format="hybrid", fp8_recipe=recipe)
    layer = ColumnParallelLinear(32, 16, bias=False, fp8=fp8, params_dtype=torch.bfloat16)
    other = torch.randn(16, 32).to(torch.bfloat16)  # a weight the layer does not hold
    scale = reference.fp8_scale_from_amax(reference.fp8_amax(other), torch.float8_e4m3fn, 0)
    if recipe == "delayed":
        layer.fp8_state.scale[1] = scale  # the WEIGHT role's scale
    x = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)

    def run():
        x.grad = None
        y, _ = layer(x)
        y.float().square().sum().backward()
        return y.detach(), x.grad.clone()

    layer.fp8_gathered_weight = None
    with torch.no_grad():
        layer.weight.copy_(other)
    want_y, want_dx = run()
    with torch.no_grad():
        layer.weight.zero_()  # the layer's own weight must not be read
    q = reference.fp8_quantize(other, scale, torch.float8_e4m3fn)
    layer.fp8_gathered_weight = Fp8Tensor(q, scale.reciprocal())
    got_y, got_dx = run()
    assert torch.equal(got_y, want_y) and torch.equal(got_dx, want_dx)


# -- 2./3. pretrain at DP=2 ------------------------------------------------------------------------


def train_recording(extra: list[str]) -> dict:
    """``train(extra)``, recording every parameter all-gather (dtype, bytes) of the last step and,
    afterwards, checking the FP8 copies against the exactly gathered bf16 weights."""
    import mcore.distributed.grad_buffer as grad_buffer
    from mcore.distributed.ddp import DistributedDataParallel
    from mcore.fp8.config import Recipe
    from mcore.fp8.param_gather import Fp8ParamGather
    from mcore.ops import reference
    from mcore.optimizer.optimizer import MegatronOptimizer

    gathers: list[tuple[str, int]] = []
    chunks: list[DistributedDataParallel] = []
    reports: list[dict[str, int]] = []
    real_gather, real_init = grad_buffer.all_gather_into_tensor, DistributedDataParallel.__init__
    real_report = MegatronOptimizer.memory_report
    real_quantize = Fp8ParamGather.quantize_shards
    quantizations = []

    def recording_quantize(self):
        quantizations.append(1)
        return real_quantize(self)

    def recording_gather(output, input, *args, **kwargs):
        gathers.append((str(output.dtype), output.numel() * output.element_size()))
        return real_gather(output, input, *args, **kwargs)

    def recording_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        chunks.append(self)

    def recording_report(self):
        reports.append(real_report(self))
        return reports[-1]

    grad_buffer.all_gather_into_tensor = recording_gather
    DistributedDataParallel.__init__ = recording_init
    MegatronOptimizer.memory_report = recording_report
    Fp8ParamGather.quantize_shards = recording_quantize
    try:
        result = train(extra)
    finally:
        grad_buffer.all_gather_into_tensor, DistributedDataParallel.__init__ = real_gather, real_init
        MegatronOptimizer.memory_report = real_report
        Fp8ParamGather.quantize_shards = real_quantize
    per_step = gathers[-len(chunks[0].buckets) :]  # the last step's gathers, one per bucket
    fp8_weights = fp8_buffer_bytes = fused_steps = fp8_buffers = 0
    copies_exact = scales_aligned = True
    for chunk in chunks:
        chunk.gather_full_precision_params()
        for buffer in chunk.grad_buffers:
            fp8 = buffer.fp8_gather
            if fp8 is None:
                continue
            fp8_buffer_bytes += fp8.data.numel() * fp8.data.element_size()
            fused_steps += fp8.fused_steps
            fp8_buffers += 1
            for layer in fp8.layers:
                gathered = layer.fp8_gathered_weight
                scales_aligned &= gathered.scale_inv.data_ptr() % 16 == 0
                fp8_weights += gathered.data.numel()
                assert gathered.data.dtype == torch.float8_e4m3fn
                q = reference.fp8_quantize(layer.weight, gathered.scale_inv.reciprocal(), torch.float8_e4m3fn)
                copies_exact &= torch.equal(q.view(torch.uint8), gathered.data.view(torch.uint8))
                tp1 = layer.tp_size == 1  # (under TP the amax is the whole weight's, over the shards)
                if tp1 and layer._fp8_call.config.recipe is Recipe.TENSORWISE:  # one scale: the weight's amax
                    amax = reference.fp8_amax(layer.weight)
                    want = reference.fp8_scale_from_amax(amax, torch.float8_e4m3fn, 0).reciprocal()
                    copies_exact &= torch.equal(gathered.scale_inv, want)
    return {
        **result,
        "gathers": per_step,
        "fp8_weights": fp8_weights,
        "fp8_buffer_bytes": fp8_buffer_bytes,
        "copies_exact": bool(copies_exact),
        "scales_aligned": bool(scales_aligned),
        "fp8_buffers": fp8_buffers,
        "fused_steps": fused_steps,  # summed over the FP8 buffers
        "quantizations": len(quantizations),  # quantize_shards calls
        "params_bytes": reports[-1]["params"] if reports else None,
    }


def train_many(runs: list[tuple[str, list[str]]]) -> list[dict]:
    """Rank function: ``("recording", argv)``/``("plain", argv)`` runs (:func:`train_recording`,
    ``train``) one after another; each ``pretrain`` builds its model, optimizer and data anew."""
    return [(train_recording if kind == "recording" else train)(argv) for kind, argv in runs]


def _launch(nprocs: int, runs: list[tuple[str, list[str]]]) -> list[list[dict]]:
    """The runs in a row in ONE launch of ``nprocs`` ranks (starting the ranks costs more than a run):
    per run, the per-rank results."""
    per_rank = run_distributed(train_many, nprocs, runs, timeout=300)
    return [[rank[i] for rank in per_rank] for i in range(len(runs))]


def _rec(recipe: str, *extra: str) -> tuple[str, list[str]]:
    return ("recording", [*COMMON, "--fp8-recipe", recipe, *extra])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    save = tmp_path_factory.mktemp("fp8_param_gather") / "ckpt"
    saving = ["--save", str(save), "--save-interval", "2"]
    saving_ref = ["--save", str(save.parent / "ref"), "--save-interval", "2"]
    tp2 = ["--tensor-model-parallel-size", "2", *NO_CLIP]
    dp2 = _launch(
        2,
        [
            _rec("tensorwise", *NO_CLIP), _rec("tensorwise", *NO_CLIP, *GATHER),
            _rec("delayed", *NO_CLIP, *saving_ref), _rec("delayed", *NO_CLIP, *GATHER, *saving),
            _rec("tensorwise"), _rec("tensorwise", *GATHER),  # with clipping
            _rec("tensorwise", *NO_CLIP, *GATHER, "--overlap-param-gather"),
            _rec("tensorwise", *tp2), _rec("tensorwise", *tp2, *GATHER),
        ],
    )  # fmt: skip
    last = [ranks[-1] for ranks in dp2]
    out = {"tensorwise": (last[0], last[1]), "delayed": (last[2], last[3])}
    out.update(clipped=(last[4], last[5]), overlap=last[6], tp2=(last[7], last[8]))
    # The resumes in other processes than the ones that saved: only the checkpoint passes between them.
    resume = [*COMMON, "--fp8-recipe", "delayed", *NO_CLIP, "--load", str(save), "--ckpt-step", "2"]
    # the weights alone (fresh optimizer): the FP8 copies must be made from the loaded weights
    resumed, *weights_only = _launch(
        2, [("recording", [*resume, *GATHER])] + [("plain", [*resume, *flag, "--no-load-optim"]) for flag in ([], GATHER)]
    )  # fmt: skip
    out["resumed"] = resumed
    out["weights_only"] = [ranks[-1] for ranks in weights_only]
    out["ckpt"] = save.parent
    dp1 = _launch(1, [_rec("delayed", *NO_CLIP), _rec("delayed", *NO_CLIP, *GATHER)])
    out["dp1"] = (dp1[0][-1], dp1[1][-1])
    return out


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_dp2_losses_with_fp8_param_gather_equal_without(runs, recipe):
    without, with_flag = runs[recipe]
    assert len(with_flag["losses"]) == ITERS
    assert with_flag["losses"] == without["losses"]  # exact: see the module docstring


def test_delayed_recipe_writes_the_fp8_copies_in_the_optimizer_step(runs):
    """Delayed: every step's FP8 copies come from ``adam_step_flat_fp8`` (fused_steps: one per step
    and FP8 buffer); ``quantize_shards`` runs only for the initial weights (the construction's
    refresh, once per buffer). Tensorwise (its scale needs the new weights' amax): quantize_shards
    after every step, never the fused step. The losses of both equal those without the flag (above)."""
    delayed, tensorwise = runs["delayed"][1], runs["tensorwise"][1]
    assert delayed["fp8_buffers"] > 0 and tensorwise["fp8_buffers"] > 0
    assert delayed["fused_steps"] == ITERS * delayed["fp8_buffers"]
    assert delayed["quantizations"] == delayed["fp8_buffers"]
    assert tensorwise["fused_steps"] == 0
    assert tensorwise["quantizations"] == (ITERS + 1) * tensorwise["fp8_buffers"]


def test_dp1_delayed_fp8_param_gather_losses_equal_without(runs):
    """One process (the distributed optimizer owns every piece, no collective): the optimizer step
    writes the FP8 copies and the losses are exactly those without the flag."""
    without, with_flag = runs["dp1"]
    assert with_flag["fused_steps"] == ITERS * with_flag["fp8_buffers"] > 0
    assert len(with_flag["losses"]) == ITERS
    assert with_flag["losses"] == without["losses"]
    assert with_flag["copies_exact"]


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_gathered_scale_inv_is_16_byte_aligned(runs, recipe):
    """cuBLASLt refuses FP8 GEMM scale pointers that are not 16-byte aligned: every weight's
    ``scale_inv`` view lies on a 16-byte boundary."""
    assert runs[recipe][1]["fp8_weights"] > 0
    assert runs[recipe][1]["scales_aligned"]


def test_overlapped_fp8_param_gather_gives_the_same_losses(runs):
    """--overlap-param-gather: each FP8 linear's forward pre-hook waits for its bucket's FP8 gather."""
    assert runs["overlap"]["losses"] == runs["tensorwise"][0]["losses"]
    assert runs["overlap"]["copies_exact"]


def test_tp2_fp8_param_gather_scales_with_the_whole_weights_amax(runs):
    """TP=2 (DP=1): a weight's amax is max-reduced over TP before its scale is formed, as the
    per-forward cast does, so every TP shard is quantized with the whole weight's scale."""
    without, with_flag = runs["tp2"]
    assert with_flag["fp8_weights"] > 0
    assert with_flag["losses"] == without["losses"]


def test_dp2_losses_with_clipping_follow_within_the_bucket_layout_tolerance(runs):
    without, with_flag = runs["clipped"]
    for got, want in zip(with_flag["losses"], without["losses"], strict=True):
        assert abs(got - want) <= 1e-4 * abs(want), (with_flag["losses"], without["losses"])


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_weights_are_gathered_as_fp8_bytes(runs, recipe):
    without, with_flag = runs[recipe]
    assert without["fp8_buffer_bytes"] == 0 and all(
        dtype == "torch.bfloat16" for dtype, _ in without["gathers"]
    )
    fp8_bytes = sum(n for dtype, n in with_flag["gathers"] if dtype == "torch.uint8")
    bf16_bytes = sum(n for dtype, n in with_flag["gathers"] if dtype == "torch.bfloat16")
    assert fp8_bytes == with_flag["fp8_buffer_bytes"]  # 1 byte per element of the FP8 weights' buffer
    assert with_flag["fp8_weights"] <= fp8_bytes < with_flag["fp8_weights"] + 256  # + bucket padding
    # the other parameters still go in bf16; the FP8 weights' share of the bytes halved
    baseline = sum(n for _, n in without["gathers"])
    assert bf16_bytes + 2 * fp8_bytes - baseline in range(-512, 513)
    assert with_flag["copies_exact"]
    # the memory report counts the FP8 copies beside the parameters
    assert with_flag["params_bytes"] - without["params_bytes"] == with_flag["fp8_buffer_bytes"] > 0


def test_fp8_param_gather_resume_is_bit_exact(runs):
    straight = runs["delayed"][1]["losses"]
    assert runs["resumed"][-1]["losses"] == straight[2:]
    resumed = runs["resumed"][-1]  # its two steps wrote the FP8 copies in the optimizer step
    assert resumed["fused_steps"] == (ITERS - 2) * resumed["fp8_buffers"] > 0


def test_fp8_param_gather_checkpoint_holds_the_exact_weights(runs):
    """The checkpoint's model file equals the one a run without the flag saves (the FP8 linears'
    weights are gathered in bf16 for the save, not dequantized from FP8)."""
    name = "iter_0000002/model_tp00_pp000.pt"
    with_flag = torch.load(runs["ckpt"] / "ckpt" / name, weights_only=False)
    without = torch.load(runs["ckpt"] / "ref" / name, weights_only=False)
    tensors = [k for k, v in without.items() if isinstance(v, torch.Tensor)]
    assert tensors and with_flag.keys() == without.keys()
    for key in tensors:
        assert torch.equal(with_flag[key], without[key]), key


def test_fp8_param_gather_loads_weights_without_optimizer_state(runs):
    without, with_flag = runs["weights_only"]
    assert len(with_flag["losses"]) == ITERS - 2
    assert with_flag["losses"] == without["losses"]


# -- 4. refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--fp8-param-gather"], "--fp8-param-gather needs --fp8-format"),
        (
            ["--fp8-param-gather", "--fp8-format", "hybrid", "--fp8-recipe", "rowwise"],
            "--fp8-param-gather with --fp8-recipe rowwise is not supported",
        ),
    ],
)
def test_fp8_param_gather_refused_without_fp8_or_with_rowwise(flags, message, capsys):
    from mcore.training.run_config import parse_run_config

    with pytest.raises(SystemExit) as err:
        parse_run_config(ckpt_argv(*flags))
    assert err.value.code == 2
    assert message in capsys.readouterr().err


def test_fp8_param_gather_refused_without_distributed_optimizer():
    from mcore.config.fields import ConfigError
    from mcore.plugins.manager import select_backend
    from mcore.training.pretrain import check_run_config
    from mcore.training.run_config import parse_run_config

    cfg = parse_run_config(ckpt_argv("--fp8-format", "hybrid", "--fp8-param-gather", "--train-iters", "1"))
    with pytest.raises(ConfigError, match="--fp8-param-gather needs --use-distributed-optimizer"):
        check_run_config(cfg, select_backend("cpu"), world_size=2)
    flags = (
        "--fp8-format",
        "hybrid",
        "--fp8-param-gather",
        "--use-distributed-optimizer",
        "--train-iters",
        "1",
    )
    check_run_config(parse_run_config(ckpt_argv(*flags)), select_backend("cpu"), world_size=2)  # accepted
