"""Memory per rank of the scaling table's layouts, computed on the CPU (no multi-GPU machine needed).

For each model of :mod:`scaling_configs` and each layout (one device, DP, TP+SP, PP 1F1B and
interleaved, CP, EP at 2/4/8) it gives the largest rank's bytes:

* **state**: parameters per rank counted from mcore's own :class:`ModelConfig` (the row's flags parsed
  by ``train_throughput.parse_args``): per layer ``h*(n+2g)*d + n*d*h`` attention, ``h*f*(3 if SwiGLU
  else 2)`` MLP (MoE: ``E/ep`` experts of ``moe_ffn`` plus the ``h*E`` router), the norms, biases where
  the model has them; the tensor-parallel matrices and the vocabulary split ``t`` ways; ``L/p`` layers
  a stage, the embedding on the first stage and the untied output layer on the last. At the
  precision-aware optimizer's 10 bytes a parameter (bf16 parameter and gradient, a 16-bit master
  remainder, bf16 Adam moments); the distributed optimizer divides the 6 optimizer bytes by DP (the
  routed experts' by the expert-data-parallel size ``dp/ep``).
* **activations**: ``U`` units of ``s*b*h`` bf16 elements a layer, *measured* with
  :func:`activation_memory.measure` (autograd's saved tensors, ``mcore.testing.memory.SavedActivations``)
  on a small model of the same structure (hidden 256, the same head/group/FFN/expert ratios), without
  the ``[b, n, s, s]`` probabilities the CPU reference attention keeps (a flash kernel does not);
  ``/t`` under sequence parallelism, ``s/c`` under CP; full recompute keeps 1 unit a layer plus one
  layer's ``U``; the first pipeline stage holds ``p`` micro-batches of ``L/p`` layers in 1F1B and
  ``p*(1+(p-1)/(p*v))`` interleaved (Korthikanti et al.); plus the fp32 logits ``s*b*V/t`` (over the
  loss chunks) on the last stage.

FP8 rows are counted as bf16 (FP8 keeps some saved inputs in one byte: an upper bound)::

    python benchmarks/scaling_memory.py            # the markdown table of benchmarks/README.md
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import scaling_configs as sc  # benchmarks/, next to this file

GIB = 2**30
STATE_BYTES, OPT_BYTES = 4, 6  # bf16 parameter + bf16 gradient; remainder + two bf16 moments


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    vp: int = 1
    cp: int = 1
    ep: int = 1
    m: int = 1  # micro-batches a step


def model_config(model: sc.Model, seq: int | None = None):
    import train_throughput

    _, cfg = train_throughput.parse_args([*model.args(seq), "--warmup", "0", "--iters", "1"])
    return cfg


def layer_params(m, tp: int, ep: int) -> float:
    """Parameters of one transformer layer on one rank (TP splits the matrices, EP the experts)."""
    h, n, g, d = m.hidden_size, m.num_attention_heads, m.num_query_groups, m.kv_channels
    bias = 0 if m.disable_bias_linear else 1
    attn = h * (n + 2 * g) * d + n * d * h + bias * ((n + 2 * g) * d + h)
    mult = 3 if m.swiglu else 2
    if m.num_experts:
        f = m.moe_ffn_hidden_size
        mlp = m.num_experts / ep * mult * h * f + h * m.num_experts * tp  # the router is replicated
    else:
        f = m.ffn_hidden_size
        mlp = mult * h * f + bias * ((mult - 1) * f + h)
    norms = 2 * h * (2 if m.normalization == "LayerNorm" else 1)
    return (attn + mlp) / tp + norms


def expert_params(cfg, lay: Layout) -> float:
    """Routed-expert parameters of one rank (``E/ep`` experts of ``L/p`` layers)."""
    m = cfg.model
    if not m.num_experts:
        return 0.0
    mult = 3 if m.swiglu else 2
    return (
        m.num_layers / lay.pp * m.num_experts / lay.ep * mult * m.hidden_size * m.moe_ffn_hidden_size / lay.tp
    )


def stage_params(cfg, lay: Layout, vocab: int) -> tuple[float, float]:
    """(first stage, last stage) parameters of one rank."""
    m = cfg.model
    layers = m.num_layers / lay.pp * layer_params(m, lay.tp, lay.ep)
    emb = vocab * m.hidden_size / lay.tp
    pos = m.seq_length * m.hidden_size if m.position_embedding_type == "learned_absolute" else 0
    out = emb if m.untie_embeddings_and_output_weights else 0
    final_norm = m.hidden_size * (2 if m.normalization == "LayerNorm" else 1)
    if lay.pp == 1:
        return (layers + emb + pos + out + final_norm,) * 2
    tied = 0 if m.untie_embeddings_and_output_weights else emb  # Megatron's copy of the word embeddings
    return layers + emb + pos, layers + (out or tied) + final_norm


def activations(cfg, lay: Layout, units: float, vocab: int, loss_chunks: int) -> tuple[float, float]:
    """(first stage, last stage) activation bytes of one rank (see the module doc)."""
    m, b = cfg.model, cfg.training.micro_batch_size
    s = m.seq_length / lay.cp
    unit = s * b * m.hidden_size * 2 / lay.tp
    full = m.recompute_granularity == "full"
    per_layer = unit * (1 if full else units)
    recompute = unit * units if full else 0.0
    layers = m.num_layers / lay.pp
    in_flight = (
        1 if lay.pp == 1 else min(lay.m, lay.pp) * (1 + (lay.pp - 1) / (lay.pp * lay.vp) if lay.vp > 1 else 1)
    )
    logits = s * b * vocab / lay.tp * 4 / loss_chunks
    first = layers * per_layer * in_flight + recompute
    last = layers * per_layer + recompute + logits
    return (first + (logits if lay.pp == 1 else 0), last)


def measured_units(model: sc.Model) -> float:
    """``U``: saved s*b*h units a layer of a small model of this structure, flash-equivalent."""
    import activation_memory

    cfg = model_config(model).model
    h, s = 256, 192  # s != h, so a [.., s, s] tensor is the attention probabilities and nothing else
    ratio = h / cfg.hidden_size
    extra = {"ffn_hidden_size": max(8, round(cfg.ffn_hidden_size * ratio))}
    heads = max(2, cfg.num_attention_heads // 4)
    if cfg.group_query_attention:
        groups = max(1, heads * cfg.num_query_groups // cfg.num_attention_heads)
        extra.update(group_query_attention=True, num_query_groups=groups)
    if cfg.num_experts:
        extra.update(num_experts=cfg.num_experts, moe_router_topk=cfg.moe_router_topk,
                     moe_ffn_hidden_size=max(8, round(cfg.moe_ffn_hidden_size * ratio)),
                     moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall")  # fmt: skip
    args = argparse.Namespace(
        num_layers=2, hidden_size=h, num_attention_heads=heads, seq_length=s, micro_batch_size=1,
        vocab_size=128, swiglu=cfg.swiglu, normalization=cfg.normalization,
        disable_bias_linear=cfg.disable_bias_linear, position_embedding_type=cfg.position_embedding_type,
        dtype="bf16", iters=1, model_extra=extra,
    )  # fmt: skip
    from mcore.plugins.manager import select_backend

    out = activation_memory.measure(args, "none", select_backend("cpu"))
    return sum(
        u for shape, _, u in out["layer_tensors"] if not (len(shape) >= 2 and shape[-1] == shape[-2] == s)
    )


def layouts(model: sc.Model, pp_k: int) -> list[Layout]:
    lays = [Layout("1 device")]
    for n in sc.SIZES:
        if model.key in ("olmoe", "mixtral"):
            lays.append(Layout(f"EP={n} (DP={n})", dp=n, ep=n))
            continue
        lays += [
            Layout(f"DP={n} distopt", dp=n),
            Layout(f"TP={n}+SP", tp=n),
            Layout(f"PP={n} 1F1B", pp=n, m=pp_k * n),
        ]
        v = sc._virtual_stages(model.layers, n)
        if v:
            lays.append(Layout(f"PP={n} v={v}", pp=n, vp=v, m=pp_k * n))
    return lays


def rows(models: dict[str, sc.Model], pp_k: int = 4) -> list[dict]:
    out = []
    for key, model in models.items():
        units = measured_units(model)
        plans = [(model.seq, lay, 1) for lay in layouts(model, pp_k)]
        if key == "llama":
            plans += [
                (seq, Layout(f"CP={c} s={seq}", cp=c), 8) for seq in sc.cp_seqs(False) for c in (1, *sc.SIZES)
            ]
        for seq, lay, chunks in plans:
            cfg = model_config(model, seq)
            from mcore.models.transformer.model_config import padded_vocab_size

            vocab = padded_vocab_size(model.vocab, cfg.model.make_vocab_size_divisible_by, lay.tp)
            params = stage_params(cfg, lay, vocab)
            acts = activations(cfg, lay, units, vocab, chunks)
            experts = expert_params(cfg, lay)  # their optimizer splits over the expert-data group, dp/ep
            states = [
                (p - experts) * (STATE_BYTES + OPT_BYTES / lay.dp)
                + experts * (STATE_BYTES + OPT_BYTES * lay.ep / lay.dp)
                for p in params
            ]
            total = [st + a for st, a in zip(states, acts)]
            i = 0 if total[0] >= total[1] else 1
            out.append({"model": model.title, "layout": lay.name, "seq": seq, "units_per_layer": round(units, 2),
                        "params_per_rank_m": round(params[i] / 1e6, 1), "state_gib": round(states[i] / GIB, 2),
                        "activations_gib": round(acts[i] / GIB, 2), "total_gib": round(total[i] / GIB, 2),
                        "stage": "first" if i == 0 else "last"})  # fmt: skip
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt,llama,olmoe,mixtral")
    p.add_argument("--pp-microbatches-per-stage", type=int, default=4)
    a = p.parse_args(argv)
    models = {k: v for k, v in sc.models(False).items() if k in a.models.split(",")}
    print(
        "| model | layout | seq | U (s*b*h a layer) | params/rank (M) | state GiB | activations GiB | total GiB (stage) |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows(models, a.pp_microbatches_per_stage):
        print(f"| {r['model']} | {r['layout']} | {r['seq']} | {r['units_per_layer']} | {r['params_per_rank_m']:,} | "
              f"{r['state_gib']} | {r['activations_gib']} | {r['total_gib']} ({r['stage']}) |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
