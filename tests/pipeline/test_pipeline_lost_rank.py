"""A pipeline that loses a rank mid-step ends with an error naming that rank, not a hang."""

import multiprocessing
import os
import queue
import time

import pytest
import torch
from torch import nn

from mcore.backend import current_backend
from mcore.config.parallel import ParallelConfig
from mcore.distributed.groups import initialize_parallel
from mcore.pipeline import PipelineCommunicationError, get_forward_backward_func
from mcore.testing import distributed as harness

SEQ, MBS, HIDDEN = 4, 2, 8


class Stage(nn.Module):
    def __init__(self, first):
        super().__init__()
        self.first = first
        self.linear = nn.Linear(HIDDEN, HIDDEN)
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def forward(self, x):
        return self.linear(x if self.first else self.input_tensor)


def _dies_mid_step(dying_rank, die_at_microbatch, timeout_s, how):
    groups = initialize_parallel(ParallelConfig(pipeline_model_parallel_size=2))
    device = current_backend().device(int(os.environ["LOCAL_RANK"]))
    model = Stage(groups.is_first_stage).to(device)
    seen = []

    def forward_step(data_iterator, chunk):
        seen.append(next(data_iterator))
        if groups.rank == dying_rank and len(seen) == die_at_microbatch + 1:
            if how == "exit":
                os._exit(3)  # the process disappears without a word, as a crashed node would
            time.sleep(60)  # or it hangs (a stuck kernel, a deadlocked data loader)
        out = chunk(torch.ones(SEQ, MBS, HIDDEN, device=device))
        return out, lambda o: (o.mean(), {})

    schedule = get_forward_backward_func(2)
    start = time.monotonic()
    try:
        schedule(
            forward_step_func=forward_step,
            data_iterator=iter(range(100)),
            model=model,
            num_microbatches=4,
            seq_length=SEQ,
            micro_batch_size=MBS,
            hidden_size=HIDDEN,
            groups=groups,
            timeout_s=timeout_s,
        )
    except PipelineCommunicationError as err:
        return "error", str(err), time.monotonic() - start
    return "finished", "", time.monotonic() - start


def _run_expecting_one_survivor(dying_rank, timeout_s, how):
    """Start 2 ranks; return the survivor's outcome (the harness would report the dead rank first)."""
    context = multiprocessing.get_context("forkserver")
    results = context.Queue()
    port = harness.free_port()
    procs = [
        context.Process(
            target=harness._rank_main,
            args=(
                harness._function_ref(_dies_mid_step),
                (dying_rank, 1, timeout_s, how),
                {},
                r,
                2,
                port,
                harness.test_backend_name(),
                results,
            ),
            daemon=True,
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        rank, ok, payload = results.get(timeout=60)
    except queue.Empty:
        pytest.fail("the surviving rank hung instead of reporting the lost rank")
    finally:
        for p in procs:  # the survivor has reported; the lost rank may still be hanging on purpose
            p.join(timeout=1)
            if p.is_alive():
                p.kill()
                p.join()
    assert ok, payload
    assert rank == 1 - dying_rank
    import pickle

    return pickle.loads(payload)


@pytest.mark.parametrize("dying_rank", [0, 1])
def test_lost_rank_is_named_within_the_timeout(dying_rank):
    outcome, message, elapsed = _run_expecting_one_survivor(dying_rank, 5.0, "exit")
    assert outcome == "error", message
    assert f"stage {dying_rank} (global rank {dying_rank}) did not" in message
    assert elapsed < 5.0 + 10.0


def test_hung_rank_is_named_after_the_timeout():
    outcome, message, elapsed = _run_expecting_one_survivor(1, 2.0, "hang")
    assert outcome == "error", message
    assert "stage 1 (global rank 1) did not" in message and "within 2 s" in message
    assert 2.0 <= elapsed < 2.0 + 10.0
    print(message)
