"""``--cuda-graph-impl local``: device graphs of the transformer layers.

On CPU: the layouts the graphs cannot replay are refused with one message naming the flag, and a
backend without device graphs is refused, and a backward form (writing or adding the FP8 weight
gradients) that was not captured is emulated around the other with the same ``main_grad``. On a GPU (``MCORE_TEST_BACKEND=cuda``, or any machine with
CUDA): training with the layers replayed from graphs follows the eager run's losses and gradient
norms step for step, including gradient accumulation, fused weight gradients, the distributed
optimizer, a Llama layout and precision-aware optimizer state, FP8 with one and two micro-batches per
step (the backward forms that write and add the FP8 weight gradients), and the graphs really served
the forwards.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mcore.config.fields import ConfigError
from mcore.fp8 import producers as fp8_producers
from mcore.testing.distributed import run_distributed
from mcore.training.gpt import forward_step, model_provider
from mcore.training.pretrain import check_run_config, pretrain
from mcore.training.run_config import parse_run_config

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")

_BASE = [
    "--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "2", "--train-iters", "8", "--lr", "1e-3",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--num-workers", "0",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--eval-iters", "0", "--log-interval", "1",
]  # fmt: skip


_MOE = [
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64", "--swiglu",
    "--disable-bias-linear", "--normalization", "RMSNorm", "--moe-aux-loss-coeff", "0.01",
    "--moe-z-loss-coeff", "0.001",
]  # fmt: skip


class _GraphBackend:
    """Just enough of a backend for check_run_config: a name and the device_graphs capability."""

    name = "graphs"

    def capabilities(self):
        return frozenset({"device_graphs", "bf16", "fp16", "fp32"})


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--pipeline-model-parallel-size", "2", "--num-layers", "4"], "--pipeline-model-parallel-size 1 (got 2)"),
        (["--compile-layers"], "--compile-layers: choose one"),
        (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"], "--recompute-granularity full"),
        (["--recompute-granularity", "selective"], "--recompute-modules core_attn cannot be captured"),
        (["--recompute-granularity", "selective", "--recompute-modules", "layernorm", "mlp"],
         "--recompute-modules mlp cannot be captured"),
        (["--attention-dropout", "0.1"], "--attention-dropout 0.1"),
        (["--hidden-dropout", "0.1", "--sequence-parallel", "--tensor-model-parallel-size", "2"], "--sequence-parallel"),
        (["--use-distributed-optimizer", "--overlap-param-gather"], "--overlap-param-gather"),
        ([*_MOE, "--expert-model-parallel-size", "2"], "device graphs need --expert-model-parallel-size 1"),
        ([*_MOE, "--moe-expert-capacity-factor", "1.5"], "--moe-expert-capacity-factor 1.5"),
        ([*_MOE, "--moe-router-load-balancing-type", "global_aux_loss"], "global_aux_loss"),
        ([*_MOE, "--moe-token-dispatcher-type", "alltoall", "--tensor-model-parallel-size", "2",
          "--sequence-parallel"], "--moe-token-dispatcher-type alltoall with expert tensor parallelism (2)"),
        ([*_MOE, "--recompute-granularity", "selective", "--recompute-modules", "moe"],
         "--recompute-modules moe cannot be captured"),
    ],
)  # fmt: skip
def test_layouts_the_graphs_cannot_replay_are_refused(extra, message):
    cfg = parse_run_config([*_BASE, "--cuda-graph-impl", "local", *extra])
    with pytest.raises(ConfigError, match="--cuda-graph-impl local") as err:
        check_run_config(cfg, _GraphBackend(), world_size=2)
    assert message in str(err.value)


def test_recompute_inside_the_backward_is_accepted():
    """``layernorm``, ``mlp_act`` and ``moe_act`` recompute in the backward pass that reads them:
    capturable; so are dropless MoE layers with every expert on the rank (any dispatcher)."""
    argv = ["--recompute-granularity", "selective", "--recompute-modules", "layernorm", "mlp_act"]
    cfg = parse_run_config([*_BASE, "--cuda-graph-impl", "local", *argv])
    check_run_config(cfg, _GraphBackend(), world_size=1)
    moe_act = ["--recompute-granularity", "selective", "--recompute-modules", "moe_act"]
    for extra in ([], ["--moe-token-dispatcher-type", "alltoall"], moe_act):
        cfg = parse_run_config([*_BASE, "--cuda-graph-impl", "local", *_MOE, *extra])
        check_run_config(cfg, _GraphBackend(), world_size=1)
    tp = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]  # allgather over the ETP ranks
    check_run_config(parse_run_config([*_BASE, "--cuda-graph-impl", "local", *_MOE, *tp]), _GraphBackend(), 2)


def test_backend_without_device_graphs_is_refused():
    from mcore.plugins.manager import select_backend

    cfg = parse_run_config([*_BASE, "--cuda-graph-impl", "local"])
    with pytest.raises(ConfigError, match="--cuda-graph-impl local: backend 'cpu' has no device graphs"):
        check_run_config(cfg, select_backend("cpu"), world_size=1)


def test_unknown_graph_implementation_names_the_value(capsys):
    with pytest.raises(SystemExit):
        parse_run_config([*_BASE, "--cuda-graph-impl", "transformer_engine"])
    assert "transformer_engine" in capsys.readouterr().err


def test_eager_layouts_are_unaffected():
    cfg = parse_run_config(_BASE)
    assert cfg.training.device_graph_impl == "none"
    check_run_config(cfg, SimpleNamespace(name="cpu", capabilities=lambda: frozenset({"fp32"})), world_size=1)


# --------------------------------------------------------------------------------------------------
# GPU: graphs against eager


def _run(tmp_path, name: str, extra: list[str]):
    """Train on CUDA; returns (losses, gradient norms, the model chunks built)."""
    models = []

    def provider(*args, **kwargs):
        model = model_provider(*args, **kwargs)
        models.append(model)
        return model

    log = Path(tmp_path) / f"{name}.jsonl"
    argv = [*_BASE, "--device-backend", "cuda", "--bf16", "--log-json", str(log), *extra]
    result = pretrain(provider, forward_step, argv=argv)
    records = [json.loads(line) for line in log.read_text().splitlines() if '"train"' in line]
    norms = [r["grad_norm"] for r in records]
    return result.train_losses, norms, models


@needs_cuda
@pytest.mark.parametrize(
    "extra",
    [
        ["--global-batch-size", "4"],  # two micro-batches per step
        ["--global-batch-size", "4", "--use-distributed-optimizer", "--overlap-grad-reduce"],
        ["--global-batch-size", "2", "--normalization", "RMSNorm", "--swiglu",
         "--position-embedding-type", "rope", "--disable-bias-linear", "--group-query-attention",
         "--num-query-groups", "2"],
        ["--global-batch-size", "4", "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16"],
        ["--global-batch-size", "4", "--recompute-granularity", "selective",
         "--recompute-modules", "layernorm", "mlp_act"],
        ["--global-batch-size", "2", "--normalization", "RMSNorm", "--swiglu",
         "--position-embedding-type", "rope", "--disable-bias-linear", "--recompute-granularity",
         "selective", "--recompute-modules", "layernorm", "mlp_act"],
        ["--global-batch-size", "4", "--fp8-format", "hybrid", "--fp8-recipe", "delayed"],
        ["--global-batch-size", "2", "--fp8-format", "hybrid", "--fp8-recipe", "delayed"],
        ["--global-batch-size", "4", "--fp8-format", "hybrid", "--fp8-recipe", "delayed",
         "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16", "--no-fp8-fused-producers"],
        ["--global-batch-size", "4", "--fp8-format", "hybrid", "--fp8-recipe", "delayed",
         "--no-fp8-keep-weight-transpose"],
        ["--global-batch-size", "4", *_MOE, "--moe-per-layer-logging"],
        ["--global-batch-size", "2", *_MOE, "--moe-router-score-function", "sigmoid",
         "--moe-router-enable-expert-bias", "--moe-shared-expert-intermediate-size", "64",
         "--moe-token-dispatcher-type", "alltoall", "--recompute-granularity", "selective",
         "--recompute-modules", "moe_act", "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16"],
    ],
    ids=[
        "accumulation", "distopt-overlap", "llama", "precision-aware", "recompute", "llama-recompute",
        "fp8-delayed-fused", "fp8-delayed-one-micro-batch", "fp8-delayed-bf16-main-grads",
        "fp8-delayed-no-kept-transpose", "moe", "moe-sigmoid-bias-shared-alltoall",
    ],
)  # fmt: skip
def test_graph_replay_follows_the_eager_run(tmp_path, extra):
    eager_losses, eager_norms, _ = _run(tmp_path, "eager", extra)
    graph_losses, graph_norms, models = _run(
        tmp_path, "graphs", [*extra, "--cuda-graph-impl", "local", "--cuda-graph-warmup-steps", "2"]
    )
    graphs = models[0].decoder.layer_graphs
    assert graphs is not None and graphs.captured
    if "--fp8-recipe" in extra and "--no-fp8-fused-producers" not in extra:
        # the fused FP8 producers were captured (the backend serves their ops)
        layer = models[0].decoder.layers[0]
        assert layer.fp8_fused_qkv and fp8_producers.qkv_ops_ready(
            layer.input_layernorm, layer.self_attention
        )
        assert layer.fp8_fused_mlp and fp8_producers.mlp_ops_ready(layer.pre_mlp_layernorm, layer.mlp)
    # no captured forward keeps its autograd graph (and with it the parameters' gradient accumulators,
    # bound to the capture stream)
    assert all(c.static_output.grad_fn is None for c in graphs._captured)
    micro_batches = 2 if "4" in extra[extra.index("--global-batch-size") + 1] else 1
    if "--fp8-recipe" in extra:
        # the FP8 weights write their first gradient of a step: each layer captured the write form,
        # and the add form for the later micro-batches (mcore.tensor_parallel.first_grad)
        forms = {True} if micro_batches == 1 else {True, False}
        assert all(c.overwriting and set(c.backward_graphs) == forms for c in graphs._captured)
    if "--num-experts" in extra:
        # the experts' grouped weights write their first gradient inside the backward graph, whose
        # placeholder outputs are not kept (they would hold an expert-sized tensor per layer)
        forms = {True} if micro_batches == 1 else {True, False}
        for c in graphs._captured:
            assert set(c.backward_graphs) == forms
            assert {n for n, p in c.layer.named_parameters() if any(p is q for q in c.overwriting)} >= {
                "mlp.experts.linear_fc1.weight",
                "mlp.experts.linear_fc2.weight",
            }
            assert all(g is None for g, fused in zip(c.static_grads[1:], c.placeholder) if fused)
        graph_moe, eager_moe = _moe_logs(tmp_path, "graphs"), _moe_logs(tmp_path, "eager")
        assert graph_moe.keys() == eager_moe.keys() and "load_balancing_loss" in graph_moe
        for name, values in eager_moe.items():  # the routers' counts and losses, replayed
            torch.testing.assert_close(
                torch.tensor(graph_moe[name]), torch.tensor(values), rtol=5e-2, atol=2e-3
            )
    assert graphs.replays == (8 - 2) * micro_batches  # every forward after the warm-up steps
    assert len(eager_losses) == len(graph_losses) == 8
    # The same kernels run in the same order; bf16 atomics in attention backward may differ slightly.
    torch.testing.assert_close(torch.tensor(graph_losses), torch.tensor(eager_losses), rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(torch.tensor(graph_norms), torch.tensor(eager_norms), rtol=2e-2, atol=1e-3)


def _moe_logs(tmp_path, name: str) -> dict[str, list[float]]:
    """The MoE values of each step's log record (losses, tokens-per-expert balance, per layer)."""
    records = [json.loads(line) for line in (Path(tmp_path) / f"{name}.jsonl").read_text().splitlines()]
    records = [r for r in records if r.get("kind") == "train"]
    keys = [
        k for k in records[0] if any(m in k for m in ("load_balancing_loss", "z_loss", "tokens_per_expert"))
    ]
    return {k: [r[k] for r in records] for k in keys}


def _tp_run(log_dir: str, name: str, extra: list[str]):
    losses, norms, models = _run(log_dir, name, extra)
    graphs = models[0].decoder.layer_graphs
    return losses, norms, None if graphs is None else graphs.replays


@needs_cuda
def test_tensor_parallel_graph_replay_follows_the_eager_run(tmp_path):
    """TP=2 with sequence parallelism: the collectives inside the layers are captured too."""
    extra = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--global-batch-size", "4"]
    eager = run_distributed(_tp_run, 2, str(tmp_path), "eager", extra, backend="cuda")
    graphs = run_distributed(
        _tp_run, 2, str(tmp_path), "graphs", [*extra, "--cuda-graph-impl", "local"], backend="cuda"
    )
    (eager_losses, eager_norms, _), (graph_losses, graph_norms, replays) = eager[-1], graphs[-1]
    assert replays == (8 - 3) * 2  # the default 3 warm-up steps, two micro-batches per step
    torch.testing.assert_close(torch.tensor(graph_losses), torch.tensor(eager_losses), rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(torch.tensor(graph_norms), torch.tensor(eager_norms), rtol=2e-2, atol=1e-3)


@needs_cuda
def test_hidden_dropout_draws_a_new_mask_on_every_replay(tmp_path):
    """Hidden dropout without sequence parallelism is captured: the bias-dropout-add kernel reads a
    seed that a captured ``randint`` draws from the generator's graph-safe Philox state, so each
    replay drops other elements (a frozen seed would reuse one mask for the whole run)."""
    extra = ["--global-batch-size", "2", "--hidden-dropout", "0.1"]
    eager_losses, _, _ = _run(tmp_path, "eager", extra)
    losses, _, models = _run(tmp_path, "graphs", [*extra, "--cuda-graph-impl", "local"])
    graphs = models[0].decoder.layer_graphs
    assert graphs.replays == 8 - 3
    assert all(math.isfinite(x) for x in losses)
    # different masks than eager: close, not equal
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=5e-2, atol=5e-2)
    layer = graphs._captured[0]
    outputs = []
    for _ in range(2):  # the same static input, two replays
        layer.forward_graph.replay()
        outputs.append(layer.static_output.clone())
    torch.cuda.synchronize()
    assert not torch.equal(outputs[0], outputs[1])


class _FormGraph:
    """A captured backward form stand-in: replay writes (``write``) or adds ``grad`` into each weight's
    ``main_grad``, as the FP8 linears' weight-gradient GEMMs of that form do."""

    def __init__(self, weights, grads, write: bool):
        self.weights, self.grads, self.write, self.replays = weights, grads, write, 0

    def replay(self):
        self.replays += 1
        for p, g in zip(self.weights, self.grads):
            p.main_grad.copy_(g) if self.write else p.main_grad.add_(g)


@pytest.mark.parametrize(
    "captured_forms, flags, expect_replayed",
    [
        ((True, False), (True, True), True),  # both captured: the write form, as asked
        ((True, False), (False, False), False),  # both captured: the add form
        ((False,), (True, True), False),  # write asked, only add captured: zero, then add
        ((True,), (False, False), True),  # add asked, only write captured: keep, write, add back
        ((True, False), (True, False), False),  # mixed flags: zero the unwritten one, add into both
    ],
)
def test_backward_form_not_captured_is_emulated(captured_forms, flags, expect_replayed):
    """``_replay_backward``: whatever forms were captured, ``main_grad`` ends as the zero+add behaviour
    gives it (an unwritten weight's stale memory counts as zero), and every flag is cleared."""
    from mcore.models.transformer.layer_graphs import _CapturedLayer, _replay_backward
    from mcore.tensor_parallel.first_grad import UNWRITTEN

    gen = torch.Generator().manual_seed(0)
    weights = [torch.nn.Parameter(torch.zeros(3, 4)) for _ in range(2)]
    grads = [torch.randn(3, 4, generator=gen) for _ in weights]
    stale = [torch.randn(3, 4, generator=gen) for _ in weights]
    expected = []
    for p, g, old, unwritten in zip(weights, grads, stale, flags):
        p.main_grad = old.clone()
        setattr(p, UNWRITTEN, unwritten)
        expected.append(g if unwritten else old + g)  # stale memory stands for zero
    captured = _CapturedLayer(torch.nn.Linear(1, 1))
    captured.overwriting = tuple(weights)
    captured.backward_graphs = {form: _FormGraph(weights, grads, form) for form in captured_forms}
    _replay_backward(captured)
    for p, want in zip(weights, expected):
        torch.testing.assert_close(p.main_grad, want, rtol=0, atol=1e-6)
        assert not getattr(p, UNWRITTEN)
    replayed = [form for form, graph in captured.backward_graphs.items() if graph.replays]
    assert replayed == [expect_replayed]
