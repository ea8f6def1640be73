"""Element-wise work a GPT training step does not do: ops counted in one tiny ``--bf16`` CPU step.

A dispatch mode records every aten op of the third training step (tied embeddings, the DDP wrapper
with gradient-accumulation fusion, as ``pretrain`` builds them) with the autograd node it runs in.
The tied output layer accumulates its weight gradient into ``main_grad`` itself and returns no
gradient for the shared word embedding: no ``[V, h]`` zero placeholder is filled and no add sums it
with the embedding lookup's gradient (on the H100 step, one fill and one add over 50304 x 2048 bf16).
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mcore.testing.distributed import run_distributed

VOCAB, HIDDEN = 128, 64

ARGV = [
    "--num-layers", "2", "--hidden-size", str(HIDDEN), "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
    "--global-batch-size", "2", "--train-iters", "10", "--lr", "1e-4", "--bf16",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1), "--mock-data",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0", "--device-backend", "cpu",
]  # fmt: skip
"""NullTokenizer's vocabulary is ``--vocab-size + 1``: 128 rows, a multiple of 128 (no padding)."""


class _OpRecorder(TorchDispatchMode):
    """Counts ``(op, autograd node or "forward", touches a [V, h] tensor)``."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        node = torch._C._current_autograd_node()
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        out = func(*args, **kwargs)
        outs = out if isinstance(out, (list, tuple)) else [out]
        tensors += [t for t in outs if isinstance(t, torch.Tensor)]
        vocab_sized = any(tuple(t.shape) == (VOCAB, HIDDEN) for t in tensors)
        self.calls[(func._overloadpacket.__name__, node.name() if node else "forward", vocab_sized)] += 1
        return out


def _step_ops() -> dict:
    from mcore.distributed.groups import initialize_parallel
    from mcore.training.gpt import forward_step, model_provider
    from mcore.training.pretrain import Trainer, build_training, check_run_config, setup_backend
    from mcore.training.run_config import parse_run_config

    cfg = parse_run_config(ARGV, prog="test")
    backend = setup_backend(cfg)
    cfg = check_run_config(cfg, backend, 1)
    groups = initialize_parallel(cfg.parallel, backend)
    ctx = build_training(
        cfg, groups, backend, model_provider, datasets_provider=None, vocab_size=VOCAB - 1, verbose=False
    )
    tokens = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(0))
    batch = {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": torch.ones(2, 32),
        "position_ids": torch.arange(32).expand(2, 32).contiguous(),
    }
    data = iter(lambda: batch, None)
    trainer = Trainer.from_context(ctx, forward_step)
    for _ in range(2):  # lazy initialisation (optimizer state) out of the counted step
        trainer.train_step(data)
    recorder = _OpRecorder()
    with recorder:
        trainer.train_step(data)
    return dict(recorder.calls)


def test_tied_output_layer_adds_no_placeholder_to_the_embedding_gradient():
    (calls,) = run_distributed(_step_ops, 1, backend="cpu", timeout=120)
    on_vocab = {key: n for key, n in calls.items() if key[2]}
    backward_adds = {k: n for k, n in on_vocab.items() if k[0] == "add" and k[1] != "forward"}
    fills = {k: n for k, n in on_vocab.items() if k[0] in ("zeros_like", "zero_", "fill_")}
    # the one [V, h] add left in backward is the DDP hook's main_grad += grad (an in-place add_)
    assert backward_adds == {}, on_vocab
    assert {k: n for k, n in fills.items() if k[1] != "forward"} == {}, on_vocab
    # the word embedding's gradient still reaches main_grad: the hook's add_ (fp32 main_grad)
    assert sum(n for k, n in on_vocab.items() if k[0] == "add_") >= 1, on_vocab
