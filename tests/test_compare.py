"""compare under a busy machine: interleaved rounds, median and spread of images/s, and a warning."""

import json
import statistics

import pytest
from helpers import assert_machine_fields

from mnist_dist.console import config_line
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


def test_modes_take_a_comma_list_as_a_sweep_does(tiny_root, monkeypatch):
    seen = []

    def rounds(configs, *args):
        seen.extend(configs)
        raise Stop

    monkeypatch.setattr(compare, "run_rounds", rounds)
    with pytest.raises(Stop):
        compare.main(["modes=single,ddp", f"data.root={tiny_root}", "data.mirrors=[]"])
    assert seen == ["single", "ddp"]


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
