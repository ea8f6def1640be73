"""The experts in FP8 (``mcore.fp8.grouped``): the quantized grouped GEMM's forward and both gradients
against the ops' reference math, the CUDA wrappers' layouts (``torch._scaled_grouped_mm`` stood in
for on CPU, its argument checks run by torch's meta kernel), which layers use it, and a tiny MoE GPT
trained with ``--fp8-format`` next to bf16 through ``pretrain``, its op calls traced."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import torch
from mcore.backends.cuda import grouped_fp8

from mcore.backend import CPUBackend, set_current_backend
from mcore.fp8.config import Fp8Config
from mcore.fp8.grouped import EXPERTS_CAPABILITY, experts_fp8_status, fp8_grouped_gemm, quantize_rows
from mcore.ops import reference
from mcore.ops.registry import OpRegistry
from mcore.testing.conformance.op_cases import OP_CASES
from mcore.testing.conformance.op_checks import check_op

COUNTS = torch.tensor([5, 0, 19, 3])  # an expert without a token, group sizes not multiples of 16


def _operands(k=32, m=48, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(int(COUNTS.sum()), k, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(len(COUNTS), m, k, generator=gen) * k**-0.5).to(dtype).requires_grad_()
    dy = torch.randn(x.shape[0], m, generator=gen).to(dtype)
    return x, w, dy


def _per_expert_columns(t: torch.Tensor) -> torch.Tensor:
    """``t [N, C]`` dequantized with one e4m3 scale per (expert, column), as a loop over experts."""
    out = []
    for part in torch.split(t.float(), COUNTS.tolist()):
        if part.shape[0] == 0:
            out.append(part)
            continue
        scale = reference.fp8_scale_from_amax(part.abs().amax(0, keepdim=True), torch.float8_e4m3fn, 0)
        out.append(reference.fp8_quantize(part, scale, torch.float8_e4m3fn).float() / scale)
    return torch.cat(out)


def _per_row(t: torch.Tensor) -> torch.Tensor:
    scale = reference.fp8_scale_from_amax(t.float().abs().amax(-1, keepdim=True), torch.float8_e4m3fn, 0)
    return reference.fp8_quantize(t, scale, torch.float8_e4m3fn).float() / scale


def test_fp8_grouped_gemm_is_the_per_row_quantized_grouped_gemm():
    """Forward, input and weight gradient equal the bf16 grouped GEMM of the operands each GEMM
    quantizes (per token, per expert row/column, the weight gradient per expert column), computed
    here by loops; the empty expert's weight gradient is exactly zero."""
    x, w, dy = _operands()
    y = fp8_grouped_gemm(x, w, COUNTS)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    want_y = reference.grouped_gemm(_per_row(x), _per_row(w), COUNTS)
    want_dx = reference.grouped_gemm(_per_row(dy), _per_row(w.transpose(1, 2)), COUNTS)
    dy_c, x_c = _per_expert_columns(dy), _per_expert_columns(x)
    want_dw = torch.stack(
        [a.t() @ b for a, b in zip(torch.split(dy_c, COUNTS.tolist()), torch.split(x_c, COUNTS.tolist()))]
    )
    for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
        torch.testing.assert_close(got.float(), want.to(got.dtype).float(), rtol=1.6e-2, atol=1e-5)
    assert torch.equal(dw[1], torch.zeros_like(dw[1]))
    exact = reference.grouped_gemm(x.detach().double(), w.detach().double(), COUNTS)
    assert ((y.double() - exact).norm() / exact.norm()).item() < 0.06  # FP8's error, no more


def test_quantize_rows_of_an_empty_rank():
    q, sinv = quantize_rows(torch.zeros(0, 32, dtype=torch.bfloat16), 0)
    assert q.shape == (0, 32) and q.dtype == torch.float8_e4m3fn and sinv.shape == (0,)


def _stand_in_scaled_grouped_mm(calls):
    """``torch._scaled_grouped_mm`` on CPU: torch's meta kernel checks the dtypes, layouts and scale
    shapes; the 2-D x 2-D offsets must be multiples of 16; the result dequantizes in fp32."""

    def run(a, b, scale_a, scale_b, offs=None, out_dtype=None, **kwargs):
        meta = [t.to("meta") if t is not None else None for t in (a, b, scale_a, scale_b, offs)]
        torch.ops.aten._scaled_grouped_mm(*meta[:4], offs=meta[4], out_dtype=out_dtype)
        calls.append((a.dim(), b.dim()))
        ends = offs.tolist()
        starts = [0, *ends[:-1]]
        if a.dim() == 2 and b.dim() == 2:
            assert all(o % 16 == 0 for o in ends), ends
            m, k = a.shape[0], b.shape[1]
            blocks = [
                (a[:, s:e].float() * scale_a[g * m : (g + 1) * m, None])
                @ (b[s:e].float() * scale_b[None, g * k : (g + 1) * k])
                for g, (s, e) in enumerate(zip(starts, ends))
            ]
            return torch.stack(blocks).to(out_dtype)
        rows = [
            (a[s:e].float() * scale_a[s:e, None]) @ (b[g].float() * scale_b[g][None, :])
            for g, (s, e) in enumerate(zip(starts, ends))
        ]
        return torch.cat(rows).to(out_dtype)

    return run


def test_cuda_wrappers_pass_the_kernel_its_layouts(monkeypatch):
    """The CUDA ops on CPU tensors through a stand-in kernel equal the reference ops: the forward's
    2-D x 3-D call, the weight gradient's 2-D x 2-D call over 16-aligned token blocks (with the
    empty expert zeroed), a rank without tokens, and the fallbacks (e5m2, fp32 output)."""
    calls = []
    monkeypatch.setattr(grouped_fp8, "KERNEL_ON_CPU", True)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _stand_in_scaled_grouped_mm(calls))
    gen = torch.Generator().manual_seed(1)
    n, k, m, e = int(COUNTS.sum()), 32, 48, len(COUNTS)
    q = lambda *s: (torch.randn(*s, generator=gen) * 50).to(torch.float8_e4m3fn)  # noqa: E731
    s = lambda *s: torch.rand(*s, generator=gen) * 0.01 + 1e-3  # noqa: E731
    args = (q(n, k), q(e, m, k), s(n), s(e, m), COUNTS, torch.bfloat16)
    torch.testing.assert_close(grouped_fp8.scaled_grouped_gemm(*args), reference.scaled_grouped_gemm(*args))
    args = (q(m, n), q(k, n), s(e, m), s(e, k), COUNTS, torch.bfloat16)
    got = grouped_fp8.scaled_grouped_gemm_wgrad(*args)
    torch.testing.assert_close(got, reference.scaled_grouped_gemm_wgrad(*args))
    assert calls == [(2, 3), (2, 2)]
    empty = (q(0, k), q(e, m, k), s(0), s(e, m), torch.zeros(e, dtype=torch.int64), torch.bfloat16)
    assert grouped_fp8.scaled_grouped_gemm(*empty).shape == (0, m)
    e5m2 = (args[0].float().to(torch.float8_e5m2), *args[1:])
    torch.testing.assert_close(
        grouped_fp8.scaled_grouped_gemm_wgrad(*e5m2), reference.scaled_grouped_gemm_wgrad(*e5m2)
    )
    grouped_fp8.scaled_grouped_gemm_wgrad(*args[:-1], torch.float32)
    assert len(calls) == 2  # no kernel call for e5m2, nor for an fp32 output
    registry = OpRegistry(reference.REFERENCE_OPS)
    for name, fn in grouped_fp8.GROUPED_FP8_OPS.items():
        registry.override(name, fn, provider="cuda-on-cpu")
    backend = SimpleNamespace(
        ops=registry.freeze(), device=lambda index: torch.device("cpu"), device_type="cpu"
    )
    for case in OP_CASES:
        if case.op.startswith("scaled_grouped_gemm"):
            for dtype in case.dtypes:
                check_op(backend, case, dtype)
    assert (2, 3) in calls[2:]  # the e4m3 conformance forward through the stand-in kernel


class _NoGroupedFp8(CPUBackend):
    name = "cpu-no-grouped-fp8"
    _capabilities = CPUBackend._capabilities - {EXPERTS_CAPABILITY}


def test_experts_stay_in_bf16_where_the_backend_has_no_scaled_grouped_gemm():
    from mcore.models.transformer.build_context import BuildContext
    from mcore.models.transformer.model_config import ModelConfig
    from mcore.models.transformer.moe.moe_layer import MoELayer

    fp8 = Fp8Config(fp8_format="hybrid", fp8_recipe="delayed")
    cfg = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=4, num_experts=4)
    ctx = BuildContext(params_dtype=torch.bfloat16, fp8=fp8, num_layers=1)
    assert MoELayer(cfg, ctx).experts.fp8_margin == 0  # the CPU backend emulates the op
    previous = set_current_backend(_NoGroupedFp8())
    try:
        assert MoELayer(cfg, ctx).experts.fp8_margin is None
    finally:
        set_current_backend(previous)
    used, line = experts_fp8_status(fp8, _NoGroupedFp8().capabilities(), "cpu-no-grouped-fp8", 1)
    assert not used and "stay in the parameters' dtype" in line and "dense linears run FP8" in line
    assert not experts_fp8_status(fp8, CPUBackend().capabilities(), "cpu", 2)[0]  # ETP > 1


def test_fp8_experts_with_moe_act_recompute_give_the_same_gradients():
    """``--recompute-modules moe_act`` with FP8 experts: fc2's saved input is recomputed from fc1's
    output, the gradients are those of the run that keeps it (the same quantizations of the same
    values)."""
    from mcore.models.transformer.build_context import BuildContext
    from mcore.models.transformer.model_config import ModelConfig
    from mcore.models.transformer.moe.moe_layer import MoELayer

    fp8 = Fp8Config(fp8_format="e4m3", fp8_recipe="rowwise")
    ctx = BuildContext(params_dtype=torch.bfloat16, fp8=fp8, num_layers=1)
    base = dict(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=4, num_experts=4, swiglu=True)
    base.update(ffn_hidden_size=16, disable_bias_linear=True)
    x = torch.randn(4, 2, 16, dtype=torch.bfloat16)
    grads = []
    for extra in ({}, dict(recompute_granularity="selective", recompute_modules=("moe_act",))):
        torch.manual_seed(0)
        layer = MoELayer(ModelConfig(**base, moe_ffn_hidden_size=16, **extra), ctx).train()
        assert layer.experts.fp8_margin == 0
        with torch.no_grad():  # the layer's parameters are created uninitialized
            for p in layer.parameters():
                p.copy_(torch.randn_like(p, dtype=torch.float32) * 0.5)
        layer(x)[0].float().square().sum().backward()
        grads.append([p.grad for p in layer.experts.parameters()])
    for a, b in zip(*grads):
        assert torch.isfinite(a).all() and a.abs().sum() > 0 and torch.equal(a, b)


def _tiny_moe_argv(tmp_path) -> list[str]:
    from mcore.data.preprocess import main as preprocess_main

    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text(
        "".join(
            json.dumps({"text": " ".join(str(i % 50) for i in range(j, j + 30))}) + "\n" for j in range(40)
        )
    )
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "64"]
    assert (
        preprocess_main(
            ["--input", str(jsonl), "--output-prefix", str(tmp_path / "d"), "--append-eod", *null]
        )
        == 0
    )
    return [
        "--device-backend", "cpu", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--lr", "1e-2", "--train-iters", "4", "--num-workers", "0",
        "--eval-iters", "0", "--data-path", str(tmp_path / "d_text_document"), *null, "--bf16",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1", "--seed", "3",
        "--num-experts", "4", "--moe-router-topk", "2", "--swiglu", "--moe-ffn-hidden-size", "32",
        "--ffn-hidden-size", "32", "--moe-aux-loss-coeff", "1e-2", "--disable-bias-linear",
    ]  # fmt: skip


def test_tiny_moe_gpt_trains_with_fp8_experts_near_bf16(tmp_path, caplog):
    """The same 4 steps in bf16 and with ``--fp8-format hybrid --fp8-recipe rowwise``: the FP8 run calls
    the experts' FP8 GEMMs (traced by a recorder plugin), says so at start-up, and its losses stay
    within 2% of bf16's."""
    from mcore.plugins.manager import plugin_manager, register_plugin
    from mcore.testing.op_trace import OpCallRecorder
    from mcore.training.gpt import forward_step, model_provider
    from mcore.training.pretrain import pretrain

    argv = _tiny_moe_argv(tmp_path)
    bf16 = pretrain(model_provider, forward_step, argv=argv).train_losses
    recorder = OpCallRecorder()
    manager = plugin_manager()
    register_plugin(manager, recorder, "op-recorder-moe-fp8")
    try:
        with caplog.at_level(logging.INFO, logger="mcore"):
            fp8 = pretrain(
                model_provider,
                forward_step,
                argv=[*argv, "--fp8-format", "hybrid", "--fp8-recipe", "rowwise"],
            ).train_losses
    finally:
        manager.unregister(recorder)
    assert (
        recorder.calls["scaled_grouped_gemm"] >= 2 * 4 * 2
        and recorder.calls["scaled_grouped_gemm_wgrad"] >= 4 * 2
    )
    assert recorder.calls["scaled_linear_forward"] > 0  # the dense linears too
    assert "the routed experts run FP8" in caplog.text
    assert len(fp8) == len(bf16) == 4
    for a, b in zip(fp8, bf16):
        assert abs(a - b) <= 0.02 * abs(b), (fp8, bf16)
