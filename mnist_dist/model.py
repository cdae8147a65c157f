"""The convnet of pytorch/examples mnist, a small ResNet with BatchNorm and FastNet, which know nothing of
distribution (mnist_dist.modes.wrap_model applies it); the model and the scheduler from the config."""

from __future__ import annotations

import inspect
import re

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from torch import Tensor, nn

from mnist_dist.operations.errors import ConfigError


class ConvNet(nn.Module):
    """conv 1→32, conv 32→64, maxpool, dropout .25, fc 9216→128, dropout .5, fc 128→10; returns logits.
    ``dropout=False``: replicas that draw their own masks compute exactly what a single process would."""

    def __init__(self, dropout: bool = True) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Dropout(0.25 if dropout else 0.0),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(
            nn.Linear(9216, 128),
            nn.ReLU(),
            nn.Dropout(0.5 if dropout else 0.0),
            nn.Linear(128, 10),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class ResidualBlock(nn.Module):
    """Two 3×3 conv + BatchNorm layers and a shortcut (a 1×1 conv where the shape changes)."""

    def __init__(self, channels_in: int, channels_out: int, stride: int = 1) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels_in, channels_out, 3, stride, padding=1, bias=False),
            nn.BatchNorm2d(channels_out),
            nn.ReLU(),
            nn.Conv2d(channels_out, channels_out, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels_out),
        )
        self.shortcut = (
            nn.Identity()
            if stride == 1 and channels_in == channels_out
            else nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False), nn.BatchNorm2d(channels_out)
            )
        )

    def forward(self, x: Tensor) -> Tensor:
        return (self.body(x) + self.shortcut(x)).relu()


class ResNet(nn.Module):
    """A small ResNet for 28×28 images: a stem, three residual stages (28→14→7), a linear classifier. Its
    BatchNorm normalises each rank's share (ddp differs slightly from single; see mode.sync_batchnorm)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            ResidualBlock(width, width),
            ResidualBlock(width, 2 * width, stride=2),
            ResidualBlock(2 * width, 4 * width, stride=2),
            nn.Flatten(),
        )
        # A linear layer over the whole 7×7 map rather than ImageNet ResNets' global average pool,
        # which would throw away *where* strokes are: small images, and position carries the class.
        self.classifier = nn.Linear(4 * width * 7 * 7, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class FastNet(nn.Module):
    """Three stages of conv 3×3 → maxpool → BatchNorm → ReLU (28→14→7→3) and a linear classifier: the
    ``recipe=fast`` net. Each stage pools right after its convolution (as airbench does), so the elementwise
    layers, most of a narrow net's time on a CPU, touch a quarter of the pixels."""

    def __init__(self, widths: tuple[int, int, int] = (24, 48, 96)) -> None:
        super().__init__()
        layers, channels_in = [], 1
        for channels in widths:
            layers += [
                nn.Conv2d(channels_in, channels, 3, padding=1, bias=False),
                nn.MaxPool2d(2),
                nn.BatchNorm2d(channels),
                nn.ReLU(),
            ]
            channels_in = channels
        self.features = nn.Sequential(*layers, nn.Flatten())
        self.classifier = nn.Linear(widths[-1] * 3 * 3, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class ModelError(ConfigError):
    """``model._target_`` or its arguments do not build a model; one line that names the usual cause (a module
    Python cannot import, a constructor without the convnet's dropout), which Hydra's own messages do not."""


_NAME_A_MODULE = "name a torch.nn.Module class, e.g. mnist_dist.model.ConvNet"


def instantiate_model(model_cfg) -> nn.Module:
    """``instantiate(model_cfg)``, or a ModelError that says what to change."""
    try:
        model = instantiate(model_cfg)
    except InstantiationException as error:
        raise ModelError(describe(error, model_cfg["_target_"])) from error
    if not isinstance(model, nn.Module):
        built = f"built an object of type {type(model).__name__}, not a torch.nn.Module"
        raise ModelError(f"model._target_={model_cfg['_target_']} {built}; {_NAME_A_MODULE}")
    return model


def describe(error: InstantiationException, target: str) -> str:
    cause = error.__cause__
    if cause is None:  # Hydra refused the target itself: its text tells how to lift its block, which is no advice
        refused = "is not allowed: it is no model class, and Hydra refuses to call it from a config"
        return f"model._target_={target} {refused}; {_NAME_A_MODULE}"
    text = str(cause)
    if isinstance(cause, ImportError):
        # Hydra wraps the real error: 'Error loading ...:\nModuleNotFoundError("No module named ...")'
        inner = re.search(r'\w+Error\("(.+)"\)', text)
        return (
            f"model._target_={target} cannot be imported ({inner.group(1) if inner else text.splitlines()[0]}); "
            "check the name, and make its module importable: usually PYTHONPATH=<the directory that "
            "holds the package> python -m mnist_dist ..."
        )
    unexpected = re.search(r"unexpected keyword argument '(\w+)'", text)
    if unexpected:
        key = unexpected.group(1)
        return (
            f"model._target_={target} takes no argument {key!r}, which the model config passes; "
            f"add ~model.{key} to the command line to leave it out"
        )
    return f"model._target_={target} failed: {text.splitlines()[-1] if text else type(cause).__name__}"


def make_scheduler(
    scheduler_cfg, optimizer: torch.optim.Optimizer, total_steps: int
) -> tuple[torch.optim.lr_scheduler.LRScheduler, bool]:
    """The scheduler, and whether it steps after every optimizer step: one that takes ``total_steps``
    (OneCycleLR) plans the whole run's steps and is given them; the others step after every epoch."""
    factory = instantiate(scheduler_cfg)
    if "total_steps" in inspect.signature(factory.func).parameters:
        return factory(optimizer, total_steps=total_steps, **_one_cycle_fix(factory, total_steps)), True
    return factory(optimizer), False


def _one_cycle_fix(factory, total_steps: int) -> dict:
    # OneCycleLR's warm-up ends at step pct_start x total_steps - 1, and torch divides by that length: a
    # warm-up of one step (0.25 x 4: recipe=fast at 4 epochs of 1 step) ends at step 0 and raises
    # ZeroDivisionError. A warm-up that ends just before step 0 is the same schedule (step 0 at the peak).
    if not (isinstance(factory.func, type) and issubclass(factory.func, torch.optim.lr_scheduler.OneCycleLR)):
        return {}
    pct_start = factory.keywords.get("pct_start", 0.3)
    if factory.keywords.get("three_phase") or float(pct_start * total_steps) - 1 != 0:
        return {}
    return {"pct_start": pct_start * (1 - 1e-9)}
