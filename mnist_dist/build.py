"""The model from ``cfg.model``, with Hydra's InstantiationException said in one line that says what to do;
the scheduler from ``cfg.scheduler``, stepped per epoch or per step.

Hydra's own messages ("Error locating target ..., set env var HYDRA_FULL_ERROR=1") name neither the
usual cause (the module is not on the path) nor the usual fix; the two mistakes people make when
pointing ``model._target_`` at their own class are a module Python cannot import and a constructor
that does not take the convnet's ``dropout`` argument.
"""

from __future__ import annotations

import inspect
import re

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from torch import nn

from mnist_dist.errors import ConfigError


class ModelError(ConfigError):
    """``model._target_`` or its arguments do not build a model; the message is one line."""


def instantiate_model(model_cfg) -> nn.Module:
    """``instantiate(model_cfg)``, or a ModelError that says what to change."""
    try:
        return instantiate(model_cfg)
    except InstantiationException as error:
        raise ModelError(describe(error, model_cfg["_target_"])) from error


def describe(error: InstantiationException, target: str) -> str:
    cause = error.__cause__
    text = str(cause or error)
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
