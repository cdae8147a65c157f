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


class UnpoolNet(nn.Module):
    """MaxUnpool2d has no deterministic kernel, even on CPU; no `features` child for dp_block."""

    def __init__(self) -> None:
        super().__init__()
        self.pool, self.unpool = nn.MaxPool2d(2, return_indices=True), nn.MaxUnpool2d(2)
        self.classifier = nn.Linear(784, 10)

    def forward(self, x):
        return self.classifier(self.unpool(*self.pool(x)).flatten(1))


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


def test_an_op_without_a_deterministic_kernel_fails_unless_deterministic_is_off(make_config):
    cfg = make_config("model._target_=test_check.UnpoolNet", "~model.dropout")
    status, _, why = check.check_determinism(cfg)
    assert status == "FAIL" and why.startswith("max_unpooling2d_forward_out does not have a deterministic")
    cfg.deterministic = False
    assert check.check_determinism(cfg)[0] == "SKIP"


# In-process training runs before this one leave deterministic algorithms on with warn_only.
@pytest.mark.filterwarnings("ignore:max_unpooling2d_forward_out does not have a deterministic")
def test_modes_that_need_a_named_submodule_warn(make_config):
    (status, _, why), unused = check.check_modes(make_config("model._target_=test_check.UnpoolNet", "~model.dropout"))
    assert status == "WARN" and unused == [] and "dp_block (" in why and "'features'" in why


def test_a_model_that_cannot_be_built_is_one_line_and_help_is_the_usage(capsys):
    with pytest.raises(SystemExit, match="^error: .*NoSuchNet cannot be imported"):
        check.main(["model._target_=test_check.NoSuchNet"])
    assert check.main(["--help"]) == 0 and capsys.readouterr().out.startswith("Pre-flight check")
