"""Selective recomputation (``--recompute-granularity selective --recompute-modules ...``).

For a GPT-2-style config (LayerNorm, GeLU, biases) and a Llama-style one (RMSNorm, SwiGLU, no
biases, GQA, RoPE), with each recompute module on:

* the loss and every parameter gradient equal those without recomputation (fp32, tight);
* the activation bytes kept for backward (:class:`mcore.testing.memory.SavedActivations`) drop by
  at least what the module discards (``layernorm``: both norm outputs, ``s*b*h`` each; ``mlp_act``:
  the activation output, ``s*b*F``), so a module that discarded nothing fails;
* the same holds at TP=2 with sequence parallelism (two processes), against TP=1;

plus the config checks (their messages name the flag and the value), dropout replay, a layer that
is also under full recomputation, and a layer compiled with ``torch.compile`` (``fullgraph``).
"""

from __future__ import annotations

import pytest
import torch

from mcore.config.cli import parse_config
from mcore.config.fields import ConfigError
from mcore.config.parallel import ParallelConfig
from mcore.distributed.groups import ProcessGroups, initialize_parallel
from mcore.models.gpt.gpt_model import GPTModel
from mcore.models.transformer.build_context import default_device
from mcore.models.transformer.model_config import ModelConfig, padded_vocab_size
from mcore.tensor_parallel.random import model_parallel_seed
from mcore.testing.distributed import run_distributed
from mcore.testing.distributed import test_backend_name as selected_backend_name
from mcore.testing.memory import SavedActivations

SEED = 1234
VOCAB, DIVISIBLE_BY = 100, 32
SEQ, BATCH, HIDDEN, LAYERS = 16, 2, 64, 2
BASE = dict(
    num_layers=LAYERS,
    hidden_size=HIDDEN,
    seq_length=SEQ,
    make_vocab_size_divisible_by=DIVISIBLE_BY,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
CONFIGS = {
    "gpt2": dict(num_attention_heads=4, normalization="LayerNorm"),
    "llama": dict(
        num_attention_heads=8,
        group_query_attention=True,
        num_query_groups=4,
        ffn_hidden_size=96,
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        disable_bias_linear=True,
        untie_embeddings_and_output_weights=True,
    ),
    # the other code paths: residual after the norm, fp32 residual stream, tanh GeLU, QKV bias only
    "post-norm": dict(
        num_attention_heads=4,
        apply_residual_connection_post_layernorm=True,
        fp32_residual_connection=True,
        openai_gelu=True,
        disable_bias_linear=True,
        add_qkv_bias=True,
    ),
}
MODULES = [
    ("layernorm",),
    ("mlp_act",),
    ("mlp",),
    ("layernorm", "mlp_act"),
    ("core_attn", "layernorm", "mlp_act"),
    ("layernorm", "mlp"),
]
TIGHT = dict(rtol=1e-6, atol=1e-7)  # fp32: recomputation only reorders a few gradient sums


def _config(name: str, modules=None, **changes) -> ModelConfig:
    recompute = {} if modules is None else dict(recompute_granularity="selective", recompute_modules=modules)
    return ModelConfig(**{**BASE, **CONFIGS[name], **recompute, **changes})


def _batch():
    gen = torch.Generator().manual_seed(42)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return tokens.to(default_device()), labels.to(default_device())


def _model(cfg: ModelConfig, groups=None, sp=False) -> GPTModel:
    """On the selected backend's current device (``MCORE_TEST_BACKEND``, CPU by default)."""
    groups = groups or ProcessGroups.single()
    vocab = padded_vocab_size(VOCAB, DIVISIBLE_BY, groups.tp_size)
    return GPTModel(cfg, groups, vocab, sequence_parallel=sp, seed=SEED)


def _step(model: GPTModel):
    """(per-token loss, gradients by logical name, activation bytes kept for backward)."""
    tokens, labels = _batch()
    with SavedActivations(exclude=model.parameters()) as saved:
        loss = model(tokens, labels=labels)
    kept = saved.nbytes()
    saved.clear()
    loss.mean().backward()
    model.all_reduce_sequence_parallel_grads()
    params = dict(model.named_parameters())
    grads = {spec.name: params[local].grad for local, spec in model.sharded_parameters().items()}
    return loss.detach(), grads, kept


def _discarded_bytes(cfg: ModelConfig, modules, tp: int = 1, sp: bool = False) -> int:
    """The least that ``modules`` must free per model: the tensors they stop keeping (fp32).

    With sequence parallelism the QKV projection and fc1 keep this rank's ``[s/p, b, h]`` norm
    output (for the all-gather in backward), which ``layernorm`` then recomputes.
    """
    tokens = SEQ * BATCH
    per_layer = 0
    if "layernorm" in modules:
        per_layer += 2 * (tokens // tp if sp else tokens) * cfg.hidden_size
    if "mlp_act" in modules:
        per_layer += tokens * cfg.ffn_hidden_size // tp
    if "mlp" in modules:  # at least fc1's output and the activation output
        per_layer += tokens * (2 if cfg.swiglu else 1) * cfg.ffn_hidden_size // tp
        per_layer += tokens * cfg.ffn_hidden_size // tp
    return 4 * cfg.num_layers * per_layer


# -- configuration ----------------------------------------------------------------------------------


def test_recompute_modules_defaults_and_flags():
    assert _config("gpt2").selective_recompute_modules == frozenset()
    assert ModelConfig(
        **BASE, **CONFIGS["gpt2"], recompute_granularity="selective"
    ).selective_recompute_modules == {"core_attn"}
    assert _config("gpt2", ("layernorm", "mlp_act")).selective_recompute_modules == {"layernorm", "mlp_act"}
    assert _config("gpt2", ()).selective_recompute_modules == frozenset()  # selective, nothing chosen
    argv = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
        "--recompute-granularity selective --recompute-modules core_attn layernorm mlp_act"
    ).split()
    cfg = parse_config({"model": ModelConfig}, argv)["model"]
    assert cfg.recompute_modules == ("core_attn", "layernorm", "mlp_act")
    assert cfg.selective_recompute_modules == {"core_attn", "layernorm", "mlp_act"}


@pytest.mark.parametrize(
    "changes,message",
    [
        (
            dict(recompute_granularity="selective", recompute_modules=("layernorm", "attn")),
            "recompute_modules=['layernorm', 'attn'] (--recompute-modules): 'attn' is unknown; "
            "choose from core_attn, layernorm, mlp_act, mlp, moe_act, moe, mla_up_proj",
        ),
        (
            dict(recompute_granularity="selective", recompute_modules=("mla_up_proj",)),
            "recompute_modules=['mla_up_proj'] (--recompute-modules): 'mla_up_proj' needs --multi-latent-attention",
        ),
        (
            dict(recompute_modules=("layernorm",)),
            "recompute_modules=['layernorm'] (--recompute-modules) applies only to "
            "recompute_granularity='selective' (got None)",
        ),
        (
            dict(
                recompute_granularity="full",
                recompute_method="uniform",
                recompute_num_layers=1,
                recompute_modules=("mlp_act",),
            ),
            "recompute_modules=['mlp_act'] (--recompute-modules) applies only to "
            "recompute_granularity='selective' (got 'full')",
        ),
        (
            dict(recompute_granularity="selective", recompute_modules=("mlp", "mlp_act")),
            "'mlp' already recomputes the whole MLP",
        ),
        (
            dict(recompute_granularity="selective", recompute_modules="layernorm"),
            "recompute_modules='layernorm' (--recompute-modules) must be a list of module names",
        ),
    ],
)
def test_bad_recompute_modules_name_the_flag_and_value(changes, message):
    with pytest.raises(ConfigError) as err:
        ModelConfig(**BASE, **CONFIGS["gpt2"], **changes)
    assert message in str(err.value)


def test_bad_recompute_module_on_the_command_line(capsys):
    argv = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
        "--recompute-modules layernorm"
    ).split()
    with pytest.raises(SystemExit):
        parse_config({"model": ModelConfig}, argv)
    err = capsys.readouterr().err
    assert "--recompute-modules" in err and "recompute_granularity='selective'" in err


# -- one process ------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def backend():
    """The test backend (``MCORE_TEST_BACKEND``), selected for this module's in-process tests."""
    from mcore.plugins.manager import select_backend

    return select_backend(selected_backend_name())


@pytest.fixture(scope="module")
def references():
    out = {}
    for name in CONFIGS:
        model = _model(_config(name))
        out[name] = _step(model)
    return out


@pytest.mark.parametrize("modules", MODULES, ids="+".join)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_same_loss_and_gradients_and_fewer_saved_bytes(references, name, modules):
    ref_loss, ref_grads, ref_kept = references[name]
    cfg = _config(name, modules)
    loss, grads, kept = _step(_model(cfg))
    torch.testing.assert_close(loss, ref_loss, **TIGHT)
    assert grads.keys() == ref_grads.keys()
    for key in ref_grads:
        torch.testing.assert_close(grads[key], ref_grads[key], **TIGHT, msg=lambda m, k=key: f"{k}: {m}")
    expected = _discarded_bytes(cfg, modules)
    assert ref_kept - kept >= expected, (ref_kept, kept, expected)


def test_saved_bytes_per_layer_are_the_discarded_tensors(monkeypatch):
    """The exact drop with the reference ops (fp32): ``layernorm`` frees both norm outputs (the norms
    keep their inputs and statistics for their own backward), ``mlp_act`` the GeLU output (its
    recipe holds fc1's output, which the GeLU's backward keeps): ``2 h`` and ``F`` floats per token
    and layer."""
    from mcore.backend import current_backend
    from mcore.ops.registry import reference_table

    # the counts are those of the reference ops; a backend's fused kernels save other tensors
    monkeypatch.setattr(current_backend(), "ops", reference_table())
    kept = {}
    for modules in (None, ("layernorm",), ("mlp_act",)):
        _, _, kept[modules] = _step(_model(_config("gpt2", modules)))
    cfg = _config("gpt2")
    per_token_layer = 4 * SEQ * BATCH * LAYERS
    assert kept[None] - kept[("layernorm",)] == per_token_layer * 2 * cfg.hidden_size
    assert kept[None] - kept[("mlp_act",)] == per_token_layer * cfg.ffn_hidden_size


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_dropout_is_replayed(name):
    """Dropout on (attention and residual): the recomputing model draws the same masks."""
    results = []
    for modules in (None, ("core_attn", "layernorm", "mlp_act")):
        model = _model(_config(name, modules, hidden_dropout=0.2, attention_dropout=0.2))
        model_parallel_seed(SEED)
        torch.manual_seed(SEED)
        results.append(_step(model))
    (loss0, grads0, _), (loss1, grads1, _) = results
    torch.testing.assert_close(loss1, loss0, **TIGHT)
    for key in grads0:
        torch.testing.assert_close(grads1[key], grads0[key], **TIGHT)


@pytest.mark.parametrize("method", ["uniform", "block"])
def test_inside_full_recompute(references, method):
    """Layers with output-discarding checkpoints, themselves under full recomputation: the discard
    is inactive in the no-grad forward and active (hooks and all) in the backward replay."""
    ref_loss, ref_grads, _ = references["llama"]
    model = _model(_config("llama", ("layernorm", "mlp_act")))
    model.decoder.recompute_method, model.decoder.recompute_num_layers = method, 1
    loss, grads, _ = _step(model)
    torch.testing.assert_close(loss, ref_loss, **TIGHT)
    for key in ref_grads:
        torch.testing.assert_close(grads[key], ref_grads[key], **TIGHT)


def test_with_ddp_and_gradient_accumulation_fusion():
    """mcore's DDP wrapper (fp32 ``main_grad``, so the linear layers fuse their weight gradient into
    it), two micro-batches: the accumulated gradients do not change with the recompute modules."""
    from mcore.distributed.ddp import DDPConfig, DistributedDataParallel

    main_grads = {}
    for modules in (None, ("layernorm", "mlp_act"), ("layernorm", "mlp")):
        model = _model(_config("llama", modules))
        ddp = DistributedDataParallel(model, DDPConfig(), ProcessGroups.single())
        tokens, labels = _batch()
        for _ in range(2):
            ddp(tokens, labels=labels).mean().backward()
        ddp.finish_grad_sync()
        main_grads[modules] = {name: p.main_grad.clone() for name, p in model.named_parameters()}
    for modules, grads in main_grads.items():
        for key, grad in grads.items():
            torch.testing.assert_close(
                grad, main_grads[None][key], **TIGHT, msg=lambda m, k=key, r=modules: f"{r} {k}: {m}"
            )


def test_evaluation_and_no_grad_keep_the_plain_path():
    model = _model(_config("gpt2", ("layernorm", "mlp_act")))
    reference = _model(_config("gpt2"))
    tokens, labels = _batch()
    with torch.no_grad():
        assert torch.equal(model(tokens, labels=labels), reference(tokens, labels=labels))
    model.eval(), reference.eval()
    torch.testing.assert_close(model(tokens, labels=labels), reference(tokens, labels=labels), **TIGHT)


def test_compiled_layer_is_traceable_and_discards():
    """``torch.compile(fullgraph=True)`` of each layer: the checkpoints become recompute regions
    (no graph break), the gradients stay the same, and the partitioner keeps fewer bytes."""
    from mcore.backend import get_ops

    get_ops()  # select the backend outside the compiled region
    torch._dynamo.reset()
    kept, grads = {}, {}
    for modules in (None, ("layernorm", "mlp_act")):
        model = _model(_config("llama", modules))
        for layer in model.decoder.layers:
            layer.compile(backend="aot_eager_decomp_partition", fullgraph=True, dynamic=False)
        _, grads[modules], kept[modules] = _step(model)
    torch._dynamo.reset()
    for key in grads[None]:
        torch.testing.assert_close(
            grads[("layernorm", "mlp_act")][key], grads[None][key], rtol=1e-5, atol=1e-6
        )
    cfg = _config("llama")
    assert kept[None] - kept[("layernorm", "mlp_act")] >= _discarded_bytes(cfg, ("layernorm", "mlp_act"))


# -- TP=2 with sequence parallelism (two processes) -------------------------------------------------


def _tp2_cases():
    references = {name: _step(_model(_config(name))) for name in ("gpt2", "llama")}
    groups = initialize_parallel(ParallelConfig(tensor_model_parallel_size=2))
    out = {}
    for name in ("gpt2", "llama"):
        ref_loss, ref_grads, _ = references[name]
        for sp in (False, True):
            base_loss = base_grads = base_kept = None
            for modules in (None, ("layernorm",), ("mlp_act",), ("core_attn", "layernorm", "mlp_act")):
                cfg = _config(name, modules)
                model = _model(cfg, groups, sp=sp)
                loss, grads, kept = _step(model)
                if modules is None:
                    base_loss, base_grads, base_kept = loss, grads, kept
                    modules = ()
                specs = model.sharded_parameters().values()
                worst_tp1 = max(
                    (grads[s.name] - s.shard(ref_grads[s.name])).abs().max().item() for s in specs
                )
                worst_same = max((grads[k] - base_grads[k]).abs().max().item() for k in grads)
                out[(name, sp, modules)] = dict(
                    loss_vs_tp1=(loss - ref_loss).abs().max().item(),
                    grad_vs_tp1=worst_tp1,
                    loss_vs_off=(loss - base_loss).abs().max().item(),
                    grad_vs_off=worst_same,
                    freed=base_kept - kept,
                    expected=_discarded_bytes(cfg, modules, tp=2, sp=sp),
                )
    return out


@pytest.fixture(scope="module")
def tp2_results():
    return run_distributed(_tp2_cases, 2, timeout=600)


def test_tp2_sequence_parallel_matches_tp1_and_recompute_off(tp2_results):
    failures = []
    for rank, results in enumerate(tp2_results):
        for key, r in results.items():
            if r["loss_vs_off"] > 1e-6 or r["grad_vs_off"] > 1e-6:
                failures.append(f"rank {rank} {key}: differs from recompute off: {r}")
            if r["loss_vs_tp1"] > 1e-5 or r["grad_vs_tp1"] > 1e-5:
                failures.append(f"rank {rank} {key}: differs from TP=1: {r}")
            if r["freed"] < r["expected"]:
                failures.append(f"rank {rank} {key}: freed {r['freed']} < {r['expected']} bytes")
    assert not failures, "\n".join(failures)
    assert len(tp2_results[0]) == 2 * 2 * 4
