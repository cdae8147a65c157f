"""A model that cannot be built is one line that says what to do."""

import pytest

from mnist_dist.config import ConfigError
from mnist_dist.model import instantiate_model


def test_a_factory_that_builds_no_module_is_one_line_naming_it():
    # the parent refuses a class that is no Module (config.validate); a factory is known by what it returns
    with pytest.raises(ConfigError, match="^model._target_=collections.OrderedDict built a OrderedDict, not a torch"):
        instantiate_model({"_target_": "collections.OrderedDict"})


def test_the_command_line_says_it_in_one_line(tiny_root, tmp_path, cli_in_process):
    overrides = ["model._target_=collections.OrderedDict", f"data.root={tiny_root}", "data.mirrors=[]"]
    code = cli_in_process(*overrides, f"hydra.run.dir={tmp_path / 'run'}")
    assert (
        code.startswith("error: model._target_=collections.OrderedDict is not a torch.nn.Module") and "\n" not in code
    )
    assert not (tmp_path / "run").exists()  # a run that failed to build leaves nothing behind
