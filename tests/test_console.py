"""Rank 0's progress shows: a bar in a terminal (also one that reports no size: test_late_interrupts), a log line
in a pipe (a ddp run's from the command line: test_launch)."""

import json
import logging

from mnist_dist.launch import launch
from mnist_dist.operations.console import Progress, summary_line


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


def test_a_run_ends_with_one_short_line_of_results_and_its_directory(make_config, tmp_path, capsys):
    launch(make_config("epochs=1", "batch_size=32", "model._target_=failing_model.NarrowConvNet"), tmp_path)
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
