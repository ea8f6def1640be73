"""The fused FP8 producers (:mod:`mcore.fp8.fused`) equal the unfused FP8 path.

1. Bit for bit (CPU, reference ops): a GPT (LayerNorm, GeLU, biases, hidden dropout), a Llama-style
   model (RMSNorm, SwiGLU, no biases, RoPE, GQA), that model with biases, and a tanh-GeLU RMSNorm
   GPT, with the delayed recipe, fp32 (Llama also bf16), two steps with a scale update after each
   and an evaluation forward: the losses, every parameter gradient (norms, biases, the weights'
   ``main_grad`` under gradient-accumulation fusion) and the delayed states (amax histories,
   scales) are identical with ``--no-fp8-fused-producers`` and without; also under full
   recomputation and ``--recompute-modules mlp`` (and ``layernorm mlp_act``, which the fused path
   has nothing to free for). Each fused run must call the fused Functions (else the comparison
   proves nothing).
2. TP=2 with the fused path equals TP=1 (2 gloo processes), within the bounds of
   ``test_fp8_parallel.py`` (the GEMMs' and the all-reduce's summation orders differ).
"""

from __future__ import annotations

import pytest
import torch

from mcore.config.parallel import ParallelConfig
from mcore.distributed.groups import ProcessGroups, initialize_parallel
from mcore.fp8 import producers as fp8_producers
from mcore.fp8.config import Fp8Config
from mcore.fp8.scaling import delayed_states, update_fp8_scales
from mcore.models.bert.bert_model import BertModel
from mcore.models.gpt.gpt_model import GPTModel
from mcore.models.transformer.model_config import ModelConfig, padded_vocab_size
from mcore.testing.distributed import run_distributed
from mcore.training.run_config import parse_run_config

VOCAB, SEQ, BATCH = 100, 16, 2
COMMON = dict(
    num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=SEQ,
    max_position_embeddings=SEQ, make_vocab_size_divisible_by=32, attention_dropout=0.0,
)  # fmt: skip
MODELS = {
    "gpt": dict(COMMON, hidden_dropout=0.1),  # LayerNorm, GeLU, biases (QKV's: fp8_cast_dbias)
    "llama": dict(
        COMMON, hidden_dropout=0.0, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
        disable_bias_linear=True, group_query_attention=True, num_query_groups=2,
        untie_embeddings_and_output_weights=True,
    ),
}  # fmt: skip
MODELS["llama-bias"] = dict(MODELS["llama"], disable_bias_linear=False)  # SwiGLU(h + b1)
MODELS["tanh-rms"] = dict(MODELS["gpt"], openai_gelu=True, normalization="RMSNorm")
RECOMPUTE = {
    "none": {},
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "mlp": dict(recompute_granularity="selective", recompute_modules=("mlp",)),
    # nothing to free on the fused path: it ignores them, the unfused path recomputes
    "layernorm-mlp_act": dict(recompute_granularity="selective", recompute_modules=("layernorm", "mlp_act")),
}


class _Counter:
    """Counts the fused Functions' calls (monkeypatched around the glue's entry points)."""

    def __init__(self, monkeypatch):
        self.calls = {"norm_qkv": 0, "norm_mlp": 0}
        for name in self.calls:
            original = getattr(fp8_producers, name)
            monkeypatch.setattr(fp8_producers, name, self._counted(name, original))

    def _counted(self, name, original):
        def counted(*args, **kwargs):
            self.calls[name] += 1
            return original(*args, **kwargs)

        return counted


def _train(groups, model_name: str, fused: bool, recompute: str = "none", dtype=torch.float32):
    """Two forward/backward steps, each closed by :func:`update_fp8_scales` (the weights do not change),
    then an evaluation forward.

    Returns the per-token losses of the three, ``{local name: gradient}`` (``main_grad`` for weights
    whose gradient is fused into it) and ``{state name: tensor}`` of the delayed states.
    """
    cfg = ModelConfig(**MODELS[model_name], **RECOMPUTE[recompute])
    fp8 = Fp8Config(
        fp8_format="hybrid", fp8_recipe="delayed", fp8_amax_history_len=2, fp8_fused_producers=fused
    )
    vocab = padded_vocab_size(VOCAB, 32, groups.tp_size)
    model = GPTModel(cfg, groups, vocab, params_dtype=dtype, device=torch.device("cpu"), fp8=fp8)
    for p in model.parameters():
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    torch.manual_seed(3)  # the dropout masks
    gen = torch.Generator().manual_seed(7)
    tokens, labels = torch.randint(0, VOCAB, (2, BATCH, SEQ), generator=gen)
    losses = []
    for _ in range(2):
        loss = model(tokens, None, None, labels=labels)
        loss.mean().backward()
        update_fp8_scales(model, (groups.tp,))
        losses.append(loss.detach())
    model.eval()
    with torch.no_grad():  # evaluation: the producers write no qT and record no amax
        losses.append(model(tokens, None, None, labels=labels))
    grads = {}
    for name, p in model.named_parameters():
        grads[name] = p.main_grad if getattr(p, "grad_added_to_main_grad", False) else p.grad
    states = {}
    for name, state in delayed_states(model):
        states[f"{name}.amax_history"] = state.amax_history.clone()
        states[f"{name}.scale"] = state.scale.clone()
    return torch.stack(losses), grads, states


def _assert_identical(got, want):
    losses, grads, states = got
    ref_losses, ref_grads, ref_states = want
    assert torch.equal(losses, ref_losses), (losses - ref_losses).abs().max()
    assert grads.keys() == ref_grads.keys() and states.keys() == ref_states.keys()
    for name, g in grads.items():
        assert g is not None and torch.equal(g, ref_grads[name]), name
    for name, s in states.items():
        assert torch.equal(s, ref_states[name]), name
    assert any(s.abs().sum() > 0 for s in states.values())


@pytest.mark.parametrize("model_name", list(MODELS))
def test_fused_producers_are_bit_identical_to_the_unfused_fp8_path(monkeypatch, model_name):
    single = ProcessGroups.single()
    unfused = _train(single, model_name, fused=False)
    counter = _Counter(monkeypatch)
    fused = _train(single, model_name, fused=True)
    # 2 layers x (2 steps + 1 evaluation), one call each
    assert counter.calls == {"norm_qkv": 6, "norm_mlp": 6}
    _assert_identical(fused, unfused)


@pytest.mark.parametrize("fused", [True, False])
def test_each_weight_is_cast_once_a_forward_and_backward(monkeypatch, fused):
    """The forward's one cast of a weight writes ``W_q`` and ``W_q^T`` (kept for the input gradient):
    the backward reads no weight again, on the fused and the unfused path."""
    from mcore.backend import get_ops
    from mcore.fp8 import fused as fp8_fused
    from mcore.fp8 import linear as fp8_linear_module

    casts = []

    class Recording:  # the op table, with fp8_cast recording its input and outputs asked for
        def __getattr__(self, name):
            op = getattr(get_ops(), name)
            if name != "fp8_cast":
                return op

            def fp8_cast(x, *args, **kwargs):
                casts.append((x.data_ptr(), kwargs.get("rowwise", True), kwargs.get("columnwise", False)))
                return op(x, *args, **kwargs)

            return fp8_cast

    for module in (fp8_linear_module, fp8_fused):
        monkeypatch.setattr(module, "get_ops", Recording)
    cfg = ModelConfig(**MODELS["gpt"])
    fp8 = Fp8Config(fp8_format="hybrid", fp8_recipe="delayed", fp8_fused_producers=fused)
    model = GPTModel(cfg, ProcessGroups.single(), 128, device=torch.device("cpu"), fp8=fp8)
    weights = {p.data_ptr(): name for name, p in model.named_parameters() if p.dim() == 2}
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    model(tokens, None, None, labels=tokens).mean().backward()
    weight_casts = [(weights[ptr], r, c) for ptr, r, c in casts if ptr in weights]
    fp8_weights = [n for n in weights.values() if ".layers." in n]  # the linears of the 2 layers
    assert sorted(n for n, _, _ in weight_casts) == sorted(fp8_weights)  # once each
    assert all(r and c for _, r, c in weight_casts)  # W_q and W_q^T in the one cast


@pytest.mark.parametrize("recompute", ["full", "mlp", "layernorm-mlp_act"])
def test_fused_producers_under_recomputation(monkeypatch, recompute):
    single = ProcessGroups.single()
    unfused = _train(single, "gpt", fused=False, recompute=recompute)
    counter = _Counter(monkeypatch)
    fused = _train(single, "gpt", fused=True, recompute=recompute)
    # 2 layers x (2 steps x (forward, recompute) + 1 evaluation); no recompute of the fused MLP
    assert counter.calls["norm_mlp"] == (6 if recompute == "layernorm-mlp_act" else 10)
    _assert_identical(fused, unfused)


def test_fused_producers_bf16_llama(monkeypatch):
    """bf16 activations: the producers round the norm/activation output to bf16 before the cast, as
    the unfused ops write it."""
    single = ProcessGroups.single()
    unfused = _train(single, "llama", fused=False, dtype=torch.bfloat16)
    counter = _Counter(monkeypatch)
    fused = _train(single, "llama", fused=True, dtype=torch.bfloat16)
    assert counter.calls == {"norm_qkv": 6, "norm_mlp": 6}
    _assert_identical(fused, unfused)


def test_the_switch_and_the_conditions_select_the_path():
    single = ProcessGroups.single()
    fp8 = dict(fp8_format="hybrid", fp8_recipe="delayed")

    def layer(fp8_kwargs, **model):
        cfg = ModelConfig(**{**MODELS["gpt"], **model})
        return GPTModel(
            cfg, single, 128, device=torch.device("cpu"), fp8=Fp8Config(**fp8_kwargs)
        ).decoder.layers[0]

    on = layer(fp8)
    assert on.fp8_fused_qkv and on.fp8_fused_mlp
    for off in (
        layer({**fp8, "fp8_fused_producers": False}),
        layer({**fp8, "fp8_recipe": "tensorwise"}),
        layer({**fp8, "fp8_wgrad": False}),
        layer(fp8, apply_residual_connection_post_layernorm=True),
        layer(fp8, fp32_residual_connection=True),
    ):
        assert not (off.fp8_fused_qkv or off.fp8_fused_mlp)
    geglu = layer(fp8, geglu=True)
    assert geglu.fp8_fused_qkv and not geglu.fp8_fused_mlp
    bert = BertModel(
        ModelConfig(**MODELS["gpt"]), single, 128, device=torch.device("cpu"), fp8=Fp8Config(**fp8)
    )
    assert all(layer.fp8_fused_qkv and layer.fp8_fused_mlp for layer in bert.encoder.layers)
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]
    argv += ["--fp8-format", "hybrid"]
    assert parse_run_config(argv).fp8.fp8_fused_producers
    assert not parse_run_config([*argv, "--no-fp8-fused-producers"]).fp8.fp8_fused_producers


# -- TP=2 equals TP=1 on the fused path ------------------------------------------------------------

LOSS_TOL, GRAD_TOL = 1e-4, 1e-4  # as test_fp8_parallel.py's delayed recipe


def _rel_err(actual, expected) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def _tp_run(groups, model_name: str):
    """Per-token losses and gradients (by logical name) of the second of two steps (a scale update
    between them), on the fused path."""
    cfg = ModelConfig(**{**MODELS[model_name], "hidden_dropout": 0.0})
    fp8 = Fp8Config(fp8_format="hybrid", fp8_recipe="delayed", fp8_amax_history_len=2)
    vocab = padded_vocab_size(VOCAB, 32, groups.tp_size)
    model = GPTModel(cfg, groups, vocab, device=torch.device("cpu"), fp8=fp8)
    assert all(layer.fp8_fused_qkv and layer.fp8_fused_mlp for layer in model.decoder.layers)
    gen = torch.Generator().manual_seed(7)
    tokens, labels = torch.randint(0, VOCAB, (2, BATCH, SEQ), generator=gen)
    for step in range(2):
        model.zero_grad(set_to_none=True)
        loss = model(tokens, None, None, labels=labels)
        loss.mean().backward()
        if step == 0:
            update_fp8_scales(model, (groups.tp,))
    params = dict(model.named_parameters())
    grads = {spec.name: (spec, params[local].grad) for local, spec in model.sharded_parameters().items()}
    return loss.detach(), grads


def _tp_cases():
    refs = {name: _tp_run(ProcessGroups.single(), name) for name in ("gpt", "llama")}
    groups = initialize_parallel(ParallelConfig(tensor_model_parallel_size=2))
    out = {}
    for name, (ref_loss, ref_grads) in refs.items():
        loss, grads = _tp_run(groups, name)
        grad_err = max(_rel_err(g, spec.shard(ref_grads[n][1])) for n, (spec, g) in grads.items())
        out[name] = (_rel_err(loss, ref_loss), grad_err)
    return out


def test_fused_producers_tp2_equal_tp1():
    """GPT (QKV bias split over TP: its gradient from fp8_cast_dbias on each shard) and Llama."""
    for rank in run_distributed(_tp_cases, 2, timeout=300):
        for name, (loss_err, grad_err) in rank.items():
            assert loss_err < LOSS_TOL, (name, loss_err)
            assert grad_err < GRAD_TOL, (name, grad_err)
