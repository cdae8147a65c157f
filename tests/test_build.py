"""A model that cannot be built is one line that says what to do."""

import subprocess
import sys

import pytest

from mnist_dist.model import ConvNet, ModelError, instantiate_model


def test_the_default_model_builds():
    assert isinstance(instantiate_model({"_target_": "mnist_dist.model.ConvNet", "dropout": False}), ConvNet)


def test_a_module_that_cannot_be_imported_points_at_pythonpath():
    with pytest.raises(ModelError) as error:
        instantiate_model({"_target_": "my_pkg.models.MyNet", "dropout": True})
    assert str(error.value) == (
        "model._target_=my_pkg.models.MyNet cannot be imported (No module named 'my_pkg'); check the name, "
        "and make its module importable: usually PYTHONPATH=<the directory that holds the package> "
        "python -m mnist_dist ..."
    )


def test_a_constructor_without_dropout_suggests_leaving_it_out():
    with pytest.raises(ModelError) as error:
        instantiate_model({"_target_": "torch.nn.Flatten", "dropout": True})
    assert str(error.value) == (
        "model._target_=torch.nn.Flatten takes no argument 'dropout', which the model config passes; "
        "add ~model.dropout to the command line to leave it out"
    )


@pytest.mark.parametrize("target", ["os.system", "builtins.eval", "subprocess.Popen", "math.pi"])
def test_a_target_hydra_refuses_is_not_allowed_with_no_advice_to_lift_the_block(target):
    # issue 38: os.system was "failed: HYDRA_INSTANTIATE_ALLOWLIST_OVERRIDE.", which read like the way around it
    with pytest.raises(ModelError) as error:
        instantiate_model({"_target_": target, "dropout": True})
    assert str(error.value) == (
        f"model._target_={target} is not allowed: it is no model class, and Hydra refuses to call it from a config; "
        "name a torch.nn.Module class, e.g. mnist_dist.model.ConvNet"
    )


def test_a_target_that_builds_no_module_is_not_a_model():
    # issue 38: it failed in the worker, "AttributeError: 'collections.OrderedDict' object has no attribute 'to'"
    with pytest.raises(ModelError) as error:
        instantiate_model({"_target_": "collections.OrderedDict", "dropout": True})
    assert str(error.value) == (
        "model._target_=collections.OrderedDict built an object of type OrderedDict, not a torch.nn.Module; "
        "name a torch.nn.Module class, e.g. mnist_dist.model.ConvNet"
    )


def test_the_command_line_says_it_in_one_line(tiny_root, tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mnist_dist",
            "model._target_=torch.nn.Flatten",
            f"data.root={tiny_root}",
            "data.mirrors=[]",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "error: model._target_=torch.nn.Flatten takes no argument 'dropout', which the model config passes; "
        "add ~model.dropout to the command line to leave it out"
    )
    assert not (tmp_path / "run").exists()  # a run that failed to build leaves nothing behind
