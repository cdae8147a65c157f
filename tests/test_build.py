"""A model that cannot be built is one line that says what to do."""

import pytest

from mnist_dist.model import ConvNet, ModelError, instantiate_model


def test_the_default_model_builds():
    assert isinstance(instantiate_model({"_target_": "mnist_dist.model.ConvNet", "dropout": False}), ConvNet)


@pytest.mark.parametrize(
    "target, key",
    [
        ("my_pkg.models.MyNet", "cannot be imported .*PYTHONPATH="),
        ("torch.nn.Flatten", "takes no argument 'dropout'.*~model.dropout"),
        ("os.system", "is not allowed"),
        ("math.pi", "is not allowed"),
        ("collections.OrderedDict", "built an object of type OrderedDict, not a torch.nn.Module"),
    ],
)
def test_a_target_that_builds_no_model_is_one_line_naming_it(target, key):
    with pytest.raises(ModelError, match=f"^model._target_={target} {key}") as error:
        instantiate_model({"_target_": target, "dropout": True})
    assert "\n" not in str(error.value) and "ALLOWLIST" not in str(error.value)


def test_the_command_line_says_it_in_one_line(tiny_root, tmp_path, cli_in_process):
    overrides = ["model._target_=torch.nn.Flatten", f"data.root={tiny_root}", "data.mirrors=[]"]
    code = cli_in_process(*overrides, f"hydra.run.dir={tmp_path / 'run'}")
    assert code.startswith("error: model._target_=torch.nn.Flatten takes no argument 'dropout'") and "\n" not in code
    assert not (tmp_path / "run").exists()  # a run that failed to build leaves nothing behind
