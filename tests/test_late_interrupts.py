"""Late Ctrl-C: a second one while the first is answered, one as a finished run exits (in a terminal, with rank 0's
bar), one under torchrun. Each is one line and an interrupt's status, never a death by the signal with nothing said
(the interpreter puts Ctrl-C back to its default while it tears itself down, which takes seconds with torch)."""

import contextlib
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import HANG_S, default_sigint

ROOT = Path(__file__).resolve().parents[1]
TINY = ["data.mirrors=[]", "progress=false", "batch_size=32"]  # 640 images at batch 32: 20 steps an epoch


SLOW = ["model._target_=failing_model.FailingConvNet", "+model.fail_rank=-1", "+model.step_seconds=0.05", "epochs=50"]


def _under_a_terminal(command: list[str], after: bytes) -> tuple[int, str]:
    """Runs ``command`` with a fresh pseudo-terminal as stdout and stderr, as ``script -c`` does (it reports 0
    rows and 0 columns), and once it wrote ``after`` presses Ctrl-C every 20 ms until it has exited; its status
    and everything it wrote."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=follower,
        stderr=follower,
        preexec_fn=default_sigint,
        start_new_session=True,
    )
    os.close(follower)
    out, pressed = b"", 0.0
    while True:
        if after in out and time.monotonic() - pressed >= 0.02:
            pressed = time.monotonic()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGINT)
        if select.select([leader], [], [], 0.02)[0]:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the command and its children closed the terminal
                break
            if not chunk:
                break
            out += chunk
    os.close(leader)
    return process.wait(timeout=HANG_S), out.decode(errors="replace")


@pytest.mark.slow
def test_ctrl_c_as_a_finished_run_exits_says_the_run_is_complete(tiny_root, tmp_path):
    command = [sys.executable, "-m", "mnist_dist", f"data.root={tiny_root}", f"hydra.run.dir={tmp_path}/run"]
    command += ["data.mirrors=[]", "batch_size=32", "epochs=1", "log_every=5"]  # progress: the default, on
    command.append("model._target_=failing_model.NarrowConvNet")
    code, out = _under_a_terminal(command, b"INFO run directory: ")  # the run's last line
    assert "epoch 1/1: 100%|" in out and "20/20 [" in out and "loss=" in out and "img_s=" in out  # rank 0's bar
    lines = out.replace("\r\n", "\n").splitlines()
    assert "Traceback" not in out, lines
    # Not -2 with nothing said: the line, or (a press before the run's handlers are put back) a run that completes.
    # The presses go on every 20 ms until the process is gone: on a loaded machine a second one can follow.
    said = [line for line in lines if line.startswith("interrupted")]
    complete = f"interrupted as the run ended; it is complete in {tmp_path}/run"
    assert (code, said[:1]) in [(0, []), (130, [complete])], lines
    assert said[1:] in ([], ["interrupted again: stopped at once"]), lines
    assert (tmp_path / "run" / "results.json").is_file()


@pytest.mark.slow
def test_ctrl_c_under_torchrun_says_ours_first_and_the_docs_name_torchruns_own_traceback(tiny_root, tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "mnist_dist", "mode=ddp"]
    process = subprocess.Popen(
        [*torchrun, f"data.root={tiny_root}", f"hydra.run.dir={tmp_path}/run", *TINY, *SLOW],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
        start_new_session=True,
    )
    for line in process.stderr:
        if "INFO epoch 1:" in line:
            break
    os.killpg(process.pid, signal.SIGINT)
    lines = process.communicate(timeout=HANG_S)[1].splitlines()
    ours = f"interrupted; the last complete checkpoint is {tmp_path}/run/checkpoint.pt; go on with: "
    again = f"{sys.executable} -m mnist_dist resume={tmp_path}/run"
    assert [line for line in lines if line.startswith(ours)] == [ours + again]
    # torchrun's agent reports the Ctrl-C after ours, as troubleshooting.md and running.md say
    troubleshooting = (ROOT / "docs" / "troubleshooting.md").read_text()
    (quoted,) = re.findall(r"\| `([^`]*SignalException[^`]*)` after a 35-line traceback", troubleshooting)
    assert re.fullmatch(re.escape(quoted).replace("<pid>", r"\d+"), lines[-1]), lines[-12:]
    assert process.returncode == 1 and "got signal: 2`" in (ROOT / "docs" / "running.md").read_text()


# a Ctrl-C just after the closing line (as a finished run exits): "again", not the same line twice
AFTER_THE_LINE = """if True:
    import os, signal, sys
    from mnist_dist.operations.errors import interrupted, on_interrupt
    on_interrupt("the run is complete")
    class PressAfterWrite:
        def write(self, text):
            sys.__stderr__.write(text); sys.__stderr__.flush(); os.kill(os.getpid(), signal.SIGINT)
        def flush(self): pass
    sys.stderr = PressAfterWrite()
    interrupted("the run is complete")
"""
# a second Ctrl-C while the first one's line is written: no second line
WHILE_WRITING = """if True:
    import os, signal
    from mnist_dist.operations import errors
    write = os.write
    def write_then_press(fd, data):
        done = write(fd, data); os.kill(os.getpid(), signal.SIGINT); return done
    os.write = write_then_press
    errors.on_interrupt("stopped")
    os.kill(os.getpid(), signal.SIGINT)
    signal.pause()
"""


@pytest.mark.parametrize(
    "script, said",
    [(AFTER_THE_LINE, ["the run is complete", "interrupted again: stopped at once"]), (WHILE_WRITING, ["stopped"])],
    ids=["after_the_line", "while_writing"],
)
def test_a_ctrl_c_as_the_line_is_written_is_one_line_more_at_most(script, said):
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60, preexec_fn=default_sigint
    )
    assert (done.returncode, done.stderr.splitlines()) == (130, said)
