"""The convnet of pytorch/examples mnist and FastNet (with BatchNorm), which know nothing of distribution
(mnist_dist.modes.wrap_model applies it); the model and the scheduler from the config."""

from __future__ import annotations

import inspect

import torch
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


def instantiate_model(model_cfg) -> nn.Module:
    """``instantiate(model_cfg)``, refused unless it built a Module (config.validate checked the rest)."""
    model = instantiate(model_cfg)
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model._target_={model_cfg['_target_']} built a {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def make_scheduler(
    scheduler_cfg, optimizer: torch.optim.Optimizer, total_steps: int
) -> tuple[torch.optim.lr_scheduler.LRScheduler, bool]:
    """The scheduler, and whether it steps after every optimizer step: one that takes ``total_steps``
    (OneCycleLR) plans the whole run's steps and is given them; the others step after every epoch."""
    factory = instantiate(scheduler_cfg)
    if "total_steps" in inspect.signature(factory.func).parameters:
        return factory(optimizer, total_steps=total_steps), True
    return factory(optimizer), False
