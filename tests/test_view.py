"""What a person sees in TensorBoard after a sweep: one run per mode named by its mode first, the
comparison charts in CUSTOM SCALARS, every rank's numbers inside its run, every tag listed in docs/running.md."""

import re
import sys
from pathlib import Path

import pytest
from helpers import events

from mnist_dist import __main__ as command
from mnist_dist.operations.report import LAYOUT

TAGS_PAGE = Path(__file__).parent.parent / "docs" / "running.md"  # the page that lists every tag
GLOBAL_TAGS = {"train/loss_global", "perf/images_per_s_global", "test/accuracy", "test/loss"}


@pytest.mark.slow
def test_a_sweep_gives_one_comparable_run_per_mode(tiny_root, tmp_path, monkeypatch, cli_in_process):
    sweep = tmp_path / "sweep"
    overrides = ["mode=single,ddp", "gpus=2", "epochs=1", "log_every=5", "model._target_=failing_model.NarrowConvNet"]
    places = [f"data.root={tiny_root}", "data.mirrors=[]", f"hydra.sweep.dir={sweep}"]
    monkeypatch.setattr(sys, "argv", ["mnist_dist", "-m", *overrides, *places])
    command.main()  # a sweep that completes returns (cli_in_process: its signal handlers put back)
    named = "epochs=1,gpus=2,log_every=5,model._target_=failing_model.NarrowConvNet"  # Hydra's override_dirname
    names = [f"0_single_{named}", f"1_ddp_{named}"]
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == names
    single, ddp = (sweep / name for name in names)
    for run in (single, ddp):  # each run says its own directory (rank 0's log: what its console showed)
        assert f" INFO run directory: {run}\n" in (run / "rank_0.log").read_text()
    # TensorBoard's run list: one run per mode, i.e. event files in <run>/tb and nowhere else.
    assert {path.parent for path in sweep.rglob("events.out.tfevents.*")} == {ddp / "tb", single / "tb"}
    written, tensors = (set(events(ddp).Tags()[kind]) for kind in ("scalars", "tensors"))
    assert written >= GLOBAL_TAGS | {"rank_0/train/loss", "rank_1/train/loss"}
    assert "custom_scalars__config__" in tensors
    for charts in LAYOUT.values():  # every chart of the layout has something to show
        for title, (_, (regex,)) in charts.items():
            assert any(re.search(regex, tag) for tag in written), title
    listed = set(re.findall(r"`(?:rank_<r>/)?([a-z_]+/[a-z_]+)`", TAGS_PAGE.read_text()))
    named = {re.sub(r"^rank_\d+/", "", tag) for tag in written}
    assert named <= listed, sorted(named - listed)
