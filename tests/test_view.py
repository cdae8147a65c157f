"""What a person sees in TensorBoard after a sweep: one run per mode named by its mode first, the
comparison charts in CUSTOM SCALARS, other ranks nested below, and every tag listed in the README."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mnist_dist.metrics import LAYOUT, tb_dir

README = Path(__file__).parent.parent / "README.md"
GLOBAL_TAGS = {"train/loss_global", "perf/images_per_s_global", "test/accuracy", "test/loss"}


def tags(path: Path) -> tuple[set[str], set[str]]:
    """(scalar tags, tensor tags) of the TensorBoard run in ``path``."""
    events = EventAccumulator(str(path))
    events.Reload()
    return set(events.Tags()["scalars"]), set(events.Tags()["tensors"])


@pytest.mark.slow
def test_a_sweep_gives_one_comparable_run_per_mode(tiny_root, tmp_path):
    sweep = tmp_path / "sweep"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mnist_dist",
            "-m",
            "mode=single,ddp",
            "gpus=2",
            "epochs=1",
            "log_every=5",
            f"data.root={tiny_root}",
            "data.mirrors=[]",
            f"hydra.sweep.dir={sweep}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == [
        "ddp_epochs=1,gpus=2,log_every=5",
        "single_epochs=1,gpus=2,log_every=5",
    ]
    ddp, single = sweep / "ddp_epochs=1,gpus=2,log_every=5", sweep / "single_epochs=1,gpus=2,log_every=5"
    assert tb_dir(ddp, 0) == ddp / "tb" and tb_dir(ddp, 1) == ddp / "tb" / "rank_1"
    assert not (single / "tb" / "rank_1").exists()
    rank0, tensors = tags(tb_dir(ddp, 0))
    rank1, _ = tags(tb_dir(ddp, 1))
    assert rank0 >= GLOBAL_TAGS and not GLOBAL_TAGS & rank1  # the open charts hold one line per mode
    assert "custom_scalars__config__" in tensors
    for _, _, charts in LAYOUT:  # every chart of the layout has something to show
        for title, regex in charts:
            assert any(re.search(regex, tag) for tag in rank0 | rank1), title
    listed = set(re.findall(r"`([a-z_]+/[a-z_]+)`", README.read_text()))
    assert rank0 | rank1 <= listed, sorted((rank0 | rank1) - listed)
