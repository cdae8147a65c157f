"""compare: interleaved rounds, median and spread of images/s and a warning under a busy machine, bad options in
one line before any run, nothing left behind by a failed one."""

import json
import statistics

import pytest

from mnist_dist.launch import WorkerFailed
from mnist_dist.tools import compare


def never(*args, **kwargs):
    raise AssertionError("no run may start after a bad option")


@pytest.mark.slow
def test_rounds_alternate_and_the_table_has_medians_spreads_and_the_load_warning(
    tiny_root, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    # dp: a second mode that runs in this process on a CPU; modes as a comma list, as a sweep takes them
    argv = ["modes=single,dp", "repeats=2", "gpus=2", f"data.root={tiny_root}", "data.mirrors=[]"]
    argv.append("model._target_=failing_model.NarrowConvNet")
    assert compare.main([*argv, "epochs=1", "log_every=2", "progress=false"], load=lambda: 1000.0) == 0
    (out,) = (tmp_path / "outputs" / "compare").glob("*/*")
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["dp", "dp_2", "single", "single_2"]
    report = json.loads((out / "compare.json").read_text())
    for row in report["rows"]:
        mode = row["mode"]
        speeds = [json.loads((out / d / "results.json").read_text())["train_images_per_s"] for d in (mode, f"{mode}_2")]
        assert row["images_per_s_rounds"] == speeds and row["images_per_s"] == pytest.approx(statistics.median(speeds))
    assert report["agree"]
    table = (out / "compare.md").read_text()
    assert "| images/s (median of 2) |" in table and "load average reached 1000.0" in table
    printed = capsys.readouterr().out
    assert table in printed
    # the second round in reverse: no mode always runs first, after the same one, or last
    said = [line.split(" (")[0] for line in printed.splitlines() if line.startswith("== round")]
    assert said == ["== round 1/2: single", "== round 1/2: dp", "== round 2/2: dp", "== round 2/2: single"], said


@pytest.mark.parametrize(
    "option, key",
    [
        ("repeats=0", "repeats=0"),
        ("mode=single,ddp", "modes="),
        ("epoch=1", "'epoch'.*repeats \\(compare's own\\)"),  # compare's own keys are valid keys too
    ],
)
def test_every_bad_option_is_one_error_line_before_any_run(tiny_root, tmp_path, monkeypatch, option, key):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(compare, "run_rounds", never)
    with pytest.raises(SystemExit, match=f"^error: .*{key}[^\n]*$"):
        compare.main([option, f"data.root={tiny_root}", "data.mirrors=[]"])
    assert list(tmp_path.iterdir()) == []


def test_a_compare_whose_first_run_fails_leaves_nothing(tiny_root, tmp_path, monkeypatch):
    # It left outputs/compare/ behind, and before that outputs/compare/<date>/<time>/.
    monkeypatch.chdir(tmp_path)

    def launch(cfg, run_dir, overrides=()):
        raise WorkerFailed("rank 0 failed: exit 1")

    monkeypatch.setattr(compare, "launch", launch)
    with pytest.raises(SystemExit, match="rank 0 failed"):
        compare.main(["modes=[single]", f"data.root={tiny_root}", "data.mirrors=[]"])
    assert list(tmp_path.iterdir()) == []
