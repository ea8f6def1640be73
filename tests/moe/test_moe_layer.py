"""The MoE layer against a per-token loop over experts (fp64), its recompute options, and a tiny MoE
GPT through the real ``pretrain`` entry point (one process)."""

import json

import pytest
import torch

from mcore.models.transformer.build_context import BuildContext
from mcore.models.transformer.model_config import ModelConfig
from mcore.models.transformer.moe.moe_layer import MoELayer

H, E, F = 8, 4, 6


def _layer(**flags):
    base = dict(num_layers=1, hidden_size=H, num_attention_heads=2, seq_length=4, ffn_hidden_size=F)
    cfg = ModelConfig(**{**base, "num_experts": E, "moe_router_dtype": "fp64", **flags})
    torch.manual_seed(0)
    layer = MoELayer(cfg, BuildContext(params_dtype=torch.float64))
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float64) * 0.5)
    return layer.double().train()


def _loop(layer, x, topk, shared=False):
    """sum_e p_e(t) * expert_e(x_t) (+ shared) token by token, from the layer's weights."""
    w = layer.router.weight.double()
    fc1, fc2 = layer.experts.linear_fc1.weight, layer.experts.linear_fc2.weight
    out = []
    for xt in x.reshape(-1, H):
        logits = w @ xt
        top = logits.topk(topk)
        probs = torch.softmax(top.values, 0)
        y = torch.zeros(H, dtype=torch.float64)
        for p, e in zip(probs, top.indices.tolist()):
            gate, up = (fc1[e] @ xt).chunk(2)
            y = y + p * (fc2[e] @ (torch.nn.functional.silu(gate) * up))
        if shared:
            s = layer.shared_experts
            gate, up = (s.linear_fc1.weight @ xt).chunk(2)
            z = s.linear_fc2.weight @ (torch.nn.functional.silu(gate) * up)
            y = y + z * torch.sigmoid(s.gate_weight[0] @ xt)
        out.append(y)
    return torch.stack(out).reshape(x.shape)


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_moe_layer_equals_a_per_token_loop_over_experts(dispatcher):
    layer = _layer(
        swiglu=True, disable_bias_linear=True, moe_router_topk=2, moe_token_dispatcher_type=dispatcher,
        moe_shared_expert_intermediate_size=F, moe_shared_expert_gate=True,
    )  # fmt: skip
    x = torch.randn(4, 3, H, dtype=torch.float64, requires_grad=True)
    out, bias = layer(x)
    assert bias is None
    expected = _loop(layer, x, 2, shared=True)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    # gradients of input and every weight agree too
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *layer.parameters()], g)
    want = torch.autograd.grad(expected, [x, *layer.parameters()], g, allow_unused=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b if b is not None else torch.zeros_like(a), rtol=1e-10, atol=1e-12)


def test_gelu_experts_with_biases_and_an_expert_that_gets_no_token():
    layer = _layer(moe_router_topk=1, moe_router_pre_softmax=True)
    with torch.no_grad():
        layer.router.weight[3] = -100.0  # expert 3 never wins on x > 0
    x = torch.rand(2, 2, H, dtype=torch.float64) + 0.1
    out, _ = layer(x)
    out.sum().backward()
    assert layer.experts.linear_fc1.weight.grad[3].abs().sum() == 0  # no token, zero gradient
    ref = []
    for xt in x.reshape(-1, H):
        probs = torch.softmax(layer.router.weight @ xt, 0)
        e = int(probs.argmax())
        h = layer.experts.linear_fc1.weight[e] @ xt + layer.experts.linear_fc1.bias[e]
        y = (
            layer.experts.linear_fc2.weight[e] @ torch.nn.functional.gelu(h)
            + layer.experts.linear_fc2.bias[e]
        )
        ref.append(probs[e] * y)
    torch.testing.assert_close(
        out.detach(), torch.stack(ref).reshape(x.shape).detach(), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize("modules", [("moe",), ("moe_act",)])
def test_recompute_modules_moe_and_moe_act_give_the_same_gradients(modules):
    flags = dict(swiglu=True, disable_bias_linear=True, moe_aux_loss_coeff=(0.1,), moe_z_loss_coeff=0.01)
    plain = _layer(**flags)
    recomputed = _layer(**flags, recompute_granularity="selective", recompute_modules=modules)
    x = torch.randn(4, 2, H, dtype=torch.float64, requires_grad=True)  # as inside a model
    grads = []
    for layer in (plain, recomputed):
        layer(x)[0].square().sum().backward()
        grads.append([p.grad for p in layer.parameters()])
        assert layer.router.stats["tokens_per_expert"].sum() == 16  # counted once, also when recomputed
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_tiny_moe_gpt_trains_through_pretrain_and_logs_moe_values(tmp_path):
    from mcore.data.preprocess import main as preprocess_main
    from mcore.training.gpt import forward_step, model_provider
    from mcore.training.pretrain import pretrain

    jsonl = tmp_path / "d.jsonl"  # a tiny dataset (--mock-data builds a large sample index)
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
    log = tmp_path / "log.jsonl"
    argv = [
        "--device-backend", "cpu", "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "1e-2", "--train-iters", "3", "--num-workers", "0",
        "--eval-iters", "0", "--data-path", str(tmp_path / "d_text_document"), *null,
        "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1", "--log-json", str(log),
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "([0]*1+[1]*1)", "--swiglu",
        "--moe-ffn-hidden-size", "16", "--ffn-hidden-size", "32", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3",
        "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-per-layer-logging",
        "--moe-grouped-gemm", "--moe-permute-fusion", "--disable-bias-linear",
    ]  # fmt: skip
    result = pretrain(model_provider, forward_step, argv=argv)
    assert len(result.train_losses) == 3 and all(v == v for v in result.train_losses)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r for r in records if "load_balancing_loss" in r]
    assert len(steps) == 3
    last = steps[-1]
    assert last["load_balancing_loss"] > 0 and last["z_loss"] > 0
    assert last["tokens_per_expert max/mean"] >= 1.0
    assert last["load_balancing_loss layer 2"] == last["load_balancing_loss"]  # the one MoE layer
    assert "load_balancing_loss layer 1" not in last  # layer 1 is dense


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_experts_input_rows_are_saved_as_a_recipe_and_regathered_exactly(dispatcher):
    """One process: nothing autograd keeps lies in the experts' input rows ([T * topk, H]; the
    layer's input is kept, by the router); the gradients equal those of a layer that keeps them."""
    flags = dict(
        swiglu=True, disable_bias_linear=True, moe_router_topk=3, moe_token_dispatcher_type=dispatcher
    )
    kept, recipe = _layer(**flags), _layer(**flags)
    kept.dispatcher.rows_recipe = lambda: None  # the rows saved as they are
    x = torch.randn(4, 2, H, dtype=torch.float64, requires_grad=True)
    grads, in_rows = [], []
    for layer in (kept, recipe):
        rows_storage, saved = [], []
        dispatch = layer.dispatcher.dispatch

        def spy(*args, dispatch=dispatch, rows_storage=rows_storage, **kwargs):
            rows, counts, row_probs = dispatch(*args, **kwargs)
            rows_storage.append(rows.untyped_storage().data_ptr())
            return rows, counts, row_probs

        layer.dispatcher.dispatch = spy
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t, saved=saved: saved.append(t.untyped_storage().data_ptr()) or t, lambda t: t
        ):
            out = layer(x)[0]
        in_rows.append(sum(ptr == rows_storage[0] for ptr in saved))
        grads.append(torch.autograd.grad(out.square().sum(), [x, *layer.parameters()]))
    assert in_rows[0] > 0 and in_rows[1] == 0
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def _fp32_layer(**flags):
    cfg = ModelConfig(
        num_layers=1, hidden_size=H, num_attention_heads=2, seq_length=4, ffn_hidden_size=F,
        num_experts=E, moe_router_topk=2, moe_router_dtype="fp32", **flags,
    )  # fmt: skip
    torch.manual_seed(0)
    layer = MoELayer(cfg, BuildContext(params_dtype=torch.float32)).train()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return layer


def _dense_formula(layer, x, score_function: str, gated: bool):
    """``y_t = sum_e p_te (W2_e act(W1_e x_t + b1_e) + b2_e)`` over all experts at once (fp32), with
    ``p`` from the router weight (zero off each token's top-2)."""
    ex = layer.experts
    tokens = x.reshape(-1, H)
    logits = tokens @ layer.router.weight.t()
    if score_function == "softmax":
        top = logits.topk(2).indices
        weights = torch.softmax(logits.gather(1, top), -1)
    else:
        scores = torch.sigmoid(logits)
        top = scores.topk(2).indices
        weights = scores.gather(1, top)
        weights = weights / weights.sum(-1, keepdim=True)
    probs = torch.zeros_like(logits).scatter(1, top, weights)  # [T, E]
    h = torch.einsum("th,efh->tef", tokens, ex.linear_fc1.weight)
    if ex.linear_fc1.bias is not None:
        h = h + ex.linear_fc1.bias
    if gated:
        gate, up = h.chunk(2, dim=-1)
        a = torch.nn.functional.silu(gate) * up
    else:
        a = torch.nn.functional.gelu(h)
    out = torch.einsum("tef,ehf->teh", a, ex.linear_fc2.weight)  # every expert's output [T, E, H]
    if ex.linear_fc2.bias is not None:
        out = out + ex.linear_fc2.bias
    return (probs[:, :, None] * out).sum(1).reshape(x.shape)


@pytest.mark.parametrize("moe_act", [False, True], ids=["plain", "moe_act"])
@pytest.mark.parametrize(
    ("score_function", "gated"),
    [("softmax", True), ("sigmoid", False)],
    ids=["softmax_swiglu", "sigmoid_gelu_bias"],
)
def test_probs_applied_in_the_activation_equal_the_weighted_sum_of_expert_outputs(
    score_function, gated, moe_act
):
    """fp32: the layer (probs inside the experts' activation, an unweighted combine) gives the plain
    formula's output and input, router and expert gradients (GeLU experts with biases: fc2's bias is
    weighted too)."""
    flags = dict(moe_router_score_function=score_function)
    flags.update(dict(swiglu=True, disable_bias_linear=True) if gated else {})
    if moe_act:
        flags.update(recompute_granularity="selective", recompute_modules=("moe_act",))
    layer = _fp32_layer(**flags)
    x = torch.randn(4, 2, H, requires_grad=True)
    out = layer(x)[0]
    expected = _dense_formula(layer, x, score_function, gated)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(out)
    params = [x, layer.router.weight, *layer.experts.parameters()]
    assert len(params) == (4 if gated else 6)
    for a, b in zip(torch.autograd.grad(out, params, g), torch.autograd.grad(expected, params, g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_the_combine_keeps_no_rows_sized_tensor_for_backward(dispatcher):
    """The bytes autograd saves for one MoE layer (outside its parameters, each storage once) stay below
    what its shapes need without the experts' output rows: the input, fc1's output ``[N, 2F]`` and the
    weighted activation ``[N, F]``, the probs and indices, the router's ``[T, E]`` tensors. A weighted
    combine would keep the output rows ``[N, H]`` too (``N = T * topk``; ``H`` is wide here)."""
    hidden, ffn, topk, tokens = 64, 4, 2, 16
    cfg = ModelConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=2, seq_length=tokens, ffn_hidden_size=ffn,
        num_experts=E, moe_router_topk=topk, moe_router_dtype="fp32", swiglu=True, disable_bias_linear=True,
        moe_token_dispatcher_type=dispatcher,
    )  # fmt: skip
    layer = MoELayer(cfg, BuildContext(params_dtype=torch.float32)).train()
    x = torch.randn(tokens, 1, hidden, requires_grad=True)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)[0]
    n = tokens * topk
    bound = 4 * (tokens * hidden + n * (3 * ffn + 1) + 8 * tokens * E) + 8 * 4 * n
    saved = sum(storages.values())
    assert saved <= bound, (saved, bound)
    assert saved + 4 * n * hidden > bound  # the output rows would not fit
    out.sum().backward()


def test_rows_padded_to_capacity_carry_probability_zero_and_add_nothing():
    """``--moe-pad-expert-input-to-capacity`` with a capacity of every token (nothing dropped): each
    expert also computes the tokens not routed to it, with probability 0, so (GeLU experts, fc2's bias
    weighted too) the output and gradients are the dropless layer's."""
    dropless = _fp32_layer(moe_router_pre_softmax=True)
    padded = _fp32_layer(
        moe_router_pre_softmax=True,
        moe_expert_capacity_factor=float(E),
        moe_pad_expert_input_to_capacity=True,
    )
    x = torch.randn(4, 2, H, requires_grad=True)
    rows = []
    padded.experts.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
    outs, grads = [], []
    for layer in (dropless, padded):
        out = layer(x)[0]
        outs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), [x, *layer.parameters()]))
    assert rows == [8 * E]  # every expert got every token (those not routed to it padded in)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
