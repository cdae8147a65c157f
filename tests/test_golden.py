"""A golden loss curve pins single mode's first 20 steps on generated data (tests/golden/single_loss.json): the drift
that every mode would share, as all are tested against single. A change that moves it on purpose regenerates it:

    MNIST_DIST_REGOLDEN=1 python -m pytest tests/test_golden.py
"""

import json
import os
from pathlib import Path

import torch
from helpers import scalars

from mnist_dist.launch import launch

GOLDEN = Path(__file__).parent / "golden" / "single_loss.json"
STEPS = ("epochs=1", "batch_size=32", "log_every=1")  # 640 generated images: 20 steps, dropout on


def test_single_mode_follows_the_golden_curve(make_config, tmp_path):
    launch(make_config(*STEPS), tmp_path)
    losses = scalars(tmp_path)["rank_0/train/loss"]
    assert len(losses) == 20
    if os.environ.get("MNIST_DIST_REGOLDEN"):
        GOLDEN.write_text(json.dumps({"overrides": STEPS, "train/loss": losses}, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert tuple(golden["overrides"]) == STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(golden["train/loss"]), rtol=0, atol=1e-6)
