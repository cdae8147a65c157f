"""Ranks that run different numbers of steps without join() end in one line naming the cause, instead of
hanging in gloo for half an hour (our DDP's backward waits for the other ranks' share for peer_wait_s)."""

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import HANG_S
from uneven_script import worker

from mnist_dist.parallel import DistributedDataParallel, WorkerFailed, spawn

SCRIPT = Path(__file__).parent / "uneven_script.py"
WAIT_S = 2  # the jobs' peer_wait_s: the default minute would be most of this file's time
# the key phrases of the line: who waited, for what, how long, and what to do
CAUSE = (f"rank 1 waited {WAIT_S} s for the other ranks in the all-reduce of its backward pass 4", "model.join()")


def test_a_user_who_sets_no_wait_gets_a_minute_from_the_wrapper_and_the_app(make_config):
    assert inspect.signature(DistributedDataParallel).parameters["peer_wait_s"].default == 60
    assert make_config("mode=ddp").mode.peer_wait_s == 60


@pytest.mark.slow
def test_an_extra_step_on_one_rank_ends_in_one_line_under_our_launcher():
    # what uneven_script.py exits with under our launcher: "error: " and this line
    with pytest.raises(WorkerFailed) as failed:
        spawn(worker, 2, 1, WAIT_S, start_method="forkserver")
    line = str(failed.value)
    assert line.startswith(f"rank 1 failed: RuntimeError: {CAUSE[0]}") and CAUSE[1] in line and "\n" not in line


@pytest.mark.slow
def test_an_extra_step_on_one_rank_ends_in_one_line_under_torchrun(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command = [*torchrun, str(SCRIPT), "1", str(WAIT_S)]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode != 0
    assert f"RuntimeError: {CAUSE[0]}" in result.stderr  # in the rank's traceback, before torchrun's summary
