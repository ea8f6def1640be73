"""``torch.compile`` of the transformer layers (``--compile-layers``) with the delayed FP8 recipe.

The delayed recipe's casts record each role's amax in place into the linear's
:class:`~mcore.fp8.scaling.Fp8DelayedState`: the input's and the weight's in the forward, the
output gradient's in the backward. AOTAutograd traces a compiled layer's forward and backward as one
joint graph and functionalizes those writes; a buffer written in both passes (the single
``pending_amax [3]`` this replaced) came out of the joint graph as one forward output that depends on
the backward's tangents, which the partitioner refuses ("Node slice_scatter_N was invalid, but is
output") unless the compiler keeps input mutations in the graph (``aot_eager_decomp_partition``
does not). The state keeps the two passes' records in separate buffers: the forward's are applied
after the compiled forward, the backward's inside the compiled backward.

1. One process, CPU, a GPT (biases, GeLU, 2 layers) in the DDP (gradient-accumulation fusion into
   ``main_grad``), 3 steps of 2 micro-batches with the scale update and an SGD step between them
   (history length 2, so the histories roll): the layers compiled with ``fullgraph=True`` by
   :func:`aot_partitioned` (AOTAutograd and Inductor's partitioner, input mutations not kept in the
   graph, as ``aot_eager_decomp_partition``, but without Inductor's decompositions) give the eager
   layers' per-token losses, every ``main_grad``, and every amax history and scale after every step,
   bit for bit; with the weight transpose kept and not (``--no-fp8-keep-weight-transpose``), and
   against the eager fused producers (the compiled layer runs the unfused path: the reference ops
   give the same bits).
2. ``aot_eager_decomp_partition`` itself: within relative 1e-6 of eager (of each tensor's largest
   magnitude): Inductor's decompositions of ``layer_norm``, ``gelu`` and ``softmax`` differ from the
   eager CPU kernels by an ulp or two, with or without FP8 (the fp32 model without FP8 differs
   from eager as much).
3. ``pretrain`` with ``--compile-layers --fp8-recipe delayed`` (the CPU backend does not declare
   ``compile_layers``: a test plugin's backend that does, compiling as the CUDA backend does, with
   :func:`aot_partitioned` and ``fullgraph=True``): the eager run's losses, bit for bit.
"""

from __future__ import annotations

import functools

import pytest
import torch
from mcore.backends.cuda.compile import compile_layer

from mcore.backend import CPUBackend
from mcore.distributed.ddp import DDPConfig, DistributedDataParallel
from mcore.distributed.groups import ProcessGroups
from mcore.fp8.config import Fp8Config
from mcore.fp8.scaling import delayed_states
from mcore.models.gpt.gpt_model import GPTModel
from mcore.models.transformer.model_config import ModelConfig, padded_vocab_size
from mcore.plugins import hookimpl
from mcore.plugins.hookspecs import PLUGIN_API_VERSION
from mcore.plugins.manager import plugin_manager, register_plugin
from mcore.testing.conformance import training_rank
from mcore.testing.ddp_steps import sgd_steps_on_main_grad
from mcore.testing.distributed import run_distributed

VOCAB, SEQ, BATCH, HIDDEN = 100, 16, 2, 32
MODEL = dict(
    num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=64, seq_length=SEQ,
    max_position_embeddings=SEQ, make_vocab_size_divisible_by=32, attention_dropout=0.0,
    hidden_dropout=0.0,
)  # fmt: skip


def aot_partitioned(gm, example_inputs):
    """``aot_eager_decomp_partition`` without Inductor's decompositions: AOTAutograd's joint graph,
    functionalization and Inductor's partitioner (which refused the old state), the graphs run as
    traced (no code generation), and the eager kernels, so the results can be compared bit for bit.
    (Inductor's decompositions of ``layer_norm``, ``gelu`` and ``softmax`` differ from the eager CPU
    kernels by an ulp or two, with or without FP8.)"""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    partition = functools.partial(min_cut_rematerialization_partition, compiler="inductor")
    return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partition)(
        gm, example_inputs
    )


def _train(compiler, keep_weight_transpose: bool, fused_producers: bool, steps: int = 3):
    """Per-token losses of every micro-batch, and per step ``{main_grad name: tensor}`` and
    ``{state name: (amax_history, scale)}`` after the scale update."""
    groups = ProcessGroups.single()
    fp8 = Fp8Config(
        fp8_format="hybrid", fp8_recipe="delayed", fp8_amax_history_len=2,
        fp8_keep_weight_transpose=keep_weight_transpose, fp8_fused_producers=fused_producers,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPTModel(
        ModelConfig(**MODEL), groups, padded_vocab_size(VOCAB, 32, 1), device=torch.device("cpu"), fp8=fp8
    )
    if compiler is not None:
        for layer in model.decoder.layers:
            compile_layer(layer, backend=compiler, fullgraph=True)
    ddp = DistributedDataParallel(model, DDPConfig(), groups)
    data = torch.randint(0, VOCAB, (steps, 2, 2, BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    states = []

    def record_states():
        states.append({n: (s.amax_history.clone(), s.scale.clone()) for n, s in delayed_states(model)})

    losses, grads = sgd_steps_on_main_grad(ddp, model, data, groups, on_step=record_states)
    return losses, grads, states


def _check(got: torch.Tensor, want: torch.Tensor, relative: float, where: str) -> None:
    """Bit for bit (``relative`` 0), or ``max |got - want| <= relative * max |want|``: relative to the
    tensor's scale, as the GEMMs' and sums' rounding is (an element near zero from cancellation may
    differ by more than ``relative`` of itself)."""
    error = (got - want).abs().max()
    if relative == 0:
        assert torch.equal(got, want), f"{where}: differs by {error}"
    else:
        assert error <= relative * want.abs().max(), f"{where}: {error} / {want.abs().max()}"


def _compare(got, want, relative: float = 0.0) -> None:
    """Per-token losses, every ``main_grad``, and every state (amax history, scale) after every step."""
    (losses, grads, states), (want_losses, want_grads, want_states) = got, want
    _check(losses, want_losses, relative, "losses")
    for step, (g, w) in enumerate(zip(grads, want_grads)):
        assert g.keys() == w.keys()
        for name in g:
            _check(g[name], w[name], relative, f"step {step}: {name}")
    for step, (s, w) in enumerate(zip(states, want_states)):
        assert s.keys() == w.keys() and len(s) == 2 * 4  # 2 layers x qkv, proj, fc1, fc2
        for name in s:
            for got_t, want_t in zip(s[name], w[name]):
                _check(got_t, want_t, relative, f"step {step}: {name}")
    # the scales moved: every role recorded an amax (in the forward and in the backward), and the
    # last update changed scales
    last, before = want_states[-1], want_states[-2]
    assert all(bool((history > 0).all()) for history, _ in last.values())
    assert any(not torch.equal(last[n][1], before[n][1]) for n in last)


@pytest.fixture(autouse=True)
def _backend_selected():
    from mcore.backend import get_ops

    get_ops()  # select the backend outside the compiled region


@pytest.mark.parametrize(
    "keep_weight_transpose, fused_producers", [(True, False), (False, False), (True, True)]
)
def test_compiled_layers_with_delayed_scaling_equal_eager(keep_weight_transpose, fused_producers):
    want = _train(None, keep_weight_transpose, fused_producers)
    _compare(_train(aot_partitioned, keep_weight_transpose, fused_producers), want)


def test_inductor_decompositions_with_delayed_scaling_near_eager():
    """``aot_eager_decomp_partition`` (Inductor's decompositions too): within a few fp32 ulps of
    eager (measured: relative 4e-7 at most over the 3 steps). The decompositions' ulps did not move
    an FP8 rounding here (that would change a quantized value by 1/16 of itself)."""
    want = _train(None, True, False)
    _compare(_train("aot_eager_decomp_partition", True, False), want, relative=1e-6)


# -- through pretrain --------------------------------------------------------------------------------


class CompilingCPUBackend(CPUBackend):
    """The CPU backend plus ``compile_layers`` (the CPU backend itself does not declare it): compiles
    a layer as the CUDA backend does (:func:`~mcore.backends.cuda.compile.compile_layer`, in place),
    with :func:`aot_partitioned` and ``fullgraph=True`` instead of Inductor."""

    name = "cpu-compile"
    _capabilities = CPUBackend._capabilities | {"compile_layers"}

    def compile_layer(self, module: torch.nn.Module, **kwargs) -> torch.nn.Module:
        return compile_layer(module, backend=aot_partitioned, fullgraph=True)


class _CompilingCPUPlugin:
    MCORE_PLUGIN_API_VERSION = PLUGIN_API_VERSION

    @hookimpl
    def mcore_backends(self):
        return [CompilingCPUBackend()]


def _register_compiling_cpu() -> None:
    register_plugin(plugin_manager(), _CompilingCPUPlugin(), "compiling-cpu")


PRETRAIN_ARGV = [
    "--num-layers", "2", "--hidden-size", str(HIDDEN), "--num-attention-heads", "4",
    "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3",
    "--lr", "1e-3", "--lr-warmup-iters", "0", "--seed", "7", "--bf16", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "127",
    "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1000",
    "--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "2",
    "--device-backend", CompilingCPUBackend.name,
]  # fmt: skip
"""GPT-2 style (biases, LayerNorm, GeLU; no dropout: the attention dropout forks the RNG, which
``fullgraph=True`` cannot trace), bf16, 3 steps of 2 micro-batches, the delayed recipe."""


@pytest.fixture(scope="module")
def index_cache(tmp_path_factory):
    """One --data-cache-path for the module's pretrain launches: the first builds the mock dataset's
    indices (~3 s of CPU), the next reads the same arrays back (the product's cache)."""
    import shutil

    path = tmp_path_factory.mktemp("index_cache")
    yield ["--data-cache-path", str(path)]
    shutil.rmtree(path, ignore_errors=True)


def test_pretrain_compile_layers_with_delayed_scaling(index_cache):
    """``pretrain --compile-layers --fp8-recipe delayed`` gives the eager run's losses bit for bit (the
    CPU backend does not declare ``compile_layers``: a test plugin's backend that does)."""
    assert "compile_layers" not in CPUBackend().capabilities()

    def losses(*extra):
        (result,) = run_distributed(
            training_rank, 1, [*PRETRAIN_ARGV, *index_cache, *extra], backend=CompilingCPUBackend.name,
            rank_setup=_register_compiling_cpu, timeout=300,
        )  # fmt: skip
        return result

    want = losses()
    assert len(want) == 3 and len(set(want)) == 3
    assert losses("--compile-layers") == want
