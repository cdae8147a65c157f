"""Ranks that run different numbers of steps without join() end in one line naming the cause, instead of
hanging in gloo for half an hour (our DDP's backward waits for the other ranks' share for peer_wait_s)."""

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import HANG_S

SCRIPT = Path(__file__).parent / "uneven_script.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
CAUSE = (
    "rank 1 waited {wait} s for the other ranks in the all-reduce of its backward pass 4, and they never joined "
    "it: the ranks ran different numbers of steps (a data set that does not split evenly?), or one is stuck. Give "
    "every rank the same number of batches, or train inside `with model.join():`"
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "launcher, extra, wait",
    [
        ([sys.executable], 1, None),  # our spawn, the default wait (60 s)
        ([sys.executable], 3, "5"),
        (TORCHRUN, 1, "5"),
        (TORCHRUN, 3, "5"),
    ],
    ids=["spawn-1-default", "spawn-3", "torchrun-1", "torchrun-3"],
)
def test_an_extra_step_on_one_rank_ends_in_one_line(tmp_path, launcher, extra, wait):
    command = [*launcher, str(SCRIPT), str(extra), *([wait] if wait else [])]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode != 0
    cause = CAUSE.format(wait=wait or 60)
    if launcher == TORCHRUN:  # torchrun prints the rank's traceback, ending in our line, then its summary
        assert f"RuntimeError: {cause}" in result.stderr
    else:  # our launcher: one line, the rank and its reason
        assert result.stderr.strip().splitlines()[-1] == f"error: rank 1 failed: RuntimeError: {cause}"
