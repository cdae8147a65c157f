"""The bench: ratios of paired rounds, skipped cases, time to accuracy's table, one line for a bad count, no work
directory left however it ends, and one real run."""

import argparse
import json

import pytest
from helpers import compose_config

from mnist_dist.launch import launch
from mnist_dist.tools import bench

ARGS = argparse.Namespace(device="cpu", batch=64, steps=10, repeats=3, gpus=2, seeds=3)


def run(speed):
    return {"train_images_per_s": speed, "model_state_mib": [9.5, 9.0]}


def test_the_tables_have_medians_ratios_of_paired_rounds_what_was_skipped_and_times_to_accuracy():
    # Round 2 ran on a slower machine for both: the paired ratio stays 2, the ratio of medians would not.
    samples = {
        "single": [run(1200.0), run(1000.0), run(1100.0)],
        "ddp": [run(400.0), run(200.0), run(420.0)],
        "torch_ddp": [run(200.0), run(100.0), run(200.0)],
    }
    _, skipped = bench.choose(None, "cpu", [])
    table = bench.markdown(samples, skipped, ARGS)
    assert "| single | 1,100 | 1,000 – 1,200 | 9.5 |" in table  # model state: the fullest rank's
    assert "| ddp / torch_ddp | 2.00 | 2.00 – 2.10 |" in table
    assert "skipped single_bf16: " in table and "| single_bf16 / single | skipped: " in table  # emulated on a CPU

    def tta(s91, s92):
        return {"seconds_to": [s91, s92]}

    samples = {
        "single": [tta(30.0, 40.0), tta(35.0, 50.0), tta(31.0, 45.0)],
        "torch_ddp": [tta(40.0, 50.0), tta(44.0, None), tta(38.0, 52.0)],
    }
    table = bench.tta_markdown(samples, ARGS)
    assert "| single | 91.0% | 3/3 | 31.0 | 35.0 |" in table and "| single | 92.0% | 3/3 | 45.0 | 50.0 |" in table
    assert "| torch_ddp | 92.0% | 2/3 | 51.0 | not reached |" in table


@pytest.mark.parametrize("flag, value", [("--steps", "abc"), ("--warmup", "-1")])
def test_a_count_that_cannot_be_is_one_line_naming_the_flag(tmp_path, flag, value):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--cases", "single", flag, value, "--out", str(tmp_path / "out")])
    assert flag in exit_.value.code and "\n" not in exit_.value.code and not (tmp_path / "out").exists()


def test_a_failed_bench_leaves_no_work_directory(tmp_path, monkeypatch):
    def fails(overrides, run_dir):
        run_dir.mkdir(parents=True)  # it had begun to write
        raise RuntimeError("exit 1: error: batch_size=16 is not divisible by 3 ranks")

    monkeypatch.setattr(bench, "train_in_subprocess", fails)
    monkeypatch.setattr(bench.tempfile, "tempdir", str(tmp_path))
    with pytest.raises(SystemExit, match="bench: ddp failed: exit 1: .*not divisible"):
        bench.main(["--cases", "ddp", "--gpus", "3", "--batch", "16", "--steps", "2", "--out", str(tmp_path / "out")])
    assert list(tmp_path.iterdir()) == []  # neither the work directory nor a report


@pytest.mark.slow
def test_a_tiny_run_reports_what_it_measured(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench.tempfile, "tempdir", str(tmp_path))

    def here(overrides, run_dir):  # the run in this process: what the bench reads of it is what counts
        run_dir.mkdir(parents=True)
        return launch(compose_config(tmp_path, *overrides), run_dir)

    monkeypatch.setattr(bench, "train_in_subprocess", here)
    out = tmp_path / "out"
    bench.main(
        ["--cases", "single", "--steps", "6", "--warmup", "2", "--repeats", "1", "--batch", "16", "--out", str(out)]
    )
    (single,) = json.loads((out / "bench.json").read_text())["samples"]["single"]
    assert single["train_images_per_s"] > 0 and (out / "bench.md").read_text() in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the work directory is gone
