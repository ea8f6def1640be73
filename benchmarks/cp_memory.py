"""Activation memory per rank under context parallelism (CPU processes, gloo, or any backend).

For each ``--cp`` size and ``--comm-types`` entry it starts ``cp`` processes
(:func:`mcore.testing.distributed.run_distributed`), builds the same GPT model on each (Llama-style by
default: RoPE, RMSNorm, SwiGLU, GQA), gives every rank its zigzag part of one batch
(:func:`mcore.training.cp_batch.slice_batch_for_cp`), and counts the activation bytes autograd keeps
for backward at the end of the forward (:class:`mcore.testing.memory.SavedActivations`, parameters
excluded), then runs the backward. One JSON line per (cp, comm type) with the largest rank's bytes,
the ratio to CP=1 and the ideal ``1/cp``; a table at the end.

The CP=1 run uses the op table's ``attention``, whose reference keeps the ``[b, n, s, s]``
probabilities; the p2p ring keeps only q, k, v, the output and the log-sum-exp (its backward
recomputes each block, as flash attention does), a2a keeps the probabilities of ``n/cp`` heads over
the whole sequence, allgather those of the local queries over the gathered keys. ::

    python benchmarks/cp_memory.py --cp 1 2 4 --comm-types p2p a2a allgather
"""

from __future__ import annotations

import argparse
import json

import torch

GIB = 2**30


def _rank_measure(args: dict, cp: int, comm: str) -> int:
    """One rank: build the model at this CP layout, forward one batch part, return the kept bytes."""
    from mcore.config.parallel import ParallelConfig
    from mcore.distributed.groups import ProcessGroups, initialize_parallel
    from mcore.models.gpt.gpt_model import GPTModel
    from mcore.models.transformer.model_config import ModelConfig, padded_vocab_size
    from mcore.testing.memory import SavedActivations
    from mcore.training.cp_batch import slice_batch_for_cp

    torch.set_num_threads(1)
    cfg = ModelConfig(
        num_layers=args["num_layers"],
        hidden_size=args["hidden_size"],
        num_attention_heads=args["num_attention_heads"],
        group_query_attention=True,
        num_query_groups=args["num_query_groups"],
        ffn_hidden_size=4 * args["hidden_size"],
        seq_length=args["seq_length"],
        swiglu=True,
        normalization="RMSNorm",
        disable_bias_linear=True,
        position_embedding_type="rope",
        untie_embeddings_and_output_weights=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    if cp == 1:
        groups = ProcessGroups.single()
    else:
        groups = initialize_parallel(ParallelConfig(context_parallel_size=cp, cp_comm_type=comm))
    vocab = padded_vocab_size(args["vocab_size"], cfg.make_vocab_size_divisible_by, 1)
    model = GPTModel(cfg, groups, vocab, cp_comm_type=comm)
    s, b = args["seq_length"], args["micro_batch_size"]
    tokens = torch.randint(0, args["vocab_size"], (b, s), generator=torch.Generator().manual_seed(0))
    batch = {
        "tokens": tokens,
        "labels": tokens.roll(-1, dims=1),
        "position_ids": torch.arange(s).expand(b, s),
    }
    batch = slice_batch_for_cp(batch, groups.topology.coordinate("cp"), cp)
    with SavedActivations(exclude=model.parameters()) as saved:
        loss = model(batch["tokens"], batch["position_ids"], labels=batch["labels"]).mean()
    kept = saved.nbytes()
    saved.clear()
    loss.backward()
    return kept


def main(argv=None) -> None:
    from mcore.testing.distributed import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--comm-types", nargs="+", default=["p2p", "a2a", "allgather"])
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--num-query-groups", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--vocab-size", type=int, default=1024)
    args = parser.parse_args(argv)
    model_args = {k: getattr(args, k) for k in vars(args) if k not in ("cp", "comm_types")}
    rows, base = [], None
    for cp in args.cp:
        for comm in args.comm_types if cp > 1 else ["none"]:
            if cp == 1:
                kept = [_rank_measure(model_args, 1, comm)]
            else:
                kept = run_distributed(_rank_measure, cp, model_args, cp, comm, backend="cpu", timeout=1800)
            worst = max(kept)
            base = worst if cp == 1 else base
            row = {"cp": cp, "comm": comm, "kept_gib": round(worst / GIB, 4),
                   "ratio_to_cp1": None if base is None else round(worst / base, 3), "ideal": round(1 / cp, 3)}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"{'cp':>3} {'comm':>9} {'kept GiB':>9} {'ratio':>6} {'1/cp':>6}")
    for r in rows:
        print(f"{r['cp']:>3} {r['comm']:>9} {r['kept_gib']:>9.4f} {r['ratio_to_cp1']!s:>6} {r['ideal']:>6}")


if __name__ == "__main__":
    main()
