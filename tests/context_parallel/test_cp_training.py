"""Context parallelism equals the same computation without it: the attention alone, then training.

Attention: the p2p ring, a2a and allgather outputs and gradients equal the unsplit causal attention
(GQA and MQA in fp32, MHA in bf16; CP=2 and CP=4). Training, through the real ``pretrain`` loop: one
launch of 4 gloo processes trains a row of tiny runs (synthetic data, dropout off, SGD without
clipping so that a wrong gradient scale shows in the weights). Each CP run is compared, rank by rank,
with the run of the same tensor/pipeline layout where the CP ranks are data-parallel ranks instead
(rank order tp-cp-dp-pp puts the TP and PP coordinates on the same ranks in both): the losses of every
iteration and this rank's parameters after the last one agree within fp32 round-off. The DP runs
themselves equal one process (tests/training, tests/ddp). Covered: the classic GPT (learned
positions, LayerNorm, GELU) and a Llama-style model (RoPE, RMSNorm, SwiGLU, GQA, untied); every
--cp-comm-type; CP=4 and CP=2 x DP=2; TP=2 with sequence parallelism; PP=2 interleaved; the
distributed optimizer; full recompute; a micro-batch whose tokens on CP rank 0 are all masked (sample
0 of the data, and the loss function on its own); a run saved at CP=2 that resumes bit-exactly at
CP=2 and loads at CP=1, for training and for generation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore.backend import get_ops
from mcore.models.transformer.context_parallel import context_parallel_attention, slice_for_cp
from mcore.testing.distributed import run_distributed
from mcore.training import gpt
from mcore.training.pretrain import pretrain

_BASE = [
    "--device-backend", "cpu", "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
    "--global-batch-size", "4", "--train-iters", "3", "--optimizer", "sgd", "--lr", "0.5",
    "--clip-grad", "0", "--weight-decay", "0", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "63", "--num-workers", "0", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--eval-iters", "0", "--log-interval", "1000", "--seed", "5", "--no-log-memory",
]  # fmt: skip
GPT = ["--position-embedding-type", "learned_absolute"]
LLAMA = [
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--group-query-attention",
    "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--ffn-hidden-size", "32",
]  # fmt: skip
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP2 = [
    "--pipeline-model-parallel-size",
    "2",
    "--num-layers",
    "4",
    "--num-layers-per-virtual-pipeline-stage",
    "1",
]
DISTOPT = ["--use-distributed-optimizer"]
MOE = [
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
    "--moe-aux-loss-coeff", "0.01", "--moe-token-dispatcher-type", "alltoall",
    "--expert-model-parallel-size", "2",
]  # fmt: skip
RECOMPUTE = [
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
    "--recompute-num-layers",
    "1",
]


def _cp(size: int, comm: str) -> list[str]:
    return ["--context-parallel-size", str(size), "--cp-comm-type", comm]


FOUR = ["--train-iters", "4"]
# (name, the run without CP, the CP run): both on 4 ranks. The attention's own test
# (_attention_cases below) covers every comm type with MHA/GQA/MQA at CP=2 and 4.
CASES = [
    ("gpt cp4 p2p", GPT, GPT + _cp(4, "p2p")),
    ("gpt cp2xdp2 allgather", GPT, GPT + _cp(2, "allgather")),
    (
        "llama cp4 a2a distopt recompute",
        LLAMA + DISTOPT + FOUR,
        LLAMA + DISTOPT + FOUR + RECOMPUTE + _cp(4, "a2a"),
    ),
    ("llama cp2xdp2 p2p distopt", LLAMA + DISTOPT + FOUR, LLAMA + DISTOPT + FOUR + _cp(2, "p2p")),
    ("llama tp2 sp cp2 p2p", LLAMA + TP2, LLAMA + TP2 + _cp(2, "p2p")),
    ("gpt pp2 interleaved cp2 p2p", GPT + PP2, GPT + PP2 + _cp(2, "p2p")),
    # MoE under CP: each CP rank routes its own tokens, the aux loss's counts are summed over CP and
    # its gradient scaled by cp (Megatron's), experts over EP=2 carved out of dp x cp
    ("moe llama ep2 cp2xdp2 p2p", LLAMA + MOE, LLAMA + MOE + _cp(2, "p2p")),
]


class _Samples(torch.utils.data.Dataset):
    """Random tokens (seeded by index) with a loss mask that drops a quarter of them; in sample 0
    only positions 4..11 count, so CP rank 0 (chunks 0 and 2cp-1) has every token masked."""

    def __init__(self, count: int, seq: int = 16, vocab: int = 63):
        self.count, self.seq, self.vocab = count, seq, vocab

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(idx)
        text = torch.randint(0, self.vocab, (self.seq + 1,), generator=gen)
        loss_mask = (torch.rand(self.seq, generator=gen) > 0.25).float()
        if idx == 0:
            loss_mask = torch.zeros(self.seq)
            loss_mask[4:12] = 1.0
        return {"tokens": text[:-1], "labels": text[1:], "loss_mask": loss_mask,
                "position_ids": torch.arange(self.seq)}  # fmt: skip


def _datasets(cfg, tokenizer, num_samples):
    return tuple(_Samples(max(n, 1)) if n else None for n in num_samples)


def _run(argv: list[str]) -> tuple[list[float], list[torch.Tensor]]:
    """Train; return the losses (as every rank logs them) and this rank's parameters afterwards."""
    chunks = []

    def provider(*args, **kwargs):
        chunk = gpt.model_provider(*args, **kwargs)
        chunks.append(chunk)
        return chunk

    result = pretrain(provider, gpt.forward_step, _datasets, argv=argv)
    params = [p.detach().float().clone() for chunk in chunks for p in chunk.parameters()]
    return result.train_losses, params


def _compare(name: str, ref, got, tol: float = 2e-5) -> None:
    (ref_losses, ref_params), (losses, params) = ref, got
    if dist.get_rank() == dist.get_world_size() - 1:  # the rank that logs
        assert len(losses) == len(ref_losses) > 0, (name, losses, ref_losses)
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=tol, atol=tol, msg=name
        )
    assert len(params) == len(ref_params) > 0, name
    for i, (a, b) in enumerate(zip(params, ref_params)):
        err = (a - b).abs().max().item()
        assert err <= tol, f"{name}: parameter {i} differs by {err}"


SEQ, BATCH, HEADS, DIM = 16, 2, 4, 8
COMM_TYPES = ("p2p", "a2a", "allgather")


def _reference(q, k, v, dout, scale):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = get_ops().attention(*(x.permute(1, 2, 0, 3) for x in (q, k, v)), causal=True, scale=scale)
    out = out.permute(2, 0, 1, 3)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _attention_cases(cp_sizes=(2, 4)) -> int:
    """Context-parallel attention alone equals the unsplit causal attention (outputs, dq, dk, dv) for
    every comm type, MHA/GQA/MQA, CP=2 (ranks {0,1} and {2,3} at once) and CP=4."""
    rank, world = dist.get_rank(), dist.get_world_size()
    scale = DIM**-0.5
    checked = 0
    for cp in cp_sizes:
        mine = None
        for start in range(0, world, cp):  # every rank creates every group, in order
            group = dist.new_group(list(range(start, start + cp)))
            if start <= rank < start + cp:
                mine = group
        cp_rank = rank % cp
        for groups_kv in (2, 1):  # GQA, MQA (MHA: the bf16 case below, and the GPT runs)
            gen = torch.Generator().manual_seed(100 * cp + groups_kv)
            q = torch.randn(SEQ, BATCH, HEADS, DIM, generator=gen)
            k, v = (torch.randn(SEQ, BATCH, groups_kv, DIM, generator=gen) for _ in range(2))
            dout = torch.randn(SEQ, BATCH, HEADS, DIM, generator=gen)
            ref = _reference(q, k, v, dout, scale)
            for comm in COMM_TYPES:
                local = [slice_for_cp(x, 0, cp_rank, cp).clone().requires_grad_() for x in (q, k, v)]
                out = context_parallel_attention(*local, mine, comm, causal=True, scale=scale)
                out.backward(slice_for_cp(dout, 0, cp_rank, cp))
                got = (out.detach(), *(x.grad for x in local))
                for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
                    expected = slice_for_cp(b, 0, cp_rank, cp)
                    err = (a - expected).abs().max().item()
                    assert err < 1e-5, f"cp={cp} {comm} kv_heads={groups_kv} {name}: max error {err}"
                checked += 1
        checked += _bf16_case(cp, mine, cp_rank, scale)
    return checked


def _bf16_case(cp: int, group, cp_rank: int, scale: float) -> int:
    """bf16 inputs (fp32 softmax and merge inside): every comm type within bf16 round-off of the
    unsplit attention."""
    gen = torch.Generator().manual_seed(7 + cp)
    q, k, v, dout = (torch.randn(SEQ, BATCH, HEADS, DIM, generator=gen).bfloat16() for _ in range(4))
    ref = _reference(q, k, v, dout, scale)
    for comm in COMM_TYPES:
        local = [slice_for_cp(x, 0, cp_rank, cp).clone().requires_grad_() for x in (q, k, v)]
        out = context_parallel_attention(*local, group, comm, causal=True, scale=scale)
        out.backward(slice_for_cp(dout, 0, cp_rank, cp))
        for name, a, b in zip(("out", "dq", "dk", "dv"), (out.detach(), *(x.grad for x in local)), ref):
            assert a.dtype == torch.bfloat16, (comm, name, a.dtype)
            err = (a.float() - slice_for_cp(b, 0, cp_rank, cp).float()).abs().max().item()
            assert err < 3e-2, f"bf16 cp={cp} {comm} {name}: max error {err}"
    return 1


def _masked_rank_loss() -> None:
    """The CP loss with every token of CP rank 0 masked: the global mean of the others, no NaN;
    every token masked everywhere: 0."""
    from mcore.training.cp_batch import masked_token_mean

    rank, world = dist.get_rank(), dist.get_world_size()
    losses = torch.arange(4, dtype=torch.float32).reshape(1, 4) + 4 * rank  # global tokens 0..15
    mask = torch.full((1, 4), float(rank != 0))
    loss, report = masked_token_mean(losses.requires_grad_(), mask, dist.group.WORLD, world)
    expected = torch.arange(4, 16, dtype=torch.float32).mean()
    assert torch.isclose(report, expected), (report, expected)
    loss.backward()
    assert torch.isfinite(losses.grad).all() and (losses.grad == (0.0 if rank == 0 else world / 12)).all()
    loss, report = masked_token_mean(losses.detach(), torch.zeros(1, 4), dist.group.WORLD, world)
    assert loss.item() == 0.0 and report.item() == 0.0


def _all_cases(tmp: str) -> int:
    assert _attention_cases() == 2 * (2 * len(COMM_TYPES) + 1)
    _masked_rank_loss()
    runs: dict[tuple[str, ...], tuple] = {}  # a baseline serves several cases
    for name, plain, with_cp in CASES:
        for argv in (plain, with_cp):
            if tuple(argv) not in runs:
                runs[tuple(argv)] = _run(_BASE + argv)
        _compare(name, runs[tuple(plain)], runs[tuple(with_cp)])
    # Checkpoints: saved at CP=2 after 2 of 4 iterations; resumed at CP=2 it continues the 4-iteration
    # CP=2 run bit-exactly; loaded at CP=1 (DP=4) it continues it within round-off.
    run_cp2 = LLAMA + DISTOPT + _cp(2, "p2p")
    straight = runs[tuple(LLAMA + DISTOPT + FOUR + _cp(2, "p2p"))]
    _run(
        _BASE
        + run_cp2
        + ["--train-iters", "2", "--lr-decay-iters", "4", "--save", tmp, "--save-interval", "2"]
    )
    resumed = _run(_BASE + run_cp2 + FOUR + ["--load", tmp])
    at_cp1 = _run(_BASE + LLAMA + DISTOPT + FOUR + ["--load", tmp])
    if dist.get_rank() == dist.get_world_size() - 1:
        assert resumed[0] == straight[0][2:], (resumed[0], straight[0])
    assert all(torch.equal(a, b) for a, b in zip(resumed[1], straight[1]))
    _compare("loaded at cp1", (straight[0][2:], straight[1]), at_cp1)
    _generate_from(tmp)
    return len(CASES)


def _generate_from(tmp: str) -> None:
    """The CP=2 checkpoint loads for generation at CP=1 (4 data-parallel ranks) and generates."""
    from mcore.config.parallel import ParallelConfig
    from mcore.distributed.groups import initialize_parallel
    from mcore.inference.generate import load_generator
    from mcore.inference.generation import SamplingParams

    generator, _ = load_generator(tmp, initialize_parallel(ParallelConfig(device_backend="cpu")))
    out = generator.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=3, greedy=True))
    assert len(out.tokens[0]) == 3 and all(0 <= t < 64 for t in out.tokens[0]), out.tokens


def test_context_parallel_training_equals_training_without_it(tmp_path):
    assert run_distributed(_all_cases, 4, str(tmp_path), timeout=900) == [len(CASES)] * 4
