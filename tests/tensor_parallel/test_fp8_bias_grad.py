"""The row-parallel FP8 linears' bias gradient from their output-gradient cast.

``linear_proj`` and ``linear_fc2`` return their bias (``skip_bias_add``) for the layer's
``bias_dropout_add``: ``out = residual + dropout(y + b)``, so ``db = colsum(d/d(y + b)) = colsum(dy)``
with ``dy`` the output gradient the FP8 linear's backward casts anyway. With
``RowParallelLinear.bias_added_by_caller`` (set by the transformer layer) the linear sums it in that
cast (``fp8_cast_dbias``) and the layer adds ``bias.detach()``; without it (the old behaviour) the
bias-dropout-add's backward sums it.

1. In-model (one process, CPU): a GPT (biases on) with FP8 linears in the DDP (gradient-accumulation
   fusion into ``main_grad``, the step's first FP8 weight gradient written over it), two steps of two
   micro-batches with an SGD update between them, hidden dropout 0.1 and 0, for the tensorwise recipe,
   the delayed recipe unfused and with the fused MLP (``Fp8NormMLP``), and under full and
   ``--recompute-modules mlp`` recomputation: per-token losses and every ``main_grad`` are
   bit-identical to the old behaviour's (the reference ops sum the same ``dy`` the same way). And the routing: every ``bias_dropout_add`` of a training forward gets a bias that
   needs no gradient, and ``fp8_cast_dbias`` runs on the ``[tokens, h]`` output gradients of
   ``linear_proj`` and ``linear_fc2`` (2 a layer and micro-batch; the old behaviour: none).
2. TP=2 (2 gloo processes): the same comparison on each rank (the bias is replicated: each rank sums
   the whole output gradient, as the bias-dropout-add did).
3. ``pretrain`` (the test backend's op table, the CPU's or ``MCORE_TEST_BACKEND``'s, wrapped by a
   tracing plugin), tensorwise and delayed (fused MLP): no training ``bias_dropout_add`` gets a bias that needs a gradient, and
   ``fp8_cast_dbias`` runs on proj's and fc2's output gradients.
4. Layers compiled with ``torch.compile(fullgraph=True)`` trace the new path (no graph break) and give
   the compiled old behaviour's losses and gradients.
5. Where the linear keeps the old behaviour: sequence parallelism (a rank's bias gradient is the sum
   over its sequence shard), the rowwise recipe, ``--no-fp8-wgrad``, a bf16 linear, a part of a
   spec's own class; evaluation returns the bias detached with the same outputs.
"""

from __future__ import annotations

import pytest
import torch

from mcore.config.parallel import ParallelConfig
from mcore.distributed.ddp import DDPConfig, DistributedDataParallel
from mcore.distributed.groups import ProcessGroups, initialize_parallel
from mcore.fp8 import fused as fp8_fused
from mcore.fp8 import linear as fp8_module
from mcore.fp8.config import Fp8Config
from mcore.models.gpt.gpt_model import GPTModel
from mcore.models.transformer import layer as transformer_layer
from mcore.models.transformer.model_config import ModelConfig, padded_vocab_size
from mcore.plugins.manager import plugin_manager, register_plugin
from mcore.tensor_parallel.layers import RowParallelLinear
from mcore.testing.conformance import training_rank
from mcore.testing.ddp_steps import sgd_steps_on_main_grad
from mcore.testing.distributed import run_distributed
from mcore.testing.distributed import test_backend_name as backend_under_test
from mcore.testing.op_trace import OpCallRecorder

VOCAB, SEQ, BATCH, HIDDEN = 100, 16, 2, 32
MODEL = dict(
    num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=64, seq_length=SEQ,
    max_position_embeddings=SEQ, make_vocab_size_divisible_by=32, attention_dropout=0.0,
)  # fmt: skip
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


class _Routing:
    """Records, through the modules' op tables, the biases ``bias_dropout_add`` gets and the width of
    the output gradients ``fp8_cast_dbias`` casts."""

    def __init__(self, monkeypatch):
        self.bda_bias_needs_grad: list[bool] = []
        self.dbias_widths: list[int] = []
        recorder = self

        class Recording:
            def __getattr__(self, name):
                from mcore.backend import get_ops

                op = getattr(get_ops(), name)
                if name == "bias_dropout_add":

                    def bda(x, bias, residual, p, training):
                        if bias is not None and torch.is_grad_enabled():
                            recorder.bda_bias_needs_grad.append(bias.requires_grad)
                        return op(x, bias, residual, p, training)

                    return bda
                if name == "fp8_cast_dbias":

                    def cast_dbias(x, *args, **kwargs):
                        recorder.dbias_widths.append(x.shape[-1])
                        return op(x, *args, **kwargs)

                    return cast_dbias
                return op

        for module in (fp8_module, fp8_fused, transformer_layer):
            monkeypatch.setattr(module, "get_ops", Recording)


def _set_behaviour(model, bias_grad_from_cast: bool) -> None:
    """The new behaviour (the layers' default) or the old one, where bias_dropout_add sums the bias
    gradient."""
    for module in model.modules():
        if isinstance(module, RowParallelLinear):
            module.bias_added_by_caller = bias_grad_from_cast


def _build(groups, path: str, dropout: float, recompute: str = "none", sequence_parallel=False, **model):
    fp8 = Fp8Config(fp8_format="hybrid", fp8_amax_history_len=2, **PATHS[path])
    cfg = ModelConfig(**{**MODEL, **model}, hidden_dropout=dropout, **RECOMPUTE[recompute])
    vocab = padded_vocab_size(VOCAB, 32, groups.tp_size)
    torch.manual_seed(0)
    return GPTModel(
        cfg, groups, vocab, device=torch.device("cpu"), fp8=fp8, sequence_parallel=sequence_parallel
    )


def _train(groups, path: str, dropout: float, new: bool, recompute: str = "none", steps: int = 2):
    """``steps`` DDP steps of two micro-batches (SGD on ``main_grad`` between them): the per-token
    losses and ``{name: main_grad}`` after each step's ``finish_grad_sync``."""
    model = _build(groups, path, dropout, recompute)
    _set_behaviour(model, new)
    ddp = DistributedDataParallel(model, DDPConfig(), groups)
    gen = torch.Generator().manual_seed(7)
    data = torch.randint(0, VOCAB, (steps, 2, 2, BATCH, SEQ), generator=gen)
    torch.manual_seed(3)  # the dropout masks
    return sgd_steps_on_main_grad(ddp, model, data, groups)


def _compare(got, want) -> None:
    """Losses and every ``main_grad`` bit-identical (the reference ops: the same column sum of the same
    ``dy``, taken in the cast instead of in the bias-dropout-add's backward)."""
    (losses, grads), (want_losses, want_grads) = got, want
    assert torch.equal(losses, want_losses), (losses - want_losses).abs().max()
    for step, (g, w) in enumerate(zip(grads, want_grads)):
        assert g.keys() == w.keys()
        for name in g:
            assert torch.equal(g[name], w[name]), (step, name, (g[name] - w[name]).abs().max())


@pytest.mark.parametrize("dropout", [0.1, 0.0])
@pytest.mark.parametrize("path", list(PATHS))
def test_bias_grad_from_the_cast_equals_the_bias_dropout_add_s(monkeypatch, path, dropout):
    single = ProcessGroups.single()
    want = _train(single, path, dropout, new=False)
    routing = _Routing(monkeypatch)
    old_routing = _train(single, path, dropout, new=False)
    assert all(routing.bda_bias_needs_grad) and len(routing.bda_bias_needs_grad) == 2 * 2 * 4
    assert HIDDEN not in routing.dbias_widths  # the old behaviour: proj and fc2 cast without the sum
    _compare(old_routing, want)  # (the recording changes nothing)

    routing.bda_bias_needs_grad.clear()
    routing.dbias_widths.clear()
    got = _train(single, path, dropout, new=True)
    # 2 layers x 2 bias-dropout-adds x 4 micro-batches, none of them summing the bias gradient
    assert routing.bda_bias_needs_grad == [False] * (2 * 2 * 4)
    # proj's and fc2's output gradients [s*b, h] (the QKV's are [s*b, 3h]): 2 a layer and micro-batch
    assert routing.dbias_widths.count(HIDDEN) == 2 * 2 * 4
    _compare(got, want)


@pytest.mark.parametrize("recompute", ["full", "mlp"])
@pytest.mark.parametrize("path", ["tensorwise", "delayed-fused"])
def test_bias_grad_from_the_cast_under_recomputation(monkeypatch, path, recompute):
    single = ProcessGroups.single()
    want = _train(single, path, 0.1, new=False, recompute=recompute)
    routing = _Routing(monkeypatch)
    got = _train(single, path, 0.1, new=True, recompute=recompute)
    assert routing.dbias_widths.count(HIDDEN) == 2 * 2 * 4
    assert not any(routing.bda_bias_needs_grad)
    _compare(got, want)


def _tp2_cases():
    groups = initialize_parallel(ParallelConfig(tensor_model_parallel_size=2))
    out = {}
    for path in ("tensorwise", "delayed-fused"):
        want = _train(groups, path, 0.1, new=False)
        got = _train(groups, path, 0.1, new=True)
        try:
            _compare(got, want)
            out[path] = "ok"
        except AssertionError as error:
            out[path] = str(error)
    # sequence parallelism keeps the old behaviour (the layers mark the linears all the same)
    sp = _build(groups, "tensorwise", 0.0, sequence_parallel=True)
    out["sp"] = [(linear.bias_added_by_caller, linear.takes_bias_grad()) for linear in _proj_and_fc2(sp)]
    return out


def test_bias_grad_from_the_cast_at_tp2():
    for rank in run_distributed(_tp2_cases, 2, timeout=300):
        assert rank == {"tensorwise": "ok", "delayed-fused": "ok", "sp": [(True, False)] * 4}, rank


def _proj_and_fc2(model):
    for layer in model.decoder.layers:
        yield layer.self_attention.linear_proj
        yield layer.mlp.linear_fc2


def test_where_the_linear_keeps_the_old_behaviour():
    single = ProcessGroups.single()
    on = _build(single, "tensorwise", 0.0)
    assert all(linear.bias_added_by_caller and linear.takes_bias_grad() for linear in _proj_and_fc2(on))
    no_bias = _build(single, "tensorwise", 0.0, disable_bias_linear=True)
    assert not any(linear.takes_bias_grad() for linear in _proj_and_fc2(no_bias))

    def recipe(**fp8):
        torch.manual_seed(0)
        cfg = ModelConfig(**MODEL, hidden_dropout=0.0)
        model = GPTModel(
            cfg, single, 128, device=torch.device("cpu"), fp8=Fp8Config(fp8_format="hybrid", **fp8)
        )
        return [linear.takes_bias_grad() for linear in _proj_and_fc2(model)]

    assert not any(recipe(fp8_recipe="rowwise")) and not any(recipe(fp8_wgrad=False))
    bf16 = GPTModel(ModelConfig(**MODEL), single, 128, device=torch.device("cpu"))
    assert all(linear.bias_added_by_caller for linear in _proj_and_fc2(bf16))
    assert not any(linear.takes_bias_grad() for linear in _proj_and_fc2(bf16))
    # a linear nobody marked returns its bias itself
    linear = RowParallelLinear(8, 4, skip_bias_add=True, fp8=Fp8Config(fp8_format="hybrid"))
    assert not linear.takes_bias_grad()
    _, bias = linear(torch.randn(3, 8))
    assert bias is linear.bias


def test_the_returned_bias_is_detached_and_the_output_unchanged():
    """Training and evaluation: the output without the bias is the same either way; the returned
    bias has the parameter's values and no autograd history (its gradient comes from the linear)."""
    torch.manual_seed(0)
    linear = RowParallelLinear(8, 4, skip_bias_add=True, fp8=Fp8Config(fp8_format="hybrid"))
    with torch.no_grad():
        linear.bias.normal_()
    x = torch.randn(2, 3, 8)
    y_old, b_old = linear(x)
    linear.bias_added_by_caller = True
    y_new, b_new = linear(x)
    assert torch.equal(y_new, y_old) and torch.equal(b_new, b_old) and not b_new.requires_grad
    grad = torch.randn(2, 3, 4)
    (y_new + b_new).backward(grad)
    torch.testing.assert_close(linear.bias.grad, grad.sum((0, 1)))
    with torch.no_grad():
        y_eval, b_eval = linear(x)
    assert torch.equal(y_eval, y_old) and torch.equal(b_eval, linear.bias)


# -- in pretrain: the op table's calls ------------------------------------------------------------

PRETRAIN_ARGV = [
    "--num-layers", "2", "--hidden-size", str(HIDDEN), "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
    "--lr", "1e-3", "--lr-warmup-iters", "0", "--seed", "7", "--bf16",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "127",
    "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1000",
    "--fp8-format", "hybrid", "--device-backend", backend_under_test(),
]  # fmt: skip
"""GPT-2 style (biases, LayerNorm, GeLU, hidden dropout 0.1), 2 steps of 2 micro-batches, FP8."""


class _ArgumentRecorder(OpCallRecorder):
    """A tracing plugin (every op of the table wrapped): records whether a training
    ``bias_dropout_add``'s bias needs a gradient, and the width of each ``fp8_cast_dbias`` input."""

    def __init__(self):
        super().__init__()
        self.bda_bias_needs_grad: list[bool] = []
        self.dbias_widths: list[int] = []

    def wrapper(self, name):
        count = super().wrapper(name)

        def wrap(implementation):
            counted = count(implementation)

            def recorded(*args, **kwargs):
                if name == "bias_dropout_add" and args[1] is not None and torch.is_grad_enabled():
                    self.bda_bias_needs_grad.append(args[1].requires_grad)
                if name == "fp8_cast_dbias":
                    self.dbias_widths.append(args[0].shape[-1])
                return counted(*args, **kwargs)

            return recorded

        return wrap


def _traced_pretrain(argv):
    recorder = _ArgumentRecorder()
    register_plugin(plugin_manager(), recorder, "argument-recorder")
    training_rank(argv)
    return recorder.bda_bias_needs_grad, recorder.dbias_widths


@pytest.fixture(scope="module")
def index_cache(tmp_path_factory):
    """One --data-cache-path for the module's pretrain launches: the first builds the mock dataset's
    indices (~3 s of CPU), the next reads the same arrays back (the product's cache)."""
    import shutil

    path = tmp_path_factory.mktemp("index_cache")
    yield ["--data-cache-path", str(path)]
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_pretrain_routes_the_bias_grad_to_the_cast(recipe, index_cache):
    """``pretrain`` (the backend's op table, DDP, the layers as built for training): no training
    ``bias_dropout_add`` sums a bias gradient, and ``fp8_cast_dbias`` runs on proj's and fc2's output
    gradients (the delayed recipe: fc2's inside the fused MLP)."""
    ((needs_grad, widths),) = run_distributed(
        _traced_pretrain, 1, [*PRETRAIN_ARGV, *index_cache, "--fp8-recipe", recipe], timeout=300
    )
    # 2 layers x 2 bias-dropout-adds x 2 steps x 2 micro-batches
    assert needs_grad == [False] * 16
    assert widths.count(HIDDEN) == 16


def _compiled_step(new: bool):
    model = _build(ProcessGroups.single(), "tensorwise", 0.0)
    _set_behaviour(model, new)
    assert all(linear.takes_bias_grad() == new for linear in _proj_and_fc2(model))
    for layer in model.decoder.layers:
        layer.compile(backend="aot_eager_decomp_partition", fullgraph=True, dynamic=False)
    tokens, labels = torch.randint(0, VOCAB, (2, BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    loss = model(tokens, None, None, labels=labels)
    loss.mean().backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_compiled_layers_take_the_bias_grad_from_the_cast():
    """``torch.compile(fullgraph=True)`` of each layer traces the linear taking its bias for the
    gradient only: the same losses and gradients as the compiled old behaviour."""
    from mcore.backend import get_ops

    get_ops()  # select the backend outside the compiled region
    (want_loss, want_grads), (loss, grads) = _compiled_step(False), _compiled_step(True)
    assert torch.equal(loss, want_loss)
    for name, g in grads.items():
        assert torch.equal(g, want_grads[name]), name
