"""The pre-flight check flags what would go wrong in distributed training, and passes the convnet."""

import pytest
from torch import nn

from mnist_dist.tools import check


class BrokenNet(nn.Module):
    """A layer that forward never uses, and BatchNorm: two things the check must report."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, stride=2), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten())
        self.unused = nn.Linear(4, 4)
        self.classifier = nn.Linear(4 * 13 * 13, 10)

    def forward(self, x):
        return self.classifier(self.features(x))


@pytest.mark.slow
def test_an_unused_layer_fails_batchnorm_warns_and_the_ddps_agree(capsys):
    code = check.main(["model._target_=test_check.BrokenNet", "~model.dropout"])
    lines = capsys.readouterr().out.splitlines()
    checks = {line[6:].split("  ")[0].strip(): line for line in lines[1:-1]}
    assert code == 1 and lines[0].startswith("checking test_check.BrokenNet"), "\n".join(lines)
    assert (
        checks["unused parameters"].startswith("FAIL") and "unused.weight, unused.bias" in checks["unused parameters"]
    )
    assert checks["batchnorm"].startswith("WARN") and "(features.1)" in checks["batchnorm"]
    assert checks["rank buffers"].startswith("WARN") and "features.1.running_mean" in checks["rank buffers"]
    assert "checkpoints use rank 0's" in checks["rank buffers"]  # what the trainer evaluates and saves
    # The unused layer is let through for the comparison (find_unused_parameters): the numbers agree.
    for ok in ("modes", "determinism", "ddp vs torch ddp", "fsdp vs torch ddp", "fsdp state"):
        assert checks[ok].startswith("OK"), checks[ok]
    assert lines[-1].startswith("1 FAIL, 2 WARN")


def test_a_model_that_cannot_be_built_is_one_line_and_help_is_the_usage(capsys):
    with pytest.raises(SystemExit, match="^error: .*NoSuchNet cannot be imported"):
        check.main(["model._target_=test_check.NoSuchNet"])
    assert check.main(["--help"]) == 0 and capsys.readouterr().out.startswith("Pre-flight check")
