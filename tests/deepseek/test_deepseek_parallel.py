"""DeepSeek parts over real processes (one 2-rank gloo launch): multi-latent attention at TP=2, with
and without sequence parallelism and with ``mla_up_proj`` recompute, gives the single-process loss
and gradients (its initial weights are the TP=1 slices), and so does a DeepSeek-V3-style model (MLA,
first layer dense, sigmoid group-limited router with scaling and expert bias, a shared expert,
seq_aux_loss, MTP) at TP=2 x EP=2 with SP; multi-token prediction at PP=2 (MTP on the
last stage, with its copy of the word embedding, tied and untied) gives the PP=1 losses, gradients
and logged ``mtp_k loss``. The same launch trains the family through ``pretrain`` at TP=2 x EP=2 with SP
and saves it: it resumes bit-exactly at that layout (losses, every weight and the expert bias equal to
the uninterrupted run) and loads at PP=2, at EP=2 x DP=2 and in one process (``--use-checkpoint-args``)
with the same next losses."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

from mcore.config.parallel import ParallelConfig
from mcore.distributed.finalize import finalize_model_grads
from mcore.distributed.groups import ProcessGroups, initialize_parallel
from mcore.models.gpt.gpt_model import GPTModel
from mcore.models.transformer.model_config import ModelConfig, padded_vocab_size
from mcore.models.transformer.mtp.block import mtp_step_logs
from mcore.pipeline import get_forward_backward_func
from mcore.pipeline.layout import build_model_chunks
from mcore.testing.distributed import run_distributed

sys.path.insert(0, str(Path(__file__).parent))
from ds_runs import run_case, run_cases  # noqa: E402

VOCAB, SEQ, BATCH, SEED = 64, 8, 2, 1234
MLA = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=SEQ,
    ffn_hidden_size=48,
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    disable_bias_linear=True,
    untie_embeddings_and_output_weights=True,
    make_vocab_size_divisible_by=32,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    multi_latent_attention=True,
    qk_layernorm=True,
    q_lora_rank=16,
    kv_lora_rank=12,
    qk_head_dim=8,
    qk_pos_emb_head_dim=4,
    v_head_dim=6,
    rotary_scaling_factor=4.0,
    original_max_position_embeddings=4,
    mscale_all_dim=0.8,
)
CASES = {
    "mla": {},
    "mla-no-q-lora": dict(q_lora_rank=None),
    "mla-up-proj-recompute": dict(
        recompute_granularity="selective", recompute_modules=("mla_up_proj", "core_attn")
    ),
}
FAMILY = dict(  # DeepSeek-V3-style: first layer dense, sigmoid router, 2 groups / 1 chosen, scaling,
    num_experts=4,  # expert bias, one shared expert, seq_aux_loss, MTP
    moe_ffn_hidden_size=16,
    moe_router_topk=2,
    moe_router_score_function="sigmoid",
    moe_router_num_groups=2,
    moe_router_group_topk=1,
    moe_router_topk_scaling_factor=2.5,
    moe_router_enable_expert_bias=True,
    moe_router_load_balancing_type=("seq_aux_loss",),
    moe_aux_loss_coeff=(1e-2,),
    moe_shared_expert_intermediate_size=16,
    moe_layer_freq="[0,1]",
    moe_token_dispatcher_type="alltoall",
    mtp_num_layers=1,
)
TOL = 1e-5


def _rel_err(actual, expected) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return (actual - expected).abs().max().item() / max(expected.abs().max().item(), 1e-30)


def _batch():
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), torch.randint(
        0, VOCAB, (BATCH, SEQ), generator=gen
    )


def _model(case, groups, sp=False):
    cfg = ModelConfig(**{**MLA, **(FAMILY if case == "family" else CASES[case])})
    vocab = padded_vocab_size(VOCAB, 32, groups.tp_size)
    return GPTModel(cfg, groups, vocab, sequence_parallel=sp, seed=SEED)


def _step(model):
    tokens, labels = _batch()
    loss = model(tokens, labels=labels)
    loss.mean().backward()
    model.all_reduce_sequence_parallel_grads()
    params = dict(model.named_parameters())
    return loss.detach(), {spec.name: params[n].grad for n, spec in model.sharded_parameters().items()}


def _tp_cases(groups: ProcessGroups, references, sps=(False, True)) -> dict:
    out = {}
    for case, (ref_model, ref_loss, ref_grads) in references.items():
        ref_weights = {
            s.name: p for s, p in zip(ref_model.sharded_parameters().values(), ref_model.parameters())
        }
        for sp in sps:
            model = _model(case, groups, sp)
            params = dict(model.named_parameters())
            specs = model.sharded_parameters()
            same_init = all(torch.equal(params[n], s.shard(ref_weights[s.name])) for n, s in specs.items())
            loss, grads = _step(model)
            worst = max((_rel_err(grads[s.name], s.shard(ref_grads[s.name])), s.name) for s in specs.values())
            out[(case, sp)] = (same_init, _rel_err(loss, ref_loss), *worst)
    return out


def _all_cases(ckpt_cases):
    references = {}
    for case in CASES:
        model = _model(case, ProcessGroups.single())
        references[case] = (model, *_step(model))
    groups = initialize_parallel(ParallelConfig(tensor_model_parallel_size=2))
    out = {"tp": _tp_cases(groups, references)}
    family_ref = _model("family", ProcessGroups.single())
    family_ref = (family_ref, *_step(family_ref))
    ep = ParallelConfig(
        tensor_model_parallel_size=2,
        expert_model_parallel_size=2,
        expert_tensor_parallel_size=1,
        sequence_parallel=True,
    )
    out["tp"].update(_tp_cases(initialize_parallel(ep), {"family": family_ref}, sps=(True,)))
    out["pp"] = {}
    pp = ParallelConfig(pipeline_model_parallel_size=2)
    pp_groups = initialize_parallel(pp)
    for tied in (False, True):
        ref = _mtp_step(ProcessGroups.single(), ParallelConfig(), tied)
        out["pp"][tied] = (pp_groups.is_last_stage, _mtp_step(pp_groups, pp, tied), ref)
    out["ckpt"] = run_cases(ckpt_cases)
    return out


MTP = dict(
    num_layers=2,
    hidden_size=16,
    num_attention_heads=2,
    seq_length=SEQ,
    ffn_hidden_size=24,
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    disable_bias_linear=True,
    make_vocab_size_divisible_by=32,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    mtp_num_layers=2,
    mtp_loss_scaling_factor=0.3,
)
MICRO = 2


def _mtp_forward_step(data_iterator, model):
    tokens, labels, mask = next(data_iterator)
    output = model(tokens, labels=labels, loss_mask=mask)

    def loss_func(per_token):
        loss = (per_token * mask).sum() / mask.sum()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def _mtp_step(groups, parallel, tied):
    config = ModelConfig(**MTP, untie_embeddings_and_output_weights=not tied)
    provider = functools.partial(GPTModel, config, groups, VOCAB + 0, seed=SEED)
    chunks = build_model_chunks(provider, groups, parallel, config.num_layers)
    gen = torch.Generator().manual_seed(11)
    batches = [(*_batch(), (torch.rand(BATCH, SEQ, generator=gen) > 0.25).float()) for _ in range(MICRO)]
    logs = get_forward_backward_func(groups.pp_size, len(chunks))(
        forward_step_func=_mtp_forward_step,
        data_iterator=[iter(batches) for _ in chunks],
        model=chunks,
        num_microbatches=MICRO,
        seq_length=SEQ,
        micro_batch_size=BATCH,
        hidden_size=config.hidden_size,
        groups=groups,
        finalize_grads_func=lambda model_chunks: finalize_model_grads(model_chunks, groups),
        timeout_s=60,
    )
    mtp_logs = {k: float(v) for k, v in mtp_step_logs(chunks, groups, MICRO, 2, torch.device("cpu")).items()}
    grads = {}
    for chunk in chunks:
        params = dict(chunk.named_parameters())
        for local, spec in chunk.sharded_parameters().items():
            grads[(spec.name, local)] = params[local].grad
    return [float(log["lm loss"]) for log in logs], mtp_logs, grads


# the family through ``pretrain``: 4 iterations at TP=2 x EP=2 with SP, saved at 2 and 4; then from 2
TP2_EP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2"]
TP2_EP2 += ["--expert-tensor-parallel-size", "1"]
ITERS4 = ["--train-iters", "4", "--save-interval", "2"]


def _ckpt_cases(tmp: Path) -> list[tuple[str, list[str]]]:
    load = ["--load", str(tmp / "straight"), "--ckpt-step", "2", "--train-iters", "4"]
    return [
        ("straight", [*ITERS4, *TP2_EP2, "--save", str(tmp / "straight")]),
        ("resume", [*load, *TP2_EP2, "--save", str(tmp / "resumed"), "--save-interval", "2"]),
        ("load-pp2", [*load, "--pipeline-model-parallel-size", "2"]),
        ("load-ep2-dp2", [*load, "--expert-model-parallel-size", "2"]),
    ]


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("deepseek-ckpt")


@pytest.fixture(scope="module")
def results(ckpt_dir):
    return run_distributed(_all_cases, 2, _ckpt_cases(ckpt_dir), timeout=600)


def test_family_resumes_bit_exactly_and_reshards(results, ckpt_dir):
    from mcore.checkpoint.logical import load_logical_model_state

    runs = results[-1]["ckpt"]  # the last rank logs (the last pipeline stage)
    straight = runs["straight"]["losses"]
    assert len(straight) == 4 and runs["straight"]["iteration"] == runs["resume"]["iteration"] == 4
    assert runs["resume"]["losses"] == straight[2:]  # bit for bit
    # one process, its model flags from the checkpoint (--use-checkpoint-args: MLA, YaRN, the router's lists)
    one = run_case(
        [
            "--load",
            str(ckpt_dir / "straight"),
            "--ckpt-step",
            "2",
            "--train-iters",
            "4",
            "--use-checkpoint-args",
        ]
    )
    for name, losses in [("load-pp2", runs["load-pp2"]["losses"]), ("load-ep2-dp2", runs["load-ep2-dp2"]["losses"]),
                         ("one process", one["losses"])]:  # fmt: skip
        assert losses == pytest.approx(straight[2:], rel=2e-5, abs=0), name
    want, _ = load_logical_model_state(ckpt_dir / "straight", 4)
    got, _ = load_logical_model_state(ckpt_dir / "resumed", 4)
    assert set(got) == set(want)
    bias = "decoder.layers.1.mlp.router.expert_bias"
    assert bias in want and want[bias].abs().sum() > 0 and any(n.startswith("mtp.") for n in want)
    assert [n for n in want if not torch.equal(got[n], want[n])] == []


def test_mla_tp2_equals_tp1(results):
    failures = []
    for rank, r in enumerate(results):
        for (case, sp), (same_init, loss_err, grad_err, name) in r["tp"].items():
            if not same_init or loss_err > TOL or grad_err > TOL:
                failures.append(
                    f"rank {rank} {case} sp={sp}: init {same_init}, loss {loss_err:.1e}, {name} {grad_err:.1e}"
                )
    assert not failures, "\n".join(failures)
    assert len(results[0]["tp"]) == 2 * len(CASES) + 1  # + the family at TP2 x EP2 with SP


@pytest.mark.parametrize("tied", [False, True])
def test_mtp_pp2_equals_pp1(results, tied):
    seen = set()
    for is_last, (losses, mtp_logs, grads), (ref_losses, ref_mtp_logs, ref_grads) in (
        r["pp"][tied] for r in results
    ):
        reference = {name: g for (name, _), g in ref_grads.items()}
        if is_last:
            assert losses == pytest.approx(ref_losses, rel=1e-6)
            assert set(mtp_logs) == {"mtp_1 loss", "mtp_2 loss"}
            assert mtp_logs == pytest.approx(ref_mtp_logs, rel=1e-6)
        else:
            assert losses == [] and mtp_logs == {}
        for (name, local), grad in grads.items():
            seen.add(name)
            torch.testing.assert_close(grad, reference[name], rtol=1e-5, atol=1e-7, msg=f"{name} ({local})")
    assert seen == set(reference)
    assert any(name.startswith("mtp.layers.1.") for name in seen)
