"""T5 generation: the cached decoder (self-attention cache, cross-attention keys/values computed once)
gives the uncached full recompute's logits and tokens; beam search with one beam is greedy; a batch
gives each prompt's own result."""

from __future__ import annotations

import pytest
import torch

from mcore.distributed.groups import ProcessGroups
from mcore.inference.generation import SamplingParams
from mcore.inference.kv_cache import EncoderDecoderCache
from mcore.inference.t5_generation import T5TextGenerator
from mcore.models.t5.t5_model import T5Model
from mcore.models.transformer.model_config import ModelConfig

VOCAB = 64
BASE = dict(
    encoder_num_layers=2,
    decoder_num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    encoder_seq_length=16,
    decoder_seq_length=16,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    init_method_std=0.2,  # larger weights: peaked logits, varied greedy tokens
)
VARIANTS = {
    "megatron": {},
    "hf_v1_1": dict(
        position_embedding_type="relative",
        relative_attention_num_buckets=8,
        relative_attention_max_distance=8,
        normalization="RMSNorm",
        disable_bias_linear=True,
        geglu=True,
        openai_gelu=True,
        untie_embeddings_and_output_weights=True,
    ),
}
PROMPTS = [[5, 9, 12, 7, 30, 2], [40, 3, 17]]


def _generator(variant: str) -> T5TextGenerator:
    model = T5Model(ModelConfig(**BASE, **VARIANTS[variant]), ProcessGroups.single(), VOCAB, seed=11)
    return T5TextGenerator(model, ProcessGroups.single(), VOCAB, eod=None, decoder_start_token_id=0)


@pytest.fixture(scope="module", params=list(VARIANTS))
def generator(request):
    return _generator(request.param)


def test_cached_decoding_equals_full_recompute(generator):
    greedy = dict(max_new_tokens=10, greedy=True, return_logits=True)
    cached = generator.generate(PROMPTS, SamplingParams(**greedy))
    full = generator.generate(PROMPTS, SamplingParams(**greedy, use_cache=False))
    assert cached.tokens == full.tokens
    assert all(len(t) == 10 for t in cached.tokens)
    assert cached.tokens[0] != cached.tokens[1]
    torch.testing.assert_close(torch.tensor(cached.logits), torch.tensor(full.logits), rtol=1e-5, atol=1e-5)
    sample = dict(max_new_tokens=10, temperature=0.8, top_k=20, top_p=0.9, seed=3)
    sampled = generator.generate(PROMPTS, SamplingParams(**sample))
    assert sampled.tokens == generator.generate(PROMPTS, SamplingParams(**sample, use_cache=False)).tokens
    assert sampled.tokens != generator.generate(PROMPTS, SamplingParams(**{**sample, "seed": 4})).tokens


def test_a_batch_gives_each_prompt_its_own_tokens(generator):
    params = SamplingParams(max_new_tokens=8, greedy=True)
    batch = generator.generate(PROMPTS, params).tokens
    assert batch == [generator.generate([p], params).tokens[0] for p in PROMPTS]


def test_beam_search(generator):
    greedy = generator.generate(PROMPTS, SamplingParams(max_new_tokens=8, greedy=True))
    # generate() sends num_beams=1 to greedy/sampling; the beam-search path itself with one beam:
    beam1 = generator._beam_search(PROMPTS, SamplingParams(max_new_tokens=8, num_beams=1))
    assert beam1.tokens == greedy.tokens
    beams = SamplingParams(max_new_tokens=8, num_beams=3)
    cached = generator.generate(PROMPTS, beams)
    full = generator.generate(PROMPTS, SamplingParams(max_new_tokens=8, num_beams=3, use_cache=False))
    assert cached.tokens == full.tokens and cached.scores == pytest.approx(full.scores, rel=1e-6)


def test_cross_attention_keys_are_computed_once():
    generator = _generator("hf_v1_1")
    calls = []
    original = EncoderDecoderCache.cross_kv

    def counting(self, layer_number, compute):
        def counted():
            calls.append(layer_number)
            return compute()

        return original(self, layer_number, counted)

    EncoderDecoderCache.cross_kv = counting
    try:
        generator.generate(PROMPTS, SamplingParams(max_new_tokens=6, greedy=True))
    finally:
        EncoderDecoderCache.cross_kv = original
    assert sorted(calls) == [1, 2]  # once per decoder layer for six steps
