"""A model class from the user's own package trains with the unchanged trainer and its checkpoint loads into the
bare class; synchronised BatchNorm on CPU."""

import importlib.util
import json
import sys

import pytest
import torch
from torch import nn

from mnist_dist import __main__ as command
from mnist_dist.model import FastNet
from mnist_dist.modes import DDPMode, _sync_batchnorm, wrap_model
from mnist_dist.parallel import unwrap
from mnist_dist.parallel.syncbn import SyncBatchNorm

USER_MODEL = '''
from torch import nn


class TinyNet(nn.Module):
    """Knows nothing of mnist_dist: a plain module with a constructor argument of its own."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.features = nn.Flatten()
        self.classifier = nn.Sequential(nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x):
        return self.classifier(self.features(x))
'''


@pytest.mark.slow
def test_a_model_from_the_users_own_package_trains_in_ddp(tiny_root, tmp_path, monkeypatch, cli_in_process):
    package = tmp_path / "userpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "net.py").write_text(USER_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))  # the spawned ranks start with the command's path
    user = ["model._target_=userpkg.net.TinyNet", "~model.dropout", "+model.hidden=32"]
    job = ["mode=ddp", "gpus=2", f"data.root={tiny_root}", "data.mirrors=[]", "progress=false", "epochs=2"]
    monkeypatch.setattr(sys, "argv", ["mnist_dist", *user, *job, "batch_size=32", f"hydra.run.dir={tmp_path}/run"])
    command.main()  # a run that completes returns (cli_in_process: its signal handlers put back)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert (results["world_size"], results["epochs"]) == (2, 2) and results["test_accuracy"] >= 0.9
    spec = importlib.util.spec_from_file_location("userpkg_net", package / "net.py")
    user_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(user_module)
    user_module.TinyNet(hidden=32).load_state_dict(torch.load(tmp_path / "run" / "model.pt"))


def test_sync_batchnorm_converts_the_layers_to_ours_on_cpu_and_torchs_on_cuda(one_rank, monkeypatch):
    def batchnorms(model):
        return [type(m) for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]

    plain = wrap_model(FastNet(), DDPMode(), torch.device("cpu"))
    assert batchnorms(plain) == [nn.BatchNorm2d] * 3
    for mode in (DDPMode("ddp", sync_batchnorm=True), DDPMode("torch_ddp", sync_batchnorm=True)):
        synced = wrap_model(FastNet(), mode, torch.device("cpu"))
        assert batchnorms(synced) == [SyncBatchNorm] * 3  # torch's raises on CPU tensors; ours runs on gloo
        FastNet().load_state_dict(unwrap(synced).state_dict())  # same keys as BatchNorm's
        synced(torch.randn(4, 1, 28, 28)).sum().backward()
    # On CUDA torch's SyncBatchNorm (faster kernels); the conversion is all that runs here without a GPU.
    monkeypatch.setattr(torch.nn.Module, "to", lambda self, *args, **kwargs: self)
    assert (
        batchnorms(_sync_batchnorm(FastNet(), DDPMode(sync_batchnorm=True), torch.device("cuda")))
        == [nn.SyncBatchNorm] * 3
    )
