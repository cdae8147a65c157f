"""Ranks that run different numbers of steps without join() end in one line naming the cause, instead of
hanging in gloo for half an hour (our DDP's backward waits for the other ranks' share for peer_wait_s)."""

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import HANG_S

from mnist_dist.parallel import DistributedDataParallel

SCRIPT = Path(__file__).parent / "uneven_script.py"
WAIT_S = 5  # the jobs' peer_wait_s: the default minute would be most of this file's time
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
CAUSE = (
    "rank 1 waited {wait} s for the other ranks in the all-reduce of its backward pass 4, and they never joined "
    "it: the ranks ran different numbers of steps (a data set that does not split evenly?), or one is stuck. Give "
    "every rank the same number of batches, or train inside `with model.join():`"
)


def test_a_user_who_sets_no_wait_gets_a_minute_from_the_wrapper_and_the_app(make_config):
    assert inspect.signature(DistributedDataParallel).parameters["peer_wait_s"].default == 60
    assert make_config("mode=ddp").mode.peer_wait_s == 60


@pytest.mark.slow
@pytest.mark.parametrize("launcher", [[sys.executable], TORCHRUN], ids=["spawn", "torchrun"])
@pytest.mark.parametrize("extra", [1, 3])
def test_an_extra_step_on_one_rank_ends_in_one_line(tmp_path, launcher, extra):
    command = [*launcher, str(SCRIPT), str(extra), str(WAIT_S)]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode != 0
    cause = CAUSE.format(wait=WAIT_S)
    if launcher == TORCHRUN:  # torchrun prints the rank's traceback, ending in our line, then its summary
        assert f"RuntimeError: {cause}" in result.stderr
    else:  # our launcher: one line, the rank and its reason
        assert result.stderr.strip().splitlines()[-1] == f"error: rank 1 failed: RuntimeError: {cause}"
