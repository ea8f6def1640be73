"""A pipeline that loses a rank mid-step ends with an error naming that rank, not a hang."""

import json
import multiprocessing
import os
import re
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


def _dies_mid_step(dying_rank, die_at_microbatch, timeout_s, how, report_path):
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
    outcome = ("finished", "")
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
        outcome = ("error", str(err))
    with open(report_path + ".tmp", "w") as f:
        json.dump([groups.rank, *outcome, time.monotonic() - start], f)
    os.replace(report_path + ".tmp", report_path)
    # A communicator with a dead peer may block in teardown; a training job would exit here too.
    os._exit(0)


def _run_expecting_one_survivor(dying_rank, timeout_s, how, tmp_path):
    """Start 2 ranks; return the survivor's (rank, outcome, message, seconds) from its report file."""
    harness.skip_without_devices(2)  # the ranks are started here, not by run_distributed
    context = multiprocessing.get_context("forkserver")
    report = str(tmp_path / "survivor.json")
    port = harness.free_port()
    args = (harness._function_ref(_dies_mid_step), (dying_rank, 1, timeout_s, how, report), {})
    unused_results = context.Queue()  # the survivor reports through its file and skips teardown
    procs = [
        context.Process(
            target=harness._rank_main,
            args=(*args, r, 2, port, harness.test_backend_name(), unused_results),
            daemon=True,
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 120  # process start-up included (slow on a busy machine)
        while not os.path.exists(report):
            if time.monotonic() > deadline:
                pytest.fail("the surviving rank hung instead of reporting the lost rank")
            time.sleep(0.05)
        with open(report) as f:
            return json.load(f)
    finally:
        for p in procs:  # the lost rank may still be hanging on purpose
            p.join(timeout=1)
            if p.is_alive():
                p.kill()
                p.join()


@pytest.mark.parametrize("dying_rank", [0, 1])
def test_lost_rank_is_named_within_the_timeout(dying_rank, tmp_path):
    rank, outcome, message, elapsed = _run_expecting_one_survivor(dying_rank, 5.0, "exit", tmp_path)
    assert (rank, outcome) == (1 - dying_rank, "error"), message
    assert f"stage {dying_rank} (global rank {dying_rank}) did not" in message
    assert elapsed < 5.0 + 10.0
    # the time it took, not the deadline it did not reach
    took = re.search(r"the exchange failed after (\d+\.\d) s", message)
    assert took and "within 5 s" not in message, message
    assert float(took.group(1)) <= elapsed + 0.1


def test_hung_rank_is_named_after_the_timeout(tmp_path):
    rank, outcome, message, elapsed = _run_expecting_one_survivor(1, 2.0, "hang", tmp_path)
    assert (rank, outcome) == (0, "error"), message
    assert "stage 1 (global rank 1) did not" in message and "within 2 s (gave up after 2." in message
    assert 2.0 <= elapsed < 2.0 + 10.0
