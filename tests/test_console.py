"""Rank 0's progress shows: a bar in a terminal (also one that reports no size), a log line in a pipe."""

import json
import logging
import os
import pty
import subprocess
import sys

import pytest

from mnist_dist.launch import launch
from mnist_dist.operations.console import Progress, config_line, summary_line

RUN = [sys.executable, "-m", "mnist_dist", "epochs=1", "log_every=5", "data.mirrors=[]"]


def test_without_a_terminal_a_line_comes_with_the_first_numbers_then_every_interval(caplog):
    now = [100.0]
    log = logging.getLogger("test_progress")
    progress = Progress(20, enabled=True, log=log, interval_s=30, clock=lambda: now[0])
    progress.set_epoch(1, 2)
    with caplog.at_level(logging.INFO, logger="test_progress"):
        for step in range(1, 11):
            now[0] += 10  # 10 s per step
            if step == 2:
                progress.numbers(0.5, None)  # still warming up: no images/s yet
            if step == 5:
                progress.numbers(0.5, 640.0)
            progress.step()
    assert caplog.messages == [
        "step 2/20 (epoch 1/2): loss 0.5000, images/s after warm-up, ETA 0:03:00",
        "step 5/20 (epoch 1/2): loss 0.5000, 640 images/s, ETA 0:02:30",
        "step 8/20 (epoch 1/2): loss 0.5000, 640 images/s, ETA 0:02:00",
    ]


def run_under_pty(command: list[str]) -> str:
    """Runs ``command`` with a fresh pseudo-terminal as stdout and stderr, as ``script -c`` does: it
    reports 0 rows and 0 columns. Returns everything written to it."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert process.wait(timeout=300) == 0, b"".join(chunks)[-2000:]
    os.close(leader)
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_a_terminal_shows_the_bar_on_rank_0(tiny_root, tmp_path):
    out = run_under_pty([*RUN, f"data.root={tiny_root}", f"hydra.run.dir={tmp_path}"])
    assert "epoch 1/1: 100%|" in out and "10/10 [" in out
    assert "loss=" in out and "img_s=" in out


@pytest.mark.slow
def test_a_pipe_gets_progress_lines_in_the_console_and_the_log(tiny_root, tmp_path):
    result = subprocess.run(
        [*RUN, "mode=ddp", "gpus=2", f"data.root={tiny_root}", f"hydra.run.dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "step 5/10 (epoch 1/1): loss " in result.stderr
    assert "step 5/10 (epoch 1/1): loss " in (tmp_path / "rank_0.log").read_text()
    assert "step 5/10" not in (tmp_path / "rank_1.log").read_text()
    # The config: one console line; the whole of it in the log file (and config.yaml).
    assert (
        f"config: {' '.join(RUN[3:])} mode=ddp gpus=2 data.root={tiny_root} (all of it in config.yaml)" in result.stderr
    )
    assert "peer_wait_s: 60.0" not in result.stderr
    assert "peer_wait_s: 60.0" in (tmp_path / "rank_0.log").read_text()


def test_the_config_line_is_the_command_line_overrides():
    assert config_line([]) == "the defaults"
    assert config_line(["mode=ddp", "gpus=2", "~model.dropout"]) == "mode=ddp gpus=2 ~model.dropout"


def test_a_run_ends_with_one_short_line_of_results_and_its_directory(make_config, tmp_path, capsys):
    launch(make_config("epochs=1", "batch_size=32"), tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    summary = summary_line(results)
    assert summary.startswith(
        f"test accuracy {100 * results['test_accuracy']:.2f} %, loss {results['test_loss']:.4f}; "
    )
    assert f"{results['steps']} steps in 0:00:" in summary and summary.endswith(" images/s")
    assert len(summary) < 100
    console = capsys.readouterr().err.splitlines()
    assert console[-2].endswith(f" INFO {summary}") and console[-1].endswith(f" INFO run directory: {tmp_path}")
    assert "results: {" not in "\n".join(console)  # the whole dict: results.json, and rank 0's log
    assert "results: {" in (tmp_path / "rank_0.log").read_text()
