"""Model FLOPs per iteration (Megatron's formula) and model FLOP utilization.

For a GPT with ``L`` layers, hidden ``h``, sequence ``s``, batch ``B`` (a global batch), vocabulary
``V``, the classic formula (forward + backward = 3x forward, no recompute counted) is::

    72 * B * s * L * h^2 * (1 + s / (6h) + V / (12 L h))

It assumes an MLP of 4h and full multi-head attention. :func:`gpt_flops` generalizes it the way
Megatron's ``num_floating_point_operations`` does: query groups shrink the K/V projections, SwiGLU
has three MLP matrices, and ``ffn_hidden_size`` may differ from 4h. With those at their defaults
it equals the formula above exactly.
"""

from __future__ import annotations


def gpt_flops(
    *,
    batch_size: int,
    seq_length: int,
    num_layers: int,
    hidden_size: int,
    vocab_size: int,
    num_attention_heads: int,
    num_query_groups: int | None = None,
    ffn_hidden_size: int | None = None,
    swiglu: bool = False,
    kv_channels: int | None = None,
) -> float:
    """Training FLOPs of one iteration over ``batch_size`` sequences (forward and backward)."""
    h, s, L = hidden_size, seq_length, num_layers
    ffn = ffn_hidden_size or 4 * h
    groups = num_query_groups or num_attention_heads
    kv = kv_channels or h // num_attention_heads
    query_proj = num_attention_heads * kv / h
    kv_proj = 2 * groups * kv / h
    gated = 3 / 2 if swiglu else 1.0
    # Per token and layer, in units of 6*h^2 FLOPs (one h x h matmul: 2*h^2 forward, 4*h^2 backward):
    # Q, K/V and output projections; QK^T and probs x V (s*h each); MLP up (and gate) and down.
    per_layer = (
        (query_proj + kv_proj + query_proj)  # QKV and output projections
        + 2 * s * query_proj / h  # QK^T and attention x V
        + 2 * gated * ffn / h  # MLP up (and gate) and down
    )
    return 6 * batch_size * s * h * h * (L * per_layer + vocab_size / h)


def layerwise_flops_per_sample(model, vocab_size: int) -> float:
    """Training FLOPs of one sample counted layer by layer, for what :func:`gpt_flops` does not hold
    (Megatron's ``num_floating_point_operations`` terms): multi-latent attention (down/up projections,
    scores over ``qk_head_dim + qk_pos_emb_head_dim``, values over ``v_head_dim``), MoE layers with
    their *active* experts (``topk`` routed experts, the shared expert; the router left out, as Megatron), dense layers where
    ``--moe-layer-freq`` puts them, and ``--mtp-num-layers`` depths (``eh_proj``, a layer like the
    last, the output layer). ``6 * s * (multiply-adds per token)``; equals :func:`gpt_flops` for a model
    without them."""
    h, s, n = model.hidden_size, model.seq_length, model.num_attention_heads
    gated = 3 if model.swiglu else 2
    if model.multi_latent_attention:
        dq, dv, c = model.qk_head_dim + model.qk_pos_emb_head_dim, model.v_head_dim, model.kv_lora_rank
        q = h * n * dq if model.q_lora_rank is None else h * model.q_lora_rank + model.q_lora_rank * n * dq
        kv = h * (c + model.qk_pos_emb_head_dim) + c * n * (model.qk_head_dim + dv)
        attention = q + kv + n * dv * h + s * n * (dq + dv)
    else:
        d, g = model.kv_channels, model.num_query_groups
        attention = 2 * n * d * h + 2 * g * d * h + 2 * s * n * d
    moe = model.moe
    dense_mlp = gated * h * model.ffn_hidden_size
    moe_mlp = 0
    if moe is not None:
        moe_mlp = (
            gated * h * (moe.topk * moe.ffn_hidden_size + (model.moe_shared_expert_intermediate_size or 0))
        )
    layers = [attention + (moe_mlp if moe is not None and sparse else dense_mlp) for sparse in
              (moe.moe_layers if moe is not None else [False] * model.num_layers)]  # fmt: skip
    per_token = sum(layers) + h * vocab_size
    if model.mtp_num_layers:
        per_token += model.mtp_num_layers * (layers[-1] + 2 * h * h + h * vocab_size)
    return 6.0 * s * per_token


def gpt_flops_per_sample(model, vocab_size: int) -> float:
    """:func:`gpt_flops` of one sample (``seq_length`` tokens) for a model config
    (:class:`mcore.models.transformer.model_config.ModelConfig`) and padded vocabulary; MLA and MTP
    models are counted by :func:`layerwise_flops_per_sample`.

    MoE (Megatron's formula, active parameters): an MoE layer's MLP counts ``topk`` experts of
    ``moe_ffn_hidden_size`` plus the shared experts' size; the MLP term being linear in the FFN size,
    the layers' mean FFN size gives the exact sum (the router's ``h x E`` GEMM is left out, as Megatron's)."""
    if model.multi_latent_attention or model.mtp_num_layers:
        return layerwise_flops_per_sample(model, vocab_size)
    ffn = model.ffn_hidden_size
    moe = getattr(model, "moe", None)
    if moe is not None:
        active = moe.ffn_hidden_size * moe.topk + (moe.moe_shared_expert_intermediate_size or 0)
        n_moe = sum(moe.moe_layers)
        ffn = ((model.num_layers - n_moe) * ffn + n_moe * active) / model.num_layers
    return gpt_flops(
        batch_size=1,
        seq_length=model.seq_length,
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        vocab_size=vocab_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups if model.group_query_attention else None,
        ffn_hidden_size=ffn,
        swiglu=model.swiglu,
        kv_channels=model.kv_channels,
    )


def bert_flops_per_sample(model, vocab_size: int) -> float:
    """Training FLOPs of one BERT sample: :func:`gpt_flops_per_sample` (its attention term already
    counts the full, bidirectional ``s x s`` scores) plus the LM head's dense ``h x h`` transform on
    every token (``6 s h^2``) and, with the binary head, the pooler's ``h x h`` dense and the ``h x 2``
    classifier on the first token of each sample (``6 h^2 + 12 h``). Megatron counts BERT with its GPT
    formula; these extra terms are what a BERT computes beyond it."""
    h, s = model.hidden_size, model.seq_length
    binary_head = getattr(model, "bert_binary_head", True)
    extra = 6 * s * h * h + ((6 * h * h + 12 * h) if binary_head else 0)
    return gpt_flops_per_sample(model, vocab_size) + extra


def t5_flops_per_sample(model, vocab_size: int) -> float:
    """Training FLOPs of one T5 sample (``encoder_seq_length`` input and ``decoder_seq_length`` output
    tokens), every matrix product counted forward and backward: ``6 m k n`` for an ``[m, k] x [k, n]``.

    With ``a = heads * kv_channels`` (the attention width), ``F`` the MLP width (two input matrices when
    gated, ``--geglu``/``--swiglu``), ``s_e``/``s_d`` the encoder/decoder lengths:

    * each encoder layer: QKV ``(s_e, h, 3a)``, scores and probs x V ``2 (s_e, a, s_e)``, output
      ``(s_e, a, h)``, MLP ``(s_e, h, F)`` (x2 gated) and ``(s_e, F, h)``;
    * each decoder layer: the same self-attention and MLP over ``s_d``, and cross-attention: Q
      ``(s_d, h, a)`` on the decoder stream, K/V ``(s_e, h, 2a)`` on the encoder output, scores and
      probs x V ``2 (s_d, a, s_e)``, output ``(s_d, a, h)``;
    * the output layer ``(s_d, h, V)``.

    Megatron reports T5 with its GPT formula; this counts what the encoder-decoder computes.
    """
    h = model.hidden_size
    width = model.num_attention_heads * (model.kv_channels or h // model.num_attention_heads)
    ffn = model.ffn_hidden_size or 4 * h
    mlp_inputs = 2 if (model.swiglu or getattr(model, "geglu", False)) else 1
    s_e, s_d = model.encoder_seq_length, model.decoder_seq_length

    def mm(m: int, k: int, n: int) -> float:
        return 6.0 * m * k * n

    def self_attention_and_mlp(s: int) -> float:
        attention = mm(s, h, 3 * width) + 2 * mm(s, width, s) + mm(s, width, h)
        return attention + mlp_inputs * mm(s, h, ffn) + mm(s, ffn, h)

    cross = mm(s_d, h, width) + mm(s_e, h, 2 * width) + 2 * mm(s_d, width, s_e) + mm(s_d, width, h)
    encoder = model.encoder_num_layers * self_attention_and_mlp(s_e)
    decoder = model.decoder_num_layers * (self_attention_and_mlp(s_d) + cross)
    return encoder + decoder + mm(s_d, h, vocab_size)
