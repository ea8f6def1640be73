"""BertModel in one process: megatron-core's BertModel as the reference, the padding mask, the
bidirectional attention, Megatron's -1 labels, ``--bert-no-binary-head`` and the settings it refuses.

The megatron-core comparison builds megatron-core 0.16.1's ``BertModel`` (local layer spec, tied
embeddings, two token types) on the CPU, perturbs every tensor, loads its ``state_dict`` into mcore's
BertModel with ``strict=True`` (the same names and shapes) and compares the MLM logits and per-token
losses at the real tokens and the binary logits (megatron-core's local mask also blanks the padding
*queries*, so padding positions are not compared).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from mcore.config.fields import ConfigError
from mcore.distributed.groups import ProcessGroups
from mcore.models.bert.bert_model import BertModel
from mcore.models.transformer.model_config import ModelConfig
from mcore.testing.distributed import run_distributed

SEQ, VOCAB = 16, 128
CONFIG = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=SEQ,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    padding_mask = torch.ones(2, SEQ, dtype=torch.long)
    padding_mask[1, 11:] = 0
    types = torch.zeros(2, SEQ, dtype=torch.long)
    types[:, 8:] = 1
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    return ids, padding_mask, types, labels


def _model(**overrides) -> BertModel:
    cfg = ModelConfig(**{**CONFIG, **overrides.pop("config", {})})
    return BertModel(cfg, ProcessGroups.single(), VOCAB, device=torch.device("cpu"), **overrides).eval()


def _megatron_core_comparison() -> dict:
    torch.cuda.current_device = lambda: "cpu"  # megatron-core's memory buffer asks for a CUDA device
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel as MegatronBertModel
    from megatron.core.transformer import dot_product_attention
    from megatron.core.transformer.transformer_config import TransformerConfig

    class _NoTracker:  # the attention forks the CUDA RNG tracker even at dropout 0
        def fork(self, name=None):
            return contextlib.nullcontext()

    dot_product_attention.get_cuda_rng_tracker = tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: (
        _NoTracker()
    )
    parallel_state.initialize_model_parallel(1, 1)
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    theirs = MegatronBertModel(
        config,
        num_tokentypes=2,
        transformer_layer_spec=bert_layer_local_spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        share_embeddings_and_output_weights=True,
    ).eval()
    with torch.no_grad():
        for param in theirs.parameters():
            param.add_(0.05 * torch.randn_like(param))
    ours = _model()
    ours.load_state_dict(
        {k: v for k, v in theirs.state_dict().items() if "_extra_state" not in k}, strict=True
    )
    ids, padding_mask, types, labels = _inputs()
    real = padding_mask.bool()
    with torch.no_grad():
        (their_logits, their_binary), (our_logits, our_binary) = (
            theirs(ids, padding_mask, types),
            ours(ids, padding_mask, types),
        )
        their_loss, _ = theirs(ids, padding_mask, types, lm_labels=labels)
        our_loss, _ = ours(ids, padding_mask, types, lm_labels=labels)
    parallel_state.destroy_model_parallel()
    return {
        "logits": (their_logits - our_logits)[real].abs().max().item(),
        "binary": (their_binary - our_binary).abs().max().item(),
        "loss": (their_loss - our_loss)[real].abs().max().item(),
        "names": sorted(name for name, _ in ours.named_parameters()),
    }


def test_megatron_core_bert_loads_strictly_and_gives_the_same_outputs():
    pytest.importorskip("megatron.core")
    result = run_distributed(_megatron_core_comparison, 1, timeout=120)[0]
    assert result["logits"] < 1e-5 and result["binary"] < 1e-5 and result["loss"] < 1e-5, result
    assert "lm_head.layer_norm.weight" in result["names"] and "output_layer.bias" in result["names"]


def test_padding_is_masked_and_attention_is_bidirectional():
    model = _model()
    ids, padding_mask, types, _ = _inputs()
    with torch.no_grad():
        logits, binary = model(ids, padding_mask, types)
        other_pads = ids.clone()
        other_pads[1, 11:] = (ids[1, 11:] + 1) % VOCAB  # different ids under the padding
        pad_logits, pad_binary = model(other_pads, padding_mask, types)
        later = ids.clone()
        later[0, -1] = (ids[0, -1] + 1) % VOCAB  # a later real token
        later_logits, _ = model(later, padding_mask, types)
    assert torch.equal(logits[:, :11], pad_logits[:, :11]) and torch.equal(binary, pad_binary)
    assert not torch.allclose(logits[0, 0], later_logits[0, 0])  # position 0 sees the last token


def test_negative_labels_have_no_loss_and_no_gradient():
    model = _model()
    ids, padding_mask, types, labels = _inputs()
    labels[:, ::2] = -1  # Megatron's BERT dataset: -1 where nothing is predicted
    predicted = labels >= 0
    loss, _ = model(ids, padding_mask, types, lm_labels=labels)
    loss.sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    logits, _ = model(ids, padding_mask, types)
    expected = F.cross_entropy(logits[predicted].float(), labels[predicted], reduction="none")
    expected.sum().backward()
    assert torch.equal(loss[~predicted], torch.zeros_like(loss[~predicted]))
    torch.testing.assert_close(loss[predicted], expected.detach(), rtol=1e-6, atol=1e-6)
    theirs = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == set(theirs) and "embedding.word_embeddings.weight" in grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, theirs[name], rtol=1e-5, atol=1e-7)


def test_no_binary_head_drops_the_pooler_the_head_and_the_token_types():
    model = _model(add_binary_head=False)
    names = {name for name, _ in model.named_parameters()}
    assert not any(n.startswith(("pooler.", "binary_head.", "embedding.tokentype")) for n in names)
    ids, padding_mask, types, labels = _inputs()
    loss, binary = model(ids, padding_mask, None, lm_labels=labels)
    assert binary is None and loss.shape == (2, SEQ)
    with pytest.raises(ValueError, match="--bert-no-binary-head"):
        model(ids, padding_mask, types)


def test_residual_after_the_norm_is_megatrons_flag():
    ids, padding_mask, types, _ = _inputs()
    with torch.no_grad():
        pre_ln, _ = _model()(ids, padding_mask, types)
        post, _ = _model(config=dict(apply_residual_connection_post_layernorm=True))(ids, padding_mask, types)
    assert not torch.allclose(pre_ln, post)


@pytest.mark.parametrize(
    "config, message",
    [
        (dict(position_embedding_type="alibi"), "--position-embedding-type alibi"),
        (dict(output_layer_loss_chunks=2), "--output-layer-loss-chunks 2"),
    ],
)
def test_unsupported_settings_are_refused(config, message):
    with pytest.raises(ConfigError, match=message):
        _model(config=config)


def test_layer_offset_names_and_tied_copy_on_a_last_stage():
    model = _model(pre_process=False, layer_offset=1, num_layers=1)
    specs = {spec.name: spec for spec in model.sharded_parameters().values()}
    assert (
        "encoder.layers.1.mlp.linear_fc1.weight" in specs
        and "encoder.layers.0.mlp.linear_fc1.weight" not in specs
    )
    tied = specs["embedding.word_embeddings.weight"]
    assert tied.tied_copy and tied.local_name == "output_layer.weight"
    assert specs["output_layer.bias"].vocab_padded
    assert model.shared_embedding_or_output_weight() is dict(model.named_parameters())["output_layer.weight"]
