"""compare: interleaved rounds, median and spread of images/s and a warning under a busy machine, bad options in
one line before any run, and only complete runs left behind."""

import json
import statistics

import pytest

from mnist_dist.launch import WorkerFailed
from mnist_dist.tools import compare


class Stop(Exception):
    """Ends a comparison where a test has seen what it needs, before any training."""


def never(*args, **kwargs):
    raise AssertionError("no run may start after a bad option")


def test_warnings_name_the_noisy_modes_and_a_high_load():
    def row(mode, speeds):
        return {"mode": mode, "spread": (max(speeds) - min(speeds)) / statistics.median(speeds)}

    quiet = {"rows": [row("single", [1000.0, 1050.0, 1040.0]), row("ddp", [900.0, 950.0, 920.0])]}
    assert compare.warnings(quiet, load_average=1.5, cores=2) == []
    noisy = {"rows": [row("single", [1000.0, 1200.0, 1040.0]), row("ddp", [900.0, 950.0, 920.0])]}
    spread, load = compare.warnings(noisy, load_average=3.0, cores=2)
    assert "(single 19%)" in spread and "repeats=" in spread and "load average reached 3.0 on 2 cores" in load


@pytest.mark.slow
def test_rounds_alternate_and_the_table_has_medians_spreads_and_the_load_warning(
    tiny_root, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    # dp: a second mode that runs in this process on a CPU (the tables are what is tested, not the modes)
    argv = ["modes=[single,dp]", "repeats=2", "gpus=2", f"data.root={tiny_root}", "data.mirrors=[]"]
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
    assert table in capsys.readouterr().out


def test_modes_take_a_comma_list_as_a_sweep_does_and_each_run_says_its_overrides(tiny_root, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    said = []

    def launch(cfg, run_dir, overrides=()):
        said.append(" ".join(overrides))  # what its console's "config:" line says
        raise Stop

    monkeypatch.setattr(compare, "launch", launch)
    with pytest.raises(Stop):
        compare.main(["modes=ddp,single", f"data.root={tiny_root}", "gpus=2"])
    assert said == [f"data.root={tiny_root} gpus=2 mode=ddp model.dropout=false"]


@pytest.mark.parametrize(
    "option, key",
    [
        ("repeats=0", "repeats=0"),
        ("modes=[]", "modes=\\[\\]"),
        ("tolerance=abc", "tolerance=abc"),
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


def test_help_prints_the_usage(monkeypatch, capsys):
    monkeypatch.setattr(compare, "run_rounds", never)
    assert compare.main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("Do my modes agree")


def test_two_compares_in_one_second_get_two_directories(tmp_path):
    first, second = compare.fresh_dir(tmp_path / "12-00-00"), compare.fresh_dir(tmp_path / "12-00-00")
    assert (first.name, second.name) == ("12-00-00", "12-00-00_2") and first.is_dir() and second.is_dir()


def test_an_interrupted_compare_leaves_only_complete_runs(tiny_root, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)

    def launch(cfg, run_dir, overrides=()):
        (run_dir / "rank_0.log").write_text("started\n")
        if cfg.mode.name == "ddp":
            raise KeyboardInterrupt  # Ctrl-C in the middle of the second run
        (run_dir / "results.json").write_text(json.dumps({"train_images_per_s": 1.0}))

    monkeypatch.setattr(compare, "launch", launch)
    monkeypatch.setattr(compare, "loss_curve", lambda run_dir: {1: 1.0})
    with pytest.raises(SystemExit) as exit_:
        compare.main(["modes=[single,ddp]", "repeats=2", f"data.root={tiny_root}", "data.mirrors=[]"])
    assert exit_.value.code == 130
    (out,) = (tmp_path / "outputs" / "compare").glob("*/*")
    assert [p.name for p in out.iterdir()] == ["single"]  # complete; the interrupted ddp run is gone
    assert f"no report written (the complete runs: {out.relative_to(tmp_path)})" in capsys.readouterr().err


def test_a_compare_whose_first_run_fails_leaves_nothing(tiny_root, tmp_path, monkeypatch):
    # It left outputs/compare/ behind, and before that outputs/compare/<date>/<time>/.
    monkeypatch.chdir(tmp_path)

    def launch(cfg, run_dir, overrides=()):
        raise WorkerFailed("rank 0 failed: exit 1")

    monkeypatch.setattr(compare, "launch", launch)
    with pytest.raises(SystemExit, match="rank 0 failed"):
        compare.main(["modes=[single]", f"data.root={tiny_root}", "data.mirrors=[]"])
    assert list(tmp_path.iterdir()) == []
