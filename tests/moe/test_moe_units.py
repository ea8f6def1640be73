"""MoE router, losses, capacity and config on hand-computed small cases (one process, milliseconds)."""

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
    router = _router(w, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    x = torch.randn(5, 1, 4)
    plain_probs, _ = router(x)
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
