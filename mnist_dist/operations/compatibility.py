"""What a resume runs with (``resumed_config``) and whether the checkpoint may resume it, checked in the
parent before anything is written. The checkpoint's config is read as plain YAML (``yaml.safe_load``): no
interpolation, no resolver.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch
import yaml
from hydra.utils import instantiate
from omegaconf import OmegaConf

from mnist_dist.config import Config
from mnist_dist.model import make_scheduler
from mnist_dist.modes import MODES, world_size
from mnist_dist.operations.errors import ConfigError
from mnist_dist.parallel.state import load_optimizer_state

log = logging.getLogger("mnist_dist")

REFUSED = "resume: the checkpoint's config is not a mnist_dist config; resume another checkpoint.pt"


# The keys that name a group's class: another class brings its own keys
CLASS_KEYS = {"mode.name", "model._target_", "optim._target_", "scheduler._target_"}


def saved_config(state: dict) -> dict:
    """The checkpoint's config as plain data, never through OmegaConf, whose interpolations and resolvers
    (``${oc.env:...}``, or any registered resolver) a crafted file would run; refused unless the settings the
    resume checks read are there, of their types."""
    try:
        saved = yaml.safe_load(state["config"])  # plain data only
        read = (saved["model"], saved["batch_size"], saved["epochs"], saved["data"]["name"], saved["mode"]["name"])
    except Exception:  # not YAML, not a mapping, a key missing: the same to the user
        read = ()
    if tuple(map(type, read)) != (dict, int, int, str, str):  # bool is no batch size
        raise ConfigError(REFUSED)
    return saved


def resumed_config(state: dict, cfg: Config, overrides: Sequence[str] = ()) -> Config:
    """The checkpoint's own config, with the settings this command's ``overrides`` (Hydra's, as launch passes
    them) name. A group whose class they change (``model=fastnet``) is the command's whole; so is everything
    for ``recipe=``, whose package is the whole config."""
    saved, mine = saved_config(state), dataclasses.asdict(cfg)
    if "${" in str(saved):  # an interpolation is never resolved: refused
        raise ConfigError(REFUSED)
    keys = {arg.lstrip("~+").split("=", 1)[0] for arg in overrides}
    keys = set(mine) if "recipe" in keys else {key.split(".")[0] if key in CLASS_KEYS else key for key in keys}
    try:
        for key in (key for key in keys if key.split(".")[0] in mine):  # hydra.*: Hydra's, not the run's
            *parents, last = key.split(".")
            source, target = mine, saved
            for parent in parents:
                source, target = source.get(parent, {}), target.setdefault(parent, {})
            if last in source:
                target[last] = source[last]
            else:  # ~model.dropout
                target.pop(last, None)
        conf = OmegaConf.structured(Config)
        name = saved["mode"]["name"]
        conf.mode = OmegaConf.merge(OmegaConf.structured(MODES[name].schema(name=name)), saved.pop("mode"))
        return OmegaConf.to_object(OmegaConf.merge(conf, saved))  # typed: a wrong type or unknown key fails
    except Exception:
        raise ConfigError(REFUSED) from None


_NONE = object()


def _settings(model: dict, batch_size: int, data: str) -> dict[str, Any]:
    return {**{f"model.{key}": value for key, value in model.items()}, "batch_size": batch_size, "data.name": data}


def check_resumable(state: dict, cfg: Config) -> None:
    """Refuses, before anything is written, a resume with another model, global batch or data (unless told to)
    or one the run could not restore; another mode or world size is said in one line."""
    saved = saved_config(state)
    before = _settings(saved["model"], saved["batch_size"], saved["data"]["name"])
    after = _settings(cfg.model, cfg.batch_size, cfg.data.name)
    changed = [path for path in {**before, **after} if before.get(path, _NONE) != after.get(path, _NONE)]
    if changed and not cfg.resume_allow_changes:
        # repr, at most 200 characters: a crafted value must not break the one line, nor fill a screen
        changes = "; ".join(f"{path} {before.get(path)!r:.200} -> {after.get(path)!r:.200}" for path in changed)
        raise ConfigError(
            f"resume: this command changes what the checkpoint was trained with ({changes}); leave that out to go on "
            "with the run's own, or add resume_allow_changes=true if it is intended"
        )
    if _check_restorable(state, cfg):
        _check_plan(state, saved, cfg)
    if state["epoch"] >= cfg.epochs:
        raise ConfigError(
            f"resume: the checkpoint has finished epoch {state['epoch']} of {cfg.epochs}; "
            f"pass epochs={state['epoch'] + 1} or more to train further"
        )
    # Another mode or world size is no change, only said: the global batches, and so the training, are the same.
    now, then = (cfg.mode.name, world_size(cfg)), (saved["mode"]["name"], state["world_size"])  # gpus: what runs
    if now != then:
        said = (
            "resuming with mode=%s on %d ranks a checkpoint written with mode=%s on %d: the same global batches follow"
        )
        log.info(said, *now, *then)


def _check_plan(state: dict, saved: dict, cfg: Config) -> None:
    # A schedule over all steps (OneCycleLR) plans the checkpoint's epochs x steps per epoch: resumed with
    # another length it would step past its plan (an error after the run directory was written to) or stop short.
    if state["epoch"] >= saved["epochs"] or (saved["epochs"], saved["batch_size"]) != (cfg.epochs, cfg.batch_size):
        name = str(cfg.scheduler.get("_target_", "scheduler")).rsplit(".", 1)[-1]
        raise ConfigError(
            f"resume: the checkpoint's {name} plans the learning rate over epochs={saved['epochs']} at batch_size="
            f"{saved['batch_size']}, {state['epoch']} of them done; a schedule over all steps cannot change length: "
            "resume a checkpoint from before its end with those settings, or start a new run"
        )


def _check_restorable(state: dict, cfg: Config) -> bool:
    # What train does on resume, on the CPU: what does not fit fails now, in one line, not in every worker after
    # the run directory was written to. Returns whether the scheduler steps every step (then: _check_plan).
    try:
        model = instantiate(cfg.model)
        model.load_state_dict(state["model"])
        optimizer = instantiate(cfg.optim)(model.parameters())
        # total_steps: any plan; OneCycleLR's state holds the run's own. Made before the optimizer's state is
        # loaded, as train does: the saved param_groups hold the initial_lr that a scheduler adds.
        scheduler, per_step = make_scheduler(cfg.scheduler, optimizer, cfg.epochs)
        load_optimizer_state(model, optimizer, state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.amp.GradScaler("cpu", enabled=cfg.amp == "fp16").load_state_dict(state["scaler"])  # fp16's loss scale
    except Exception as error:
        detail = str(error).strip().splitlines()[0] if str(error).strip() else "no detail"
        raise ConfigError(
            f"resume: the checkpoint does not fit model={cfg.model.get('_target_')} with optim="
            f"{cfg.optim.get('_target_')}, amp={cfg.amp} ({type(error).__name__}: {detail.rstrip(':')}); resume with "
            "the settings it was trained with"
        ) from None
    return per_step
