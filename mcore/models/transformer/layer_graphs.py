"""Device graphs of transformer layers (``--cuda-graph-impl local``): capture once, replay every step.

An eager layer costs the host one Python dispatch per kernel (tens of them per layer, forward and
backward); when the host is slower than the device, the device idles between kernels. A device
graph records a layer's kernels once and replays them with one host call, so the layers' host time
per micro-batch drops to two replays per layer. The embedding, the output layer, the loss, the
gradient hooks and the optimizer stay eager.

What is captured, per transformer layer ``i`` of a block (backend capability ``"device_graphs"``)::

    forward graph F_i:   Y_i = layer_i(X_i, mask, rotary)              X_1: a static [s, b, h] buffer
    backward graph B_i:  (dX_i, dW_i, ...) = vjp of F_i at dY_i       dY_n: a static [s, b, h] buffer

with the layers chained through their static tensors: ``X_{i+1}`` is ``Y_i`` and ``dY_i`` is
``dX_{i+1}``, so nothing is copied between layers. The graphs are captured in the order they run
(``F_1 .. F_n``, then ``B_n .. B_1``) into one memory pool, so a replay never overwrites memory that a
later replay of the same step still reads. A micro-batch's forward copies its input into ``X_1`` and
replays ``F_1 .. F_n``; its backward copies the incoming gradient into ``dY_n`` and replays
``B_n .. B_1``. A layer's saved activations live in the pool and the next forward replay overwrites
them, so only one micro-batch may be between its forward and its backward at a time: the
no-pipelining schedule (forward, backward, next micro-batch).

Weight gradients fused into ``main_grad`` (gradient-accumulation fusion) are accumulated by the
backward graph itself (``main_grad`` is a view of the persistent DDP buffer, so its address is fixed);
autograd then receives a fresh placeholder, as in eager mode, which the DDP hook discards (the
placeholders the capture produced are not kept). The other parameter gradients (biases, norms) leave
the graph as static tensors that autograd accumulates and the DDP hook adds to ``main_grad``. The
hooks, and the bucketed reductions they start, run eagerly.

MoE layers replay when dropless with every expert on the rank (:func:`check_layer_graphs`): the
experts' grouped weights write their gradients into ``main_grad`` in the backward like the FP8
linears below, the routers add their log sums in place, the aux losses read a backward scale the
schedule updates in place, and modules with ``snapshot_step_state``/``restore_step_state`` (the
routers) get back the counts the capture's warm-up passes added.

The FP8 linears (and the MoE experts' grouped weights) write the step's first weight gradient over ``main_grad`` and add the later ones
(:mod:`mcore.tensor_parallel.first_grad`), a choice their backward makes in Python from the weight's
``main_grad_unwritten`` flag, which a replay does not run. So a layer with such weights gets one
backward graph per form it needs: the writing form ``B_i^w`` (captured with the flags set) and, when
a step has more than one micro-batch, the adding form ``B_i^a`` (flags cleared), captured right after
``B_i^w`` from the same forward (``retain_graph``) into the same pool. ``B_i^a`` copies its ``dX_i``
and non-fused parameter gradients into ``B_i^w``'s static tensors, so the chain and the replay's
outputs do not depend on the form. :meth:`_ReplayLayer.backward` replays the form the flags ask for
and clears them; a form that was not captured is emulated around the other (zero the regions first,
or save and add back ``main_grad``).

Capture happens lazily, in the first training forward of the step after :meth:`LayerGraphs.arm`
(the trainer arms after ``--cuda-graph-warmup-steps`` eager steps). Before capturing, each layer runs
forward and backward on the sample input on a side stream (lazy initialisation and autotuning must
not be captured); those backward passes accumulate into ``main_grad``, which holds no gradient at
that point of the step (the step's first forward precedes its first backward), so it is zeroed
afterwards and the ``main_grad_unwritten`` flags are restored.

Calls that do not match what was captured run the eager layers: evaluation (no autograd), another
input shape or dtype, a mask or rotary table that is present when it was absent at capture (or the
reverse), or a layer in eval mode.

The policy lives here as well: :func:`check_layer_graphs` (what a run with graphs may not combine),
:func:`attach_layer_graphs` (one :class:`LayerGraphs` per model chunk's block) and
:func:`arm_after_warmup` (the trainer's call at the start of each step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mcore.config.fields import ConfigError
from mcore.tensor_parallel.first_grad import UNWRITTEN, is_unwritten, opts_in, zero_if_unwritten

# Selective recompute modules that device graphs can capture: they recompute inside the backward pass
# that reads them (mcore.tensor_parallel.recompute.RecomputeWhenSaved) and run no backward of their own.
GRAPH_SAFE_RECOMPUTE_MODULES = frozenset({"layernorm", "mlp_act", "moe_act"})


def _signature(hidden: torch.Tensor, extras: Sequence[torch.Tensor | None]) -> tuple:
    def sig(t):
        return None if t is None else (tuple(t.shape), t.dtype, t.device, t.requires_grad)

    return (sig(hidden), *(sig(t) for t in extras))


class _CapturedLayer:
    """The two graphs of one layer and the static tensors they read and write."""

    def __init__(self, layer: torch.nn.Module):
        self.layer = layer
        self.params = tuple(p for p in layer.parameters() if p.requires_grad)
        self.static_input: torch.Tensor | None = None  # X_i
        self.static_output: torch.Tensor | None = None  # Y_i
        self.static_grad_output: torch.Tensor | None = None  # dY_i
        self.static_grads: tuple[torch.Tensor | None, ...] = ()  # dX_i, then one per parameter
        self.placeholder: tuple[bool, ...] = ()  # per parameter: its gradient went to main_grad
        self.overwriting: tuple[torch.nn.Parameter, ...] = ()  # weights whose first gradient is written
        self.forward_graph: Any = None
        self.backward_graphs: dict[bool, Any] = {}  # write form (True) / add form (False) -> graph


class _ReplayLayer(torch.autograd.Function):
    """Autograd node of one captured layer: inputs ``(hidden, *params)``, output the layer output."""

    @staticmethod
    def forward(ctx, captured: _CapturedLayer, hidden: torch.Tensor, *params):
        ctx.captured = captured
        if hidden.data_ptr() != captured.static_input.data_ptr():  # else the previous layer's Y
            captured.static_input.copy_(hidden)
        captured.forward_graph.replay()
        return captured.static_output.detach()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        captured: _CapturedLayer = ctx.captured
        if grad_output.data_ptr() != captured.static_grad_output.data_ptr():  # else the next layer's dX
            captured.static_grad_output.copy_(grad_output)
        _replay_backward(captured)
        grads = []
        for g, param, placeholder in zip(captured.static_grads[1:], captured.params, captured.placeholder):
            if placeholder:
                # The graph already added this gradient to main_grad; hand autograd a fresh tensor
                # it can keep without a copy (the static one is the graph's: autograd would clone
                # the whole weight), which the DDP hook then discards.
                grads.append(torch.empty_like(param))
            else:
                grads.append(None if g is None else g.detach())
        grad_input = captured.static_grads[0]
        return (None, None if grad_input is None else grad_input.detach(), *grads)


def _replay_backward(captured: _CapturedLayer) -> None:
    """Replay the backward graph whose form (write or add the fused weight gradients) the weights'
    ``main_grad_unwritten`` flags ask for, then clear the flags (module docstring)."""
    weights, graphs = captured.overwriting, captured.backward_graphs
    flags = [is_unwritten(p) for p in weights]
    write = bool(flags) and all(flags)
    if any(flags) and not write:  # mixed (not expected): zero the unwritten ones, add into all
        zero_if_unwritten(weights)
    if write and True not in graphs:  # only the add form: the old way, zero then add
        zero_if_unwritten(weights)
        write = False
    if not write and False not in graphs:  # only the write form: keep what main_grad holds, add it back
        kept = [p.main_grad.clone() for p in weights]
        graphs[True].replay()
        torch._foreach_add_([p.main_grad for p in weights], kept)
    else:
        graphs[write].replay()
    for p in weights:
        setattr(p, UNWRITTEN, False)


class LayerGraphs:
    """Captures and replays the layers of one :class:`~mcore.models.transformer.block.TransformerBlock`.

    Args:
        layers: the block's layers, in forward order.
        backend: a backend with the ``"device_graphs"`` capability, implementing
            :class:`mcore.backend.DeviceGraphs`: ``graph()`` returns an object with a ``capture(pool)``
            context manager and ``replay()``; ``graph_pool()`` a memory-pool handle shared by
            captures; ``side_stream()`` a context manager running work on a fresh stream.
        warmup_iters: forward/backward passes per layer on a side stream before capturing.
    """

    def __init__(self, layers: Sequence[torch.nn.Module], backend, warmup_iters: int = 2):
        if "device_graphs" not in backend.capabilities():
            raise ValueError(f"backend {backend.name!r} has no device graphs (capability 'device_graphs')")
        self.layers = list(layers)
        self.backend = backend
        self.warmup_iters = warmup_iters
        self.armed = False
        self.microbatches: int | None = None
        """Micro-batches per step, as :meth:`arm` was told (None: unknown, capture both backward forms)."""
        self.replays = 0
        """Micro-batch forwards served by the graphs (for tests and logs)."""
        self._captured: list[_CapturedLayer] | None = None
        self._signature: tuple | None = None
        self._static_extras: list[torch.Tensor | None] = []

    @property
    def captured(self) -> bool:
        return self._captured is not None

    def arm(self, microbatches: int | None = None) -> None:
        """Capture at the next training forward (call at the start of a step, before its forwards).

        ``microbatches``: per step; with one, a layer's backward is captured only in the form that
        writes the fused weight gradients (module docstring)."""
        self.armed = True
        self.microbatches = microbatches

    def applies(self, hidden: torch.Tensor, extras: Sequence[torch.Tensor | None]) -> bool:
        """Whether this forward call runs (or, armed, captures) the graphs."""
        if not (
            torch.is_grad_enabled() and hidden.requires_grad and all(layer.training for layer in self.layers)
        ):
            return False
        if self._captured is None:
            return self.armed
        return _signature(hidden, extras) == self._signature

    def __call__(self, hidden: torch.Tensor, extras: Sequence[torch.Tensor | None]) -> torch.Tensor:
        if self._captured is None:
            self._capture(hidden, extras)
        else:  # the graphs read the mask and rotary table at their capture-time addresses
            for static, given in zip(self._static_extras, extras):
                if static is not None and given.data_ptr() != static.data_ptr():
                    static.copy_(given)
        for captured in self._captured:
            hidden = _ReplayLayer.apply(captured, hidden, *captured.params)
        self.replays += 1
        return hidden

    # ----------------------------------------------------------------------------------------------

    def _capture(self, hidden: torch.Tensor, extras: Sequence[torch.Tensor | None]) -> None:
        backend = self.backend
        layers = [_CapturedLayer(layer) for layer in self.layers]
        extras = [None if t is None else t.detach().clone() for t in extras]

        # the weights' main_grad_unwritten flags as the step left them (the warm-up passes change them),
        # and what the forward counts (the MoE routers' log sums and expert-bias counts)
        unwritten = {id(p): is_unwritten(p) for c in layers for p in c.params}
        counting = [m for c in layers for m in c.layer.modules() if hasattr(m, "snapshot_step_state")]
        counts = [m.snapshot_step_state() for m in counting]
        backend.synchronize()
        with backend.side_stream():
            sample = hidden.detach().clone().requires_grad_(True)
            for c in layers:
                for _ in range(self.warmup_iters):
                    out = c.layer(sample, *extras)
                    torch.autograd.grad(out, (sample, *c.params), torch.zeros_like(out), allow_unused=True)
                    del out
        backend.synchronize()

        pool = backend.graph_pool()
        previous = hidden.detach().clone()
        for c in layers:  # X_{i+1} is Y_i: a leaf view of it, so that B_{i+1} stops at dX_{i+1}
            c.static_input = previous.detach().requires_grad_(True)
            c.forward_graph = backend.graph()
            with c.forward_graph.capture(pool):
                c.static_output = c.layer(c.static_input, *extras)
            previous = c.static_output
        grad_output = torch.empty_like(layers[-1].static_output)
        for c in reversed(layers):  # dY_i is dX_{i+1}
            c.static_grad_output = grad_output
            # Set by the layers' forward: which weights write their first gradient (first_grad.opts_in)
            c.overwriting = tuple(p for p in c.params if opts_in(p))
            forms = (False,) if not c.overwriting else (True,) if self.microbatches == 1 else (True, False)
            for i, write in enumerate(forms):
                for p in c.overwriting:  # what the FP8 backward reads while it is captured
                    setattr(p, UNWRITTEN, write)
                graph = c.backward_graphs[write] = backend.graph()
                with graph.capture(pool):
                    grads = torch.autograd.grad(
                        c.static_output,
                        (c.static_input, *c.params),
                        grad_output,
                        allow_unused=True,
                        retain_graph=i + 1 < len(forms),  # the next form backpropagates the same forward
                    )
                    if i == 0:
                        c.static_grads = grads
                        # Set by the fusing layers' forward: these gradients went to main_grad in the graph.
                        c.placeholder = tuple(
                            bool(getattr(p, "grad_added_to_main_grad", False)) for p in c.params
                        )
                    else:  # the same outputs whatever the form: dX_i and the non-fused gradients
                        for static, g, fused in zip(c.static_grads, grads, (False, *c.placeholder)):
                            if static is not None and not fused:
                                static.copy_(g)
                del grads
            # A fused weight's placeholder gradient is never read (the replay hands autograd a fresh
            # one): dropped, its pool memory serves the later captures instead of holding a
            # weight-sized tensor per layer (the MoE experts' are most of the model).
            c.static_grads = tuple(
                None if fused else g for g, fused in zip(c.static_grads, (False, *c.placeholder))
            )
            grad_output = c.static_grads[0]
            # The captured forward's autograd graph is not needed any more; kept, it would keep the
            # parameters' gradient accumulators (autograd nodes) alive, bound to the capture stream,
            # so every later backward would accumulate there, behind cross-stream waits.
            c.static_output = c.static_output.detach()
        backend.synchronize()

        # The warm-up passes accumulated into main_grad, which held no gradient yet (see the module
        # docstring): zero it, and restore the flags (on zeros, writing and adding agree) and the counts.
        for module, state in zip(counting, counts):
            module.restore_step_state(state)
        for c in layers:
            for p in c.params:
                main_grad = getattr(p, "main_grad", None)
                if main_grad is not None:
                    main_grad.zero_()
                if is_unwritten(p) != unwritten[id(p)]:
                    setattr(p, UNWRITTEN, unwritten[id(p)])
        self._captured, self._static_extras = layers, extras
        self._signature = _signature(hidden, extras)
        self.armed = False


# --------------------------------------------------------------------------------------------------
# policy: when a run may use the graphs, where they go, when they are captured


def check_layer_graphs(cfg, backend) -> None:
    """What ``--cuda-graph-impl local`` cannot replay, as one :class:`ConfigError` naming the flag.

    ``cfg`` is the run's configuration (:class:`mcore.training.run_config.RunConfig`: its ``model``,
    ``parallel``, ``training`` and ``optimizer`` groups)."""
    model, parallel = cfg.model, cfg.parallel
    flag = "--cuda-graph-impl local"
    if "device_graphs" not in backend.capabilities():
        raise ConfigError(f"{flag}: backend {backend.name!r} has no device graphs")
    if parallel.pipeline_model_parallel_size > 1:
        raise ConfigError(
            f"{flag} keeps one micro-batch's layer activations at a time: it needs "
            f"--pipeline-model-parallel-size 1 (got {parallel.pipeline_model_parallel_size})"
        )
    if cfg.training.compile_layers:
        raise ConfigError(f"{flag} and --compile-layers: choose one")
    if model.num_experts is not None:
        _check_moe_graphs(model, parallel, flag)
    captured_recompute = model.selective_recompute_modules - GRAPH_SAFE_RECOMPUTE_MODULES
    if model.recompute_granularity == "full" or captured_recompute:
        # The backward graph is captured with torch.autograd.grad; a checkpointed region backpropagates
        # with its own backward() call, which accumulates into .grad instead of returning gradients.
        # layernorm and mlp_act recompute inside the backward that reads them, which is captured.
        what = (
            "--recompute-granularity full"
            if model.recompute_granularity == "full"
            else f"--recompute-modules {' '.join(sorted(captured_recompute))}"
        )
        raise ConfigError(
            f"{flag}: {what} cannot be captured (a checkpointed region runs its own backward pass); "
            "--recompute-granularity selective --recompute-modules layernorm mlp_act can"
        )
    if model.attention_dropout > 0.0:
        raise ConfigError(
            f"{flag}: --attention-dropout {model.attention_dropout} draws from the tensor-parallel RNG "
            "stream, whose state swaps cannot be captured; use --attention-dropout 0"
        )
    if model.hidden_dropout > 0.0 and parallel.sequence_parallel:
        raise ConfigError(
            f"{flag}: --hidden-dropout {model.hidden_dropout} with --sequence-parallel draws from the "
            "tensor-parallel RNG stream, whose state swaps cannot be captured"
        )
    if cfg.optimizer.overlap_param_gather:
        raise ConfigError(
            f"{flag}: --overlap-param-gather waits for parameters in module hooks that a replay skips"
        )


def _check_moe_graphs(model, parallel, flag: str) -> None:
    """MoE layers replay when nothing in them waits for the host: dropless routing (``T * topk`` rows,
    per-expert counts that stay on the device, read by the grouped GEMM there) with every expert on
    the rank (the expert-parallel exchanges size their buffers from counts read on the host)."""
    what = f"{flag} with --num-experts={model.num_experts}"
    if parallel.expert_model_parallel_size > 1:
        raise ConfigError(
            f"{what}: --expert-model-parallel-size {parallel.expert_model_parallel_size} exchanges tokens "
            "in buffers sized on the host each step; device graphs need --expert-model-parallel-size 1"
        )
    etp = parallel.expert_tensor_parallel_size or parallel.tensor_model_parallel_size
    if etp > 1 and model.moe_token_dispatcher_type != "allgather":
        raise ConfigError(
            f"{what}: --moe-token-dispatcher-type {model.moe_token_dispatcher_type} with expert tensor "
            f"parallelism ({etp}) gathers rows of sizes read on the host; use --moe-token-dispatcher-type "
            "allgather or --expert-tensor-parallel-size 1"
        )
    if model.moe_expert_capacity_factor is not None:
        raise ConfigError(
            f"{what}: --moe-expert-capacity-factor {model.moe_expert_capacity_factor} drops a varying "
            "number of tokens (rows counted on the host); device graphs need dropless routing"
        )
    if "global_aux_loss" in model.moe_router_load_balancing_type:
        raise ConfigError(
            f"{what}: --moe-router-load-balancing-type global_aux_loss divides by the micro-batches seen "
            "so far, a host count a replay cannot update; use aux_loss or seq_aux_loss"
        )


def transformer_block(chunk: torch.nn.Module) -> torch.nn.Module | None:
    """A model chunk's transformer block: GPT's ``decoder``, an encoder-only model's (BERT's)
    ``encoder``; None when it has neither."""
    block = getattr(chunk, "decoder", None)
    return block if block is not None else getattr(chunk, "encoder", None)


def attach_layer_graphs(chunks: Sequence[torch.nn.Module], backend) -> None:
    """Give each model chunk's transformer block its :class:`LayerGraphs` (before the DDP wrap)."""
    for chunk in chunks:
        block = transformer_block(chunk)
        block.layer_graphs = LayerGraphs(block.layers, backend)


def layer_graphs_of(chunks: Sequence[torch.nn.Module]) -> list[LayerGraphs]:
    """The :class:`LayerGraphs` of the (unwrapped) chunks' blocks; empty when the run uses none."""
    blocks = [transformer_block(chunk) for chunk in chunks]
    return [b.layer_graphs for b in blocks if getattr(b, "layer_graphs", None) is not None]


def arm_after_warmup(
    graphs: Sequence[LayerGraphs], steps_run: int, warmup_steps: int, microbatches: int | None = None
) -> None:
    """At the start of a training step: arm the graphs not captured yet once ``warmup_steps`` eager
    steps have run (``--cuda-graph-warmup-steps``), so they are captured in this step's first forward
    (``microbatches``: per step, see :meth:`LayerGraphs.arm`)."""
    if steps_run < warmup_steps:
        return
    for layer_graphs in graphs:
        if not layer_graphs.captured:
            layer_graphs.arm(microbatches)
