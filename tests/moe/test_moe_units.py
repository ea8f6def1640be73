"""MoE router, losses, capacity and config on hand-computed small cases (one process, milliseconds)."""

import dataclasses
import math

import pytest
import torch

from mcore.config.fields import ConfigError
from mcore.models.transformer.build_context import BuildContext
from mcore.models.transformer.model_config import ModelConfig, validate_model_parallel
from mcore.models.transformer.moe import aux_losses
from mcore.models.transformer.moe.capacity import drop_tokens, expert_capacity
from mcore.models.transformer.moe.config import parse_layer_freq
from mcore.models.transformer.moe.groups import MoEGroups
from mcore.models.transformer.moe.router import TopKRouter

BASE = dict(num_layers=2, hidden_size=4, num_attention_heads=1, seq_length=4, ffn_hidden_size=8)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)  # (these cases were also checked to pass with seeds 0-5)


def _config(**moe):
    return ModelConfig(**BASE, **{"num_experts": 4, **moe})


def _router(weight=None, **moe):
    router = TopKRouter(_config(**moe).moe, MoEGroups(), 1, False, None)
    with torch.no_grad():
        router.weight.copy_(torch.zeros(4, 4) if weight is None else weight)
    return router.train()


def test_uniform_scores_give_aux_loss_equal_to_its_coefficient():
    # zero logits: scores 1/E, every token's top-2 is the same tie-broken pair: counts two 4s and two 0s,
    # sum_t P = [1,1,1,1] -> coeff * E/(k T^2) * (4+4) = coeff * 4/32 * 8 = coeff
    map_, scores = aux_losses.scores_for_aux_loss(torch.zeros(4, 4), 2, "softmax")
    assert sorted(map_.sum(0).tolist()) == [0, 0, 4, 4]
    loss = aux_losses.switch_load_balancing_loss(scores, map_.sum(0).float(), 4, 2, 4, 0.01)
    assert loss.item() == pytest.approx(0.01)


def test_skewed_top1_aux_loss_by_hand():
    # two tokens, logits (ln 3, 0): scores (0.75, 0.25), both to expert 0: counts (2, 0),
    # sum_t P = (1.5, 0.5): loss = c * 2 / (1 * 4) * (1.5 * 2) = 1.5 c
    logits = torch.tensor([[math.log(3.0), 0.0]] * 2)
    map_, scores = aux_losses.scores_for_aux_loss(logits, 1, "softmax")
    loss = aux_losses.switch_load_balancing_loss(scores, map_.sum(0).float(), 2, 1, 2, 1.0)
    assert loss.item() == pytest.approx(1.5)


def test_z_loss_of_zero_logits_is_log_e_squared():
    assert aux_losses.z_loss(torch.zeros(3, 4), 0.5).item() == pytest.approx(0.5 * math.log(4) ** 2)


def test_aux_loss_gradient_is_added_with_the_schedule_scale():
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    out = aux_losses.attach_loss(x * 2, (w**2).sum(), 0.25)
    out.sum().backward()
    assert torch.allclose(x.grad, torch.full((3,), 2.0))
    assert torch.allclose(w.grad, 0.25 * 2 * w.detach())


def test_router_records_megatron_loss_values_and_scales_their_gradient():
    router = _router(moe_aux_loss_coeff=(0.01,), moe_z_loss_coeff=1e-3)
    router.aux_loss_backward_scale = 0.5
    x = torch.randn(2, 2, 4)  # [s, b, H]
    probs, routing_map = router(x)
    assert probs.dtype == torch.float32 and routing_map.sum(1).tolist() == [2] * 4
    assert router.stats["load_balancing_loss"].item() == pytest.approx(1.0)  # zero weight: uniform
    assert router.stats["z_loss"].item() == pytest.approx(math.log(4) ** 2)
    assert sorted(router.stats["tokens_per_expert"].tolist()) == [0, 0, 4, 4]
    # the losses' gradient reaches the router weight scaled by 0.5: compare with an explicit sum
    probs.sum().backward()
    got = router.weight.grad.clone()
    w = router.weight.detach().clone().requires_grad_(True)
    logits = x.reshape(-1, 4) @ w.T
    m, s = aux_losses.scores_for_aux_loss(logits, 2, "softmax")
    lb = aux_losses.switch_load_balancing_loss(s, m.sum(0).float(), 4, 2, 4, 0.01)
    main = torch.softmax(logits.topk(2).values, -1).sum()
    (main + 0.5 * (lb + aux_losses.z_loss(logits, 1e-3))).backward()
    assert torch.allclose(got, w.grad, atol=1e-7)


def test_seq_aux_loss_is_the_mean_of_per_sequence_losses():
    router = _router(
        torch.randn(4, 4), moe_router_load_balancing_type=("seq_aux_loss",), moe_aux_loss_coeff=(1.0,)
    )
    x = torch.randn(3, 2, 4)  # s=3, b=2
    router(x)
    logits = x.reshape(-1, 4) @ router.weight.detach().T
    per_seq = []
    for b in range(2):
        m, s = aux_losses.scores_for_aux_loss(logits.reshape(3, 2, 4)[:, b], 2, "softmax")
        per_seq.append(aux_losses.switch_load_balancing_loss(s, m.sum(0).float(), 3, 2, 4, 1.0))
    assert router.stats["seq_load_balancing_loss"].item() == pytest.approx(sum(per_seq).item() / 2, rel=1e-6)


def test_expert_bias_chooses_experts_but_never_scales_them():
    w = torch.randn(4, 4)
    w[3] = -1.0  # on positive inputs expert 3 scores lowest: only the bias can choose it
    router = _router(w, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    x = torch.rand(5, 1, 4) + 0.1
    plain_probs, plain_map = router(x)
    assert not plain_map[:, 3].any()
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 100.0]))
    probs, routing_map = router(x)
    assert routing_map[:, 3].all()  # the bias makes expert 3 win everywhere
    scores = torch.sigmoid(x.reshape(-1, 4) @ w.T)
    chosen = scores * routing_map
    assert torch.allclose(probs, chosen / chosen.sum(1, keepdim=True), atol=1e-6)  # un-biased scores
    assert not torch.equal(probs, plain_probs)
    # two forwards counted 5 tokens x top-2 each; the update moves the bias toward the mean, once
    counts = router.local_tokens_per_expert.clone()
    assert counts.sum().item() == 20
    router.update_expert_bias()
    expected = torch.tensor([0.0, 0.0, 0.0, 100.0]) + 1e-3 * torch.sign(counts.mean() - counts)
    assert torch.allclose(router.expert_bias, expected) and router.local_tokens_per_expert.sum() == 0


def test_eval_and_no_grad_forwards_record_nothing():
    router = _router(
        moe_aux_loss_coeff=(0.01,), moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True
    )
    with torch.no_grad():
        router(torch.randn(2, 1, 4))
    router.eval()
    router(torch.randn(2, 1, 4))
    assert router.stats == {} and router.local_tokens_per_expert.sum() == 0


def test_capacity_drop_policies_and_padding():
    # 4 tokens, all on expert 0 (top-1), capacity ceil(4*1/2*1) = 2
    probs = torch.tensor([[0.6, 0.0], [0.9, 0.0], [0.7, 0.0], [0.8, 0.0]])
    routing_map = probs > 0
    assert expert_capacity(4, 2, 1, 1.0) == 2
    p, m = drop_tokens(probs, routing_map, 1, 1.0, "probs", pad=False)
    assert m[:, 0].nonzero().flatten().tolist() == [1, 3] and not m[:, 1].any()
    assert torch.equal(p, probs * m)
    _, m = drop_tokens(probs, routing_map, 1, 1.0, "position", pad=False)
    assert m[:, 0].nonzero().flatten().tolist() == [0, 1]
    p, m = drop_tokens(probs, routing_map, 1, 1.0, "probs", pad=True)
    assert m.sum(0).tolist() == [2, 2] and p[:, 1].eq(0).all()  # padded rows carry weight 0
    _, m = drop_tokens(probs, routing_map, 1, 4.0, "probs", pad=False)  # capacity 8 >= tokens: no drop
    assert torch.equal(m, routing_map)


def test_layer_freq_forms():
    assert parse_layer_freq(1, 3) == (True, True, True)
    assert parse_layer_freq(2, 4) == (True, False, True, False)
    assert parse_layer_freq("([0]*3+[1]*29)", 32) == (False,) * 3 + (True,) * 29
    assert parse_layer_freq("[1,0]", 2) == (True, False)
    assert parse_layer_freq(("0", "1", "1"), 3) == (False, True, True)  # --moe-layer-freq 0 1 1
    assert parse_layer_freq(("2",), 3) == (True, False, True)
    with pytest.raises(ConfigError, match="has 2 entries; num_layers=3"):
        parse_layer_freq("[1,0]", 3)
    with pytest.raises(ConfigError, match="--moe-layer-freq"):
        parse_layer_freq("__import__('os')", 3)


@pytest.mark.parametrize(
    "moe,message",
    [
        (dict(moe_router_topk=5), "moe_router_topk=5 exceeds num_experts=4"),
        (
            dict(moe_router_num_groups=3, moe_router_group_topk=1),
            "num_experts=4 is not divisible by moe_router_num_groups=3",
        ),
        (dict(moe_router_num_groups=2), "needs both --moe-router-num-groups and --moe-router-group-topk"),
        (
            dict(moe_router_load_balancing_type=("aux_loss", "z"), moe_aux_loss_coeff=(1.0, 2.0)),
            "'z' is unknown",
        ),
        (
            dict(
                moe_router_load_balancing_type=("aux_loss", "seq_aux_loss"),
                moe_aux_loss_coeff=(1.0, 2.0, 3.0),
            ),
            "one per type",
        ),
        (dict(moe_router_enable_expert_bias=True), "needs --moe-router-score-function sigmoid"),
        (dict(moe_pad_expert_input_to_capacity=True), "needs --moe-expert-capacity-factor"),
        (dict(moe_router_topk=1), "needs --moe-router-pre-softmax"),
    ],
)
def test_bad_moe_flags_are_named(moe, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _config(**moe)


def test_layout_checks_name_expert_parallel_values():
    from mcore.config.parallel import ParallelConfig

    with pytest.raises(ConfigError, match="num_experts=6 is not divisible by expert_model_parallel_size=4"):
        validate_model_parallel(_config(num_experts=6), ParallelConfig(expert_model_parallel_size=4))
    with pytest.raises(
        ConfigError, match="moe_ffn_hidden_size=8 is not divisible by expert_tensor_parallel_size=3"
    ):
        validate_model_parallel(_config(), ParallelConfig(expert_tensor_parallel_size=3))
    with pytest.raises(ConfigError, match="needs --sequence-parallel"):
        validate_model_parallel(
            ModelConfig(**{**BASE, "num_attention_heads": 2}, num_experts=4),
            ParallelConfig(tensor_model_parallel_size=2),
        )
    with pytest.raises(ConfigError, match="--recompute-modules moe needs an MoE model"):
        ModelConfig(**BASE, recompute_granularity="selective", recompute_modules=("moe",))


def test_moe_flags_on_bert_are_refused_by_name():
    from mcore.training.bert import model_provider
    from mcore.training.run_config import RunConfig

    cfg = RunConfig({"model": _config()})
    with pytest.raises(ConfigError, match=r"num_experts=4 \(--num-experts\).*BERT has none"):
        model_provider(cfg, None, 64)
    assert BuildContext().groups is None


def test_megatron_moe_flags_parse_and_kernel_flags_are_listed(caplog):
    import logging

    from mcore.training.run_config import parse_run_config

    argv = [
        "--num-layers", "4", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "4",
        "--num-experts", "8", "--moe-router-topk", "2", "--moe-layer-freq", "([0]*1+[1]*3)",
        "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-2", "1e-3",
        "--moe-token-dispatcher-type", "flex", "--moe-permute-fusion", "--moe-grouped-gemm",
        "--expert-model-parallel-size", "2",
    ]  # fmt: skip
    with caplog.at_level(logging.INFO):
        cfg = parse_run_config(argv)
    moe = cfg.model.moe
    assert moe.moe_layers == (False, True, True, True) and moe.dispatcher == "alltoall"
    assert moe.aux_losses == (("aux_loss", 0.01), ("seq_aux_loss", 0.001))
    assert cfg.parallel.expert_model_parallel_size == 2
    from mcore.hf.megatron_flags import megatron_model_flags

    flags = megatron_model_flags(dataclasses.replace(cfg.model, moe_layer_freq=(0, 1, 1, 1)))
    assert flags[flags.index("--moe-layer-freq") :][:5] == ["--moe-layer-freq", "0", "1", "1", "1"]
    again = parse_run_config(flags)  # the flags an import prints build the same MoE model
    assert again.model.moe.moe_layers == moe.moe_layers and again.model.moe.aux_losses == moe.aux_losses
    note = " ".join(r.getMessage() for r in caplog.records)
    assert "--moe-permute-fusion (" in note and "--moe-token-dispatcher-type flex (" in note


def test_schedule_gives_the_routers_loss_scale_over_microbatches():
    from mcore.distributed.groups import ProcessGroups
    from mcore.pipeline.schedules import forward_backward_no_pipelining

    router = _router(moe_aux_loss_coeff=(0.01,))
    model = torch.nn.Sequential(router)
    batches = iter([torch.randn(2, 1, 4) for _ in range(2)])

    def step(data_iterator, chunk):
        probs, _ = chunk(next(data_iterator))
        return probs, lambda out: (out.sum(), {})

    forward_backward_no_pipelining(
        forward_step_func=step, data_iterator=batches, model=model, num_microbatches=2, seq_length=2,
        micro_batch_size=1, hidden_size=4, groups=ProcessGroups.single(), grad_scale_func=lambda loss: loss * 8.0,
    )  # fmt: skip
    assert float(router.aux_loss_backward_scale) == 4.0  # loss scale 8 / 2 micro-batches (x CP 1)


def test_flops_count_the_active_experts():
    from mcore.training.flops import gpt_flops_per_sample

    dense = ModelConfig(**{**BASE, "ffn_hidden_size": 2 * 8 + 5})  # topk 2 x moe FFN 8 + shared 5
    moe = _config(moe_ffn_hidden_size=8, moe_shared_expert_intermediate_size=5)
    assert gpt_flops_per_sample(moe, 64) == pytest.approx(gpt_flops_per_sample(dense, 64))
    half = _config(moe_ffn_hidden_size=8, moe_layer_freq=2)  # layer 1 MoE (16), layer 2 dense (8)
    mixed = ModelConfig(**{**BASE, "ffn_hidden_size": 12})
    assert gpt_flops_per_sample(half, 64) == pytest.approx(gpt_flops_per_sample(mixed, 64))


def test_input_jitter_only_while_training_and_replayed_by_recompute():
    router = _router(torch.randn(4, 4), moe_input_jitter_eps=0.5, moe_router_pre_softmax=True)
    x = torch.randn(6, 1, 4)
    torch.manual_seed(1)
    a, _ = router(x)
    torch.manual_seed(1)
    b, _ = router(x)
    c, _ = router(x)
    assert torch.equal(a, b) and not torch.equal(b, c)  # the noise follows the RNG
    router.eval()
    assert torch.equal(router(x)[0], router(x)[0])  # no noise in evaluation


def test_router_passes_megatron_routing_options_to_the_op():
    x = torch.randn(8, 1, 4)
    w = torch.randn(4, 4)
    logits = x.reshape(-1, 4) @ w.T
    # pre-softmax: softmax over all experts, then top-k, not renormalised; scaled by the factor
    probs, routing_map = _router(w, moe_router_pre_softmax=True, moe_router_topk_scaling_factor=2.5)(x)
    full = torch.softmax(logits, -1)
    assert torch.allclose(probs, 2.5 * full * routing_map, atol=1e-6)
    assert torch.equal(routing_map, torch.zeros_like(routing_map).scatter(1, full.topk(2).indices, True))
    # group-limited: 2 groups of 2 experts, tokens choose inside the best group only
    _, routing_map = _router(w, moe_router_num_groups=2, moe_router_group_topk=1)(x)
    assert (routing_map[:, :2].all(1) ^ routing_map[:, 2:].all(1)).all()


def test_global_aux_loss_uses_the_running_counts_of_the_step():
    router = _router(
        torch.randn(4, 4), moe_router_load_balancing_type=("global_aux_loss",), moe_aux_loss_coeff=(1.0,)
    )
    xs = [torch.randn(4, 1, 4) for _ in range(2)]
    for x in xs:
        router(x)
    counts = []
    for x in xs:
        m, _ = aux_losses.scores_for_aux_loss(x.reshape(-1, 4) @ router.weight.detach().T, 2, "softmax")
        counts.append(m.sum(0).float())
    _, s = aux_losses.scores_for_aux_loss(xs[1].reshape(-1, 4) @ router.weight.detach().T, 2, "softmax")
    first = aux_losses.switch_load_balancing_loss(
        aux_losses.scores_for_aux_loss(xs[0].reshape(-1, 4) @ router.weight.detach().T, 2, "softmax")[1],
        counts[0], 4, 2, 4, 1.0,
    )  # fmt: skip
    second = aux_losses.switch_load_balancing_loss(s, (counts[0] + counts[1]) / 2, 4, 2, 4, 1.0)
    assert router.stats["global_load_balancing_loss"].item() == pytest.approx(
        (first + second).item(), rel=1e-6
    )
    router.reset_step_state()
    assert router.ga_steps == 0 and router.global_tokens_per_expert.sum() == 0
    assert router.stats.keys() == {"global_load_balancing_loss", "tokens_per_expert"}  # kept, zeroed in place
    assert all(torch.count_nonzero(t) == 0 for t in router.stats.values())


def test_router_state_stays_fp32_in_a_bf16_model():
    from mcore.models.transformer.moe.moe_layer import MoELayer

    cfg = _config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, swiglu=True)
    layer = MoELayer(cfg, BuildContext(params_dtype=torch.bfloat16))
    assert layer.router.weight.dtype == torch.float32 and layer.router.expert_bias.dtype == torch.float32
    assert layer.experts.linear_fc1.weight.dtype == torch.bfloat16
    assert "router.expert_bias" in layer.state_dict()  # persistent, under Megatron's name


def test_training_moe_at_tp_without_sequence_parallel_is_refused_by_the_layer():
    """The model builds at TP > 1 without SP (generation runs it so, exactly); training is refused in
    the layer's forward, naming the flag (each TP rank's copy of a token would add to the experts'
    gradients)."""
    from mcore.models.transformer.moe.moe_layer import MoELayer

    layer = MoELayer(_config(), BuildContext(tp_size=2, device=torch.device("cpu")), groups=MoEGroups())
    x = torch.randn(4, 1, 4)
    with torch.no_grad():
        assert layer(x)[0].shape == x.shape  # inference: no TP collective in a one-process MoE group
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2 trains only with --sequence-parallel"):
        layer.train()(x)
