"""Generation in one process: KV cache vs none, left padding, beam search, sampling, stops, limits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mcore.distributed.groups import ProcessGroups
from mcore.inference import KVCache, SamplingParams, TextGenerator, build_model_chunk

sys.path.insert(0, str(Path(__file__).parent))  # gen_models, here and in the spawned ranks (importlib mode)
from gen_models import CONFIGS, EOD, PROMPTS, VOCAB, model_config  # noqa: E402


@pytest.fixture(scope="module", params=list(CONFIGS))
def generator(request) -> TextGenerator:
    model = build_model_chunk(
        model_config(request.param), ProcessGroups.single(), VOCAB, device=torch.device("cpu")
    )
    return TextGenerator(model, ProcessGroups.single(), VOCAB, eod=EOD)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=kw.pop("max_new_tokens", 16), greedy=True, **kw)


SAMPLED = dict(max_new_tokens=16, temperature=0.8, top_k=20, top_p=0.9, seed=11)


@torch.no_grad()
def test_cached_forward_equals_full_forward(generator):
    """Feeding one token at a time through the cache gives the full forward's logits."""
    model = generator.model
    tokens = torch.tensor([PROMPTS[2] + [20, 21, 22]])
    full = model(tokens, torch.arange(tokens.shape[1])[None])
    cache = KVCache()
    steps = [model(tokens[:, :4], torch.arange(4)[None], inference_context=cache)]
    for i in range(4, tokens.shape[1]):
        steps.append(model(tokens[:, i : i + 1], torch.tensor([[i]]), inference_context=cache))
    assert cache.length == tokens.shape[1]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "params",
    [greedy(), SamplingParams(**SAMPLED), SamplingParams(max_new_tokens=10, num_beams=3)],
    ids=["greedy", "sampled", "beam"],
)
def test_kv_cache_generation_equals_no_cache(generator, params):
    from dataclasses import replace

    with_cache = generator.generate(PROMPTS, params)
    without = generator.generate(PROMPTS, replace(params, use_cache=False))
    assert with_cache.tokens == without.tokens
    assert with_cache.finish_reasons == without.finish_reasons


def test_left_padded_batch_equals_each_prompt_alone(generator):
    batch = generator.generate(PROMPTS, greedy())
    alone = [generator.generate([p], greedy()).tokens[0] for p in PROMPTS]
    assert batch.tokens == alone
    beams = generator.generate(PROMPTS, SamplingParams(max_new_tokens=8, num_beams=3))
    assert beams.tokens == [
        generator.generate([p], SamplingParams(max_new_tokens=8, num_beams=3)).tokens[0] for p in PROMPTS
    ]


def test_beam_search_with_one_beam_is_greedy(generator):
    expected = generator.generate(PROMPTS, greedy(max_new_tokens=20))
    one_beam = generator._beam_search(PROMPTS, SamplingParams(max_new_tokens=20, num_beams=1))
    assert one_beam.tokens == expected.tokens
    assert one_beam.finish_reasons == expected.finish_reasons


@torch.no_grad()
def test_beam_search_scores_and_length_penalty(generator):
    out = generator.generate(PROMPTS, SamplingParams(max_new_tokens=12, num_beams=4))
    assert len(out.scores) == len(PROMPTS) and all(s <= 0 for s in out.scores)
    # The returned hypothesis's score is its summed log-probability over its length (penalty 1).
    model = generator.model
    for prompt, tokens, score in zip(PROMPTS, out.tokens, out.scores):
        seq = torch.tensor([prompt + tokens])
        logp = torch.log_softmax(model(seq)[0, :, :VOCAB].double(), -1)
        total = sum(float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens))
        assert score == pytest.approx(total / len(tokens), abs=1e-4)


def test_sampling_is_deterministic_with_a_seed(generator):
    first = generator.generate(PROMPTS, SamplingParams(**SAMPLED))
    assert generator.generate(PROMPTS, SamplingParams(**SAMPLED)).tokens == first.tokens
    other = generator.generate(
        PROMPTS, SamplingParams(**{**SAMPLED, "seed": 12, "temperature": 2.0, "top_k": 0, "top_p": 1.0})
    )
    assert other.tokens != first.tokens
    base = generator.generate(PROMPTS, greedy())
    assert generator.generate(PROMPTS, SamplingParams(max_new_tokens=16, top_k=1)).tokens == base.tokens
    assert (
        generator.generate(PROMPTS, SamplingParams(max_new_tokens=16, top_p=1e-6, seed=3)).tokens
        == base.tokens
    )


@torch.no_grad()
def test_top_k_samples_only_among_the_k_best(generator):
    out = generator.generate(
        [PROMPTS[0]] * 8, SamplingParams(max_new_tokens=1, top_k=3, temperature=5.0, seed=5)
    )
    logits = generator.model(torch.tensor([PROMPTS[0]]))[0, -1, :VOCAB]
    allowed = set(torch.topk(logits, 3).indices.tolist())
    assert {t[0] for t in out.tokens} <= allowed


def test_stop_tokens_end_a_sequence(generator):
    base = generator.generate(PROMPTS[:1], greedy(max_new_tokens=10)).tokens[0]
    stop = base[3]
    out = generator.generate(PROMPTS[:1], greedy(max_new_tokens=10, stop_token_ids=(stop,)))
    assert out.tokens[0] == base[: base.index(stop) + 1]
    assert out.finish_reasons == ["stop"]
    assert generator.generate(PROMPTS[:1], greedy(max_new_tokens=5)).finish_reasons == ["length"]


def test_eod_stops_unless_disabled():
    """A model whose output always prefers EOD stops after one token (unless stop_at_eod=False)."""
    cfg = model_config("gpt2")
    model = build_model_chunk(cfg, ProcessGroups.single(), VOCAB, device=torch.device("cpu"))
    with torch.no_grad():
        model.decoder.final_layernorm.weight.zero_()
        model.decoder.final_layernorm.bias.copy_(model.embedding.word_embeddings.weight[EOD])
    gen = TextGenerator(model, ProcessGroups.single(), VOCAB, eod=EOD)
    assert gen.generate(PROMPTS, greedy()).tokens == [[EOD]] * 3
    assert gen.generate(PROMPTS, greedy(max_new_tokens=3, stop_at_eod=False)).tokens == [[EOD] * 3] * 3


def test_learned_positions_limit_the_length():
    model = build_model_chunk(model_config("gpt2"), ProcessGroups.single(), VOCAB, device=torch.device("cpu"))
    gen = TextGenerator(model, ProcessGroups.single(), VOCAB)
    out = gen.generate([list(range(1, 61))], greedy(max_new_tokens=20, stop_at_eod=False))
    assert len(out.tokens[0]) == 4 and out.finish_reasons == ["length"]
    with pytest.raises(ValueError, match="max_position_embeddings=64"):
        gen.generate([list(range(70))], greedy())


def test_bad_prompts_and_params(generator):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generator.generate([[1], []], greedy())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generator.generate([[1, VOCAB]], greedy())
    with pytest.raises(ValueError, match="no prompts"):
        generator.generate([], greedy())
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
