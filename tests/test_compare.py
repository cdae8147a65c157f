"""compare under a busy machine: interleaved rounds, median and spread of images/s, and a warning."""

import json
import statistics

import pytest
from helpers import assert_machine_fields

from mnist_dist.operations.console import config_line
from mnist_dist.tools import compare


class Stop(Exception):
    """Ends a comparison where a test has seen what it needs, before any training."""


def row(mode, speeds):
    return {
        "mode": mode,
        "images_per_s": statistics.median(speeds),
        "spread": (max(speeds) - min(speeds)) / statistics.median(speeds),
    }


def test_warnings_name_the_noisy_modes_and_a_high_load():
    quiet = {"rows": [row("single", [1000.0, 1050.0, 1040.0]), row("ddp", [900.0, 950.0, 920.0])]}
    assert compare.warnings(quiet, load_average=1.5, cores=2) == []
    noisy = {"rows": [row("single", [1000.0, 1200.0, 1040.0]), row("ddp", [900.0, 950.0, 920.0])]}
    assert compare.warnings(noisy, load_average=3.0, cores=2) == [
        "warning: images/s varied by more than 10% between rounds (single 19%): the ranking by speed may be "
        "noise; rerun on an idle machine or with more repeats=",
        "warning: the load average reached 3.0 on 2 cores (these runs' own threads count too): more work than "
        "cores competed, so images/s is unreliable (loss and accuracy are not affected)",
    ]


@pytest.mark.slow
def test_rounds_alternate_and_the_table_has_medians_spreads_and_the_load_warning(
    tiny_root, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    argv = ["modes=[single,ddp]", "repeats=2", "gpus=2", f"data.root={tiny_root}", "data.mirrors=[]"]
    argv += ["epochs=1", "log_every=2", "progress=false"]
    assert compare.main(argv, load=lambda: 1000.0) == 0
    (out,) = (tmp_path / "outputs" / "compare").glob("*/*")
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["ddp", "ddp_2", "single", "single_2"]
    report = json.loads((out / "compare.json").read_text())
    assert_machine_fields(report["machine"])
    for mode_row in report["rows"]:
        mode = mode_row["mode"]
        speeds = [json.loads((out / d / "results.json").read_text())["train_images_per_s"] for d in (mode, f"{mode}_2")]
        assert mode_row["images_per_s_rounds"] == speeds
        assert mode_row["images_per_s"] == pytest.approx(statistics.median(speeds))
        assert mode_row["spread"] == pytest.approx((max(speeds) - min(speeds)) / statistics.median(speeds))
    table = (out / "compare.md").read_text()
    assert table.startswith("machine: ")
    assert "| images/s (median of 2) | min – max | spread |" in table
    assert "warning: the load average reached 1000.0 on" in table
    assert table in capsys.readouterr().out


def test_modes_take_a_comma_list_as_a_sweep_does(tiny_root, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    seen = []

    def rounds(configs, *args):
        seen.extend(configs)
        raise Stop

    monkeypatch.setattr(compare, "run_rounds", rounds)
    with pytest.raises(Stop):
        compare.main(["modes=single,ddp", f"data.root={tiny_root}", "data.mirrors=[]"])
    assert seen == ["single", "ddp"]
    assert list((tmp_path / "outputs" / "compare").iterdir()) == []  # no empty directory for a compare that ran nothing


def test_each_run_says_the_overrides_it_runs_with(tiny_root, tmp_path, monkeypatch):
    said = []

    def launch(cfg, run_dir, overrides=()):
        said.append(config_line(overrides))  # what its console's "config:" line says
        raise Stop

    monkeypatch.setattr(compare, "launch", launch)
    configs = compare.compose_configs(["ddp"], [f"data.root={tiny_root}", "gpus=2"])
    with pytest.raises(Stop):
        compare.run_rounds(configs, 1, tmp_path / "out", lambda: 0.0)
    assert said == [f"data.root={tiny_root} gpus=2 mode=ddp model.dropout=false"]


def never(*args, **kwargs):
    raise AssertionError("no run may start after a bad option")


@pytest.mark.parametrize(
    "option, line",
    [
        ("repeats=0", "error: repeats=0 must be a whole number"),
        ("repeats=abc", "error: repeats=abc must be a whole number"),
        ("modes=[]", "error: modes=[] names no mode"),
        ("modes=5", "error: modes=5: 5 is not a mode"),
        ("modes=[single", "error: modes=[single is not a list of modes"),
        ("tolerance=abc", "error: tolerance=abc must be a number"),
        ("early_tolerance=-1", "error: early_tolerance=-1 must be a number"),
        ("mode=single,ddp", "error: mode=single,ddp: compare runs each mode of modes="),
        ("epoch=1", "error: Could not override 'epoch'"),
    ],
)
def test_every_bad_option_is_one_error_line_before_any_run(tiny_root, monkeypatch, option, line):
    monkeypatch.setattr(compare, "run_rounds", never)
    with pytest.raises(SystemExit) as exit_:
        compare.main([option, f"data.root={tiny_root}", "data.mirrors=[]"])
    message = exit_.value.code  # sys.exit(message): status 1
    assert isinstance(message, str) and message.startswith(line) and "\n" not in message, message
    if option == "epoch=1":  # compare's own keys are valid keys too
        assert message.endswith("modes, tolerance, early_tolerance, repeats (compare's own)")


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_usage(monkeypatch, capsys, flag):
    monkeypatch.setattr(compare, "run_rounds", never)
    assert compare.main([flag]) == 0
    assert capsys.readouterr().out.startswith("Do my modes agree")


def test_two_compares_in_one_second_get_two_directories(tmp_path):
    first, second = compare.fresh_dir(tmp_path / "12-00-00"), compare.fresh_dir(tmp_path / "12-00-00")
    assert (first.name, second.name) == ("12-00-00", "12-00-00_2") and first.is_dir() and second.is_dir()


def test_an_interrupted_compare_leaves_no_half_run_and_says_the_time_first(tiny_root, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)

    def launch(cfg, run_dir, overrides=()):
        (run_dir / "rank_0.log").write_text("started\n")
        if cfg.mode.name == "ddp":
            raise KeyboardInterrupt  # Ctrl-C in the middle of the second run
        (run_dir / "results.json").write_text(json.dumps({"train_images_per_s": 1.0, "wall_time_s": 90.0}))

    monkeypatch.setattr(compare, "launch", launch)
    monkeypatch.setattr(compare, "loss_curve", lambda run_dir: {1: 1.0})
    with pytest.raises(SystemExit) as exit_:
        compare.main(["modes=[single,ddp]", "repeats=2", f"data.root={tiny_root}", "data.mirrors=[]"])
    assert exit_.value.code == 130
    (out,) = (tmp_path / "outputs" / "compare").glob("*/*")
    assert [p.name for p in out.iterdir()] == ["single"]  # complete; the interrupted ddp run is gone
    said = capsys.readouterr()
    assert "compare: 2 modes x 2 rounds = 4 runs" in said.out
    assert "compare: single took 0:01:30; the 3 runs left take about 0:04:30 at its pace" in said.out
    assert (
        said.err.strip().splitlines()[-1]
        == f"interrupted; no report written (the complete runs: {out.relative_to(tmp_path)})"
    )


def test_a_ctrl_c_as_a_run_starts_leaves_no_directory_for_it(tiny_root, tmp_path, monkeypatch):
    # The run's line is printed as it starts, and a Ctrl-C right after it (the reliability test's cue; a loaded
    # machine widened the gap) landed before the run was in its try: its empty directory stayed, and the
    # compare called it a complete run.
    def ctrl_c_at_the_run_line(*args, **kwargs):
        if str(args[0]).startswith("== round"):
            raise KeyboardInterrupt

    monkeypatch.setattr(compare, "launch", never)
    monkeypatch.setattr(compare, "print", ctrl_c_at_the_run_line, raising=False)
    configs = compare.compose_configs(["single"], [f"data.root={tiny_root}"])
    with pytest.raises(KeyboardInterrupt):
        compare.run_rounds(configs, 1, tmp_path / "out", lambda: 0.0)
    assert list((tmp_path / "out").iterdir()) == []
