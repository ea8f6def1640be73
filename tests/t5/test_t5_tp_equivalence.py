"""T5 at TP=2 (with and without sequence parallelism, with recomputation) reproduces TP=1.

One 2-process launch covers both variants, Megatron's T5 (learned positions, LayerNorm, GeLU, biases,
tied output with its bias) and Hugging Face T5 v1.1 (relative position buckets, RMSNorm, gated GeLU,
no biases, untied output). Each rank builds the TP=1 model and the TP=2 model from the same seed and
checks that its initial weights are its slices of the TP=1 weights and that the per-token losses and
its gradient slices match TP=1 (fp32, relative 1e-5). The batch has encoder padding (encoder and
cross-attention masks) and a decoder padding mask, so every mask path is exercised. Generation at
TP=2 (greedy with its logits, beam search; cached decoding) gives the TP=1 tokens.
"""

from __future__ import annotations

import pytest
import torch

from mcore.config.parallel import ParallelConfig
from mcore.distributed.groups import ProcessGroups, initialize_parallel
from mcore.inference.generation import SamplingParams
from mcore.inference.t5_generation import T5TextGenerator
from mcore.models.t5.t5_model import T5Model
from mcore.models.transformer.model_config import ModelConfig, padded_vocab_size
from mcore.testing.distributed import run_distributed

SEED = 1234
VOCAB, DIVISIBLE_BY = 100, 32
S_ENC, S_DEC, BATCH = 8, 6, 2
BASE = dict(
    encoder_num_layers=2,
    decoder_num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    encoder_seq_length=S_ENC,
    decoder_seq_length=S_DEC,
    make_vocab_size_divisible_by=DIVISIBLE_BY,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
VARIANTS = {
    "megatron": dict(),
    "hf_v1_1": dict(
        position_embedding_type="relative",
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        normalization="RMSNorm",
        disable_bias_linear=True,
        geglu=True,
        openai_gelu=True,
        untie_embeddings_and_output_weights=True,
    ),
}
CASES = {
    "plain": (False, {}),
    "sp": (True, {}),
    "sp+full-uniform": (
        True,
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    ),
    "selective": (
        False,
        dict(recompute_granularity="selective", recompute_modules=("core_attn", "layernorm")),
    ),
}
TOL = 1e-5


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = expected.abs().max().item()
    diff = (actual - expected).abs().max().item()
    return diff / scale if scale > 0 else diff


def _batch():
    gen = torch.Generator().manual_seed(7)
    enc = torch.randint(0, VOCAB, (BATCH, S_ENC), generator=gen)
    dec = torch.randint(0, VOCAB, (BATCH, S_DEC), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, S_DEC), generator=gen)
    enc_pad = torch.arange(S_ENC)[None, :] >= torch.tensor([[S_ENC], [5]])  # row 1: 3 padding tokens
    dec_pad = torch.arange(S_DEC)[None, :] >= torch.tensor([[S_DEC], [4]])
    enc_mask = enc_pad[:, None, None, :].expand(BATCH, 1, S_ENC, S_ENC)
    dec_mask = dec_pad[:, None, None, :].expand(BATCH, 1, S_DEC, S_DEC)
    enc_dec_mask = enc_pad[:, None, None, :].expand(BATCH, 1, S_DEC, S_ENC)
    return enc, dec, enc_mask, dec_mask, enc_dec_mask, labels


def _model(variant: str, groups: ProcessGroups, sp: bool = False, extra: dict | None = None) -> T5Model:
    cfg = ModelConfig(**BASE, **VARIANTS[variant], **(extra or {}))
    vocab = padded_vocab_size(VOCAB, DIVISIBLE_BY, groups.tp_size)
    return T5Model(cfg, groups, vocab, sequence_parallel=sp, seed=SEED)


def _step(model: T5Model):
    enc, dec, enc_mask, dec_mask, enc_dec_mask, labels = _batch()
    loss = model(enc, dec, enc_mask, dec_mask, enc_dec_mask, lm_labels=labels)
    loss.mean().backward()
    model.all_reduce_sequence_parallel_grads()
    params = dict(model.named_parameters())
    return loss.detach(), {
        spec.name: params[local].grad for local, spec in model.sharded_parameters().items()
    }


def _cases():
    out = {}
    references = {}
    for variant in VARIANTS:
        ref = _model(variant, ProcessGroups.single())
        references[variant] = (ref, *_step(ref))
    groups = initialize_parallel(ParallelConfig(tensor_model_parallel_size=2))
    for variant in VARIANTS:
        ref, ref_loss, ref_grads = references[variant]
        ref_weights = {spec.name: p for spec, p in zip(ref.sharded_parameters().values(), ref.parameters())}
        for case, (sp, extra) in CASES.items():
            model = _model(variant, groups, sp, extra)
            params = dict(model.named_parameters())
            specs = model.sharded_parameters()
            same_init = all(torch.equal(params[k], s.shard(ref_weights[s.name])) for k, s in specs.items())
            loss, grads = _step(model)
            worst = max((_rel_err(grads[s.name], s.shard(ref_grads[s.name])), s.name) for s in specs.values())
            out[(variant, case)] = (
                same_init,
                _rel_err(loss, ref_loss),
                *worst,
                sorted(grads) == sorted(ref_grads),
            )
    return out, _generation(groups)


def _generation(groups: ProcessGroups) -> dict:
    """Greedy (with logits) and beam-search tokens at TP=1 and TP=2 (cached decoding)."""
    prompts = [[5, 9, 12, 7, 30, 2], [40, 3, 17]]
    out = {}
    for variant in VARIANTS:
        for tp_groups in (ProcessGroups.single(), groups):
            model = _model(variant, tp_groups).eval()
            generator = T5TextGenerator(model, tp_groups, VOCAB, eod=None)
            greedy = generator.generate(
                prompts, SamplingParams(max_new_tokens=6, greedy=True, return_logits=True)
            )
            beams = generator.generate(prompts, SamplingParams(max_new_tokens=6, num_beams=2)).tokens
            out[(variant, tp_groups.tp_size)] = (greedy.tokens, torch.tensor(greedy.logits), beams)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_cases, 2, timeout=300)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tp2_and_sequence_parallel_match_tp1(results, variant):
    failures = []
    for rank, (r, _) in enumerate(results):
        for (variant_, case), (same_init, loss_err, grad_err, grad_name, same_names) in r.items():
            if variant_ != variant:
                continue
            if not same_init:
                failures.append(f"rank {rank} {case}: initial weights are not the TP=1 slices")
            if not same_names:
                failures.append(f"rank {rank} {case}: parameter names differ from TP=1")
            if loss_err > TOL or grad_err > TOL:
                failures.append(f"rank {rank} {case}: loss {loss_err:.2e}, {grad_name} {grad_err:.2e}")
    assert not failures, "\n".join(failures)
    assert sum(1 for key in results[0][0] if key[0] == variant) == len(CASES)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tp2_generation_matches_tp1(results, variant):
    for _, generation in results:
        tokens1, logits1, beams1 = generation[(variant, 1)]
        tokens2, logits2, beams2 = generation[(variant, 2)]
        assert tokens2 == tokens1 and beams2 == beams1
        assert _rel_err(logits2, logits1) <= TOL
