import os
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from mnist_dist.synthetic import write_idx

# Spawned ranks unpickle test functions by module name, and workers import test models by
# _target_: keep tests/ importable as a plain folder, in this process and in subprocesses.
TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))

FASHION = Path("/usr/share/datasets/fashion-mnist")


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    """A data.root holding tiny learnable data as data=mnist (640 train, 200 test images)."""
    root = tmp_path_factory.mktemp("data")
    write_idx(root / "MNIST" / "raw")
    return root


def compose_config(data_root: Path, *overrides: str):
    """The Config the CLI would run with these overrides, on the data in ``data_root``, no bar."""
    with initialize_config_module("mnist_dist.conf", version_base="1.3"):
        cfg = compose("config", overrides=[f"data.root={data_root}", "data.mirrors=[]", "progress=false", *overrides])
    return OmegaConf.to_object(cfg)


@pytest.fixture
def make_config(tiny_root):
    """make_config("mode=ddp", ...) -> compose_config on the tiny data."""
    return lambda *overrides: compose_config(tiny_root, *overrides)
