"""Dispatchers on 4 real gloo processes (one launch, several layouts): dispatch -> combine returns the
input exactly (all-gather and all-to-all, EP=2, EP=4 and ETP=2 x EP=2), also when a
rank or an expert receives no token; the MoE layer at EP>1 with either dispatcher equals the EP=1
layer computed in the same process on the same tokens (outputs, input/router/expert gradients)."""

import torch
import torch.distributed as dist

from mcore.models.transformer.build_context import BuildContext
from mcore.models.transformer.model_config import ModelConfig
from mcore.models.transformer.moe.dispatcher import AllGatherDispatcher, AllToAllDispatcher
from mcore.models.transformer.moe.groups import MoEGroups
from mcore.models.transformer.moe.moe_layer import MoELayer
from mcore.testing.distributed import run_distributed

E, H, F, T, K = 8, 8, 4, 6, 2


def _layouts():
    """(name, MoEGroups of this rank, ep, etp) for each layout; every rank creates every group."""
    rank = dist.get_rank()

    def pick(groups_ranks):
        handles = [dist.new_group(r) for r in groups_ranks]
        return next(h for h, r in zip(handles, groups_ranks) if rank in r)

    world = pick([[0, 1, 2, 3]])
    ep2 = pick([[0, 1], [2, 3]])
    etp2 = pick([[0, 1], [2, 3]])  # ETP fastest: (etp, ep) grid over 4 ranks
    ep2_strided = pick([[0, 2], [1, 3]])
    return [
        ("ep4", MoEGroups(ep=world, tp_ep=world), 4, 1),
        ("ep2", MoEGroups(ep=ep2, tp_ep=ep2), 2, 1),
        ("etp2xep2", MoEGroups(ep=ep2_strided, tp_ep=world, etp=etp2), 2, 2),
    ]


def _roundtrip(dispatcher, groups, etp: int, x, routing_map) -> tuple[bool, bool]:
    """Identity experts weighting their rows by the dispatched probs 1/K: combine(dispatch(x)) == x, its
    gradient is the upstream one, and each prob's gradient is ``<g_t, x_t>`` (sent back with it)."""
    x = x.clone().requires_grad_(True)
    probs = (routing_map.double() / K).requires_grad_(True)
    rows, counts, row_probs = dispatcher.dispatch(x, probs, routing_map)
    assert int(counts.sum()) == rows.shape[0] == row_probs.shape[0]
    out = dispatcher.combine(rows * row_probs[:, None] / etp)  # each ETP rank holds a partial sum
    g = torch.randn_like(out)
    out.backward(g)
    d_probs = (g * x).sum(-1, keepdim=True).detach() * routing_map
    ok_probs = torch.allclose(probs.grad, d_probs, rtol=1e-12, atol=1e-12)
    return torch.equal(out, x) and ok_probs, torch.equal(x.grad, g)


def _tokens(rank: int, starve_rank1: bool):
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=gen, dtype=torch.float64)
    scores = torch.rand(T, E, generator=gen)
    if starve_rank1:
        scores[:, E // 2 :] = -1.0  # at EP=2 ep-rank 1 holds experts 4..7: it receives no token
        scores[:, 0] = -1.0  # and expert 0 none either
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter(1, scores.topk(K).indices, True)
    return x, routing_map


def _layer(groups, dispatcher: str, etp_rank: int, etp: int, ep_rank: int, ep: int):
    cfg = ModelConfig(
        num_layers=1, hidden_size=H, num_attention_heads=2, seq_length=T, ffn_hidden_size=F, swiglu=True,
        disable_bias_linear=False, num_experts=E, moe_router_topk=K, moe_router_dtype="fp64",
        moe_token_dispatcher_type=dispatcher,
    )  # fmt: skip
    layer = MoELayer(cfg, BuildContext(params_dtype=torch.float64), groups=groups).double()
    torch.manual_seed(0)  # the same global weights everywhere; this rank keeps its slice
    router = torch.randn(E, H, dtype=torch.float64)
    fc1 = torch.randn(E, 2, F, H, dtype=torch.float64)  # [gate; up] halves, each split over ETP
    fc2 = torch.randn(E, H, F, dtype=torch.float64)
    fc1_bias, fc2_bias = torch.randn(E, 2, F, dtype=torch.float64), torch.randn(E, H, dtype=torch.float64)
    experts = slice(ep_rank * E // ep, (ep_rank + 1) * E // ep)
    cols = slice(etp_rank * F // etp, (etp_rank + 1) * F // etp)
    with torch.no_grad():
        layer.router.weight.copy_(router)
        layer.experts.linear_fc1.weight.copy_(fc1[experts, :, cols].reshape(E // ep, -1, H))
        layer.experts.linear_fc2.weight.copy_(fc2[experts, :, cols])
        layer.experts.linear_fc1.bias.copy_(fc1_bias[experts, :, cols].reshape(E // ep, -1))
        layer.experts.linear_fc2.bias.copy_(fc2_bias[experts])  # whole on every ETP rank
    return layer


def _grads(layer, x):
    x = x.clone().requires_grad_(True)
    out, _ = layer(x.reshape(T, 1, H))
    out.square().sum().backward()
    experts = layer.experts
    return (
        out.detach(),
        x.grad,
        layer.router.weight.grad,
        experts.linear_fc1.weight.grad,
        experts.linear_fc2.weight.grad,
        experts.linear_fc1.bias.grad,
        experts.linear_fc2.bias.grad,
    )


def _cases():
    torch.set_num_threads(1)
    rank = dist.get_rank()
    out = {}
    for name, groups, ep, etp in _layouts():
        kinds = [AllGatherDispatcher, AllToAllDispatcher]
        for starve in (False, True):
            x, routing_map = _tokens(rank, starve)  # every rank its own tokens (ETP ranks: sequence shards)
            for kind in kinds:
                out[f"roundtrip {name} {kind.__name__} starve={starve}"] = _roundtrip(
                    kind(E, groups), groups, etp, x, routing_map
                )
        # the layer at this layout vs EP=1 on the same tokens
        x, _ = _tokens(rank, False)
        ep_rank, etp_rank = groups.ep_rank, groups.etp_rank
        ref = _grads(_layer(MoEGroups(), "allgather", 0, 1, 0, 1), x)
        # expert gradients sum over the ranks that send tokens to this rank's experts (tp_ep); slice
        fc1_ref = ref[3].clone().reshape(E, 2, F, H)
        fc2_ref = ref[4].clone()
        fc1_bias_ref, fc2_bias_ref = ref[5].clone().reshape(E, 2, F), ref[6].clone()
        for t in (fc1_ref, fc2_ref, fc1_bias_ref, fc2_bias_ref):
            dist.all_reduce(t, group=groups.tp_ep)
        experts = slice(ep_rank * E // ep, (ep_rank + 1) * E // ep)
        cols = slice(etp_rank * F // etp, (etp_rank + 1) * F // etp)
        want = (
            *ref[:3],
            fc1_ref[experts, :, cols].reshape(E // ep, -1, H),
            fc2_ref[experts, :, cols],
            fc1_bias_ref[experts, :, cols].reshape(E // ep, -1),
            fc2_bias_ref[experts],  # fc2's bias counted once in the output, its gradient on every ETP rank
        )
        for dispatcher in ["allgather", "alltoall"]:
            got = _grads(_layer(groups, dispatcher, etp_rank, etp, ep_rank, ep), x)
            out[f"layer {name} {dispatcher}"] = [
                torch.allclose(a, b, rtol=1e-10, atol=1e-12) for a, b in zip(got, want)
            ]
    return out


def test_dispatch_combine_and_layer_equivalence_on_four_processes():
    results = run_distributed(_cases, 4, timeout=300)
    for rank, result in enumerate(results):
        assert len(result) == 18, result
        for case, value in result.items():
            assert all(value), (rank, case, [int(v) for v in value])
