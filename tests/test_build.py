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
