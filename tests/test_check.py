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


def report(capsys, *overrides):
    code = check.main(list(overrides))
    lines = capsys.readouterr().out.splitlines()
    return code, {line[6:].split("  ")[0].strip(): line for line in lines[1:-1]}, lines


@pytest.mark.slow
def test_an_unused_layer_fails_and_batchnorm_warns(capsys):
    code, checks, lines = report(capsys, "model._target_=test_check.BrokenNet", "~model.dropout")
    assert code == 1, "\n".join(lines)
    assert (
        checks["unused parameters"].startswith("FAIL") and "unused.weight, unused.bias" in checks["unused parameters"]
    )
    assert checks["batchnorm"].startswith("WARN") and "(features.1)" in checks["batchnorm"]
    assert "each rank's share of the batch" in checks["batchnorm"]
    assert checks["rank buffers"].startswith("WARN") and "features.1.running_mean" in checks["rank buffers"]
    # The unused layer is let through for the comparison (find_unused_parameters): the numbers agree.
    assert checks["ddp vs torch ddp"].startswith("OK") and "gradients agree within" in checks["ddp vs torch ddp"]
    assert checks["modes"].startswith("OK")
    assert checks["fsdp"].startswith("OK") and "gradients agree with torch DDP's" in checks["fsdp"]
    assert lines[-1] == "1 FAIL, 2 WARN: fix the FAILs before training"


@pytest.mark.slow
def test_the_convnet_passes_every_check(capsys):
    code, checks, lines = report(capsys)
    assert code == 0, "\n".join(lines)
    assert lines[0].startswith("checking mnist_dist.model.ConvNet (1,199,882 parameters)")
    assert list(checks) == [
        "modes",
        "unused parameters",
        "batchnorm",
        "determinism",
        "ddp vs torch ddp",
        "fsdp",
        "rank buffers",
    ]
    assert all(line.startswith("OK ") for line in checks.values()), "\n".join(lines)
    assert lines[-1] == "0 FAIL, 0 WARN: ready to train"


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
    assert status == "WARN" and unused == []
    assert why.startswith("other modes took a step; not usable as configured: dp_block (") and "'features'" in why


def test_a_model_that_cannot_be_built_is_one_line():
    with pytest.raises(SystemExit) as exit:
        check.main(["model._target_=test_check.NoSuchNet"])
    assert str(exit.value).startswith("error: ") and "NoSuchNet cannot be imported" in str(exit.value)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_usage(capsys, flag):
    assert check.main([flag]) == 0
    assert capsys.readouterr().out.startswith("Pre-flight check")


def test_the_batchnorm_warning_says_what_evaluation_and_checkpoints_use():
    # It said "evaluation runs on each rank's own": the trainer gives every rank rank 0's buffers before it
    # evaluates (step.evaluate_as_saved), so the reported accuracy is the checkpoint's.
    status, name, why = check._buffers({"differing": ["features.1.running_mean"], "buffers": 3})
    assert (status, name) == ("WARN", "rank buffers")
    assert "each rank's own" not in why
    assert "evaluation and checkpoints use rank 0's" in why
