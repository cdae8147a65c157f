"""What a resume runs with (``resumed_config``) and whether the checkpoint may resume it, checked in the
parent before anything is written."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import yaml
from omegaconf import OmegaConf

from mnist_dist.config import Config
from mnist_dist.modes import MODES, world_size
from mnist_dist.operations.errors import ConfigError

log = logging.getLogger("mnist_dist")

REFUSED = "resume: the checkpoint's config is not a mnist_dist config; resume another checkpoint.pt"


def saved_config(state: dict) -> dict:
    """The checkpoint's config as plain data (``yaml.safe_load``), never through OmegaConf, whose interpolations
    and resolvers (``${oc.env:...}``) a crafted file would run: one is refused."""
    saved = yaml.safe_load(state["config"])
    if "${" in str(saved):
        raise ConfigError(REFUSED)
    return saved


def resumed_config(state: dict, cfg: Config, overrides: Sequence[str] = ()) -> Config:
    """The checkpoint's own config, with the settings this command's ``overrides`` (Hydra's) name taken from
    ``cfg``. A group they choose (``model=fastnet``) is the command's whole; so is everything for ``recipe=``,
    whose package is the whole config."""
    mine = dataclasses.asdict(cfg)
    keys = {arg.lstrip("~+").split("=", 1)[0] for arg in overrides}
    try:
        saved = saved_config(state)
        for key in mine if "recipe" in keys else [key for key in keys if key.split(".")[0] in mine]:  # not hydra.*
            *parents, last = key.split(".")
            source, target = mine, saved
            for parent in parents:
                source, target = source.get(parent, {}), target.setdefault(parent, {})
            if last in source:
                target[last] = source[last]
            else:  # ~model.dropout
                target.pop(last, None)
        name = saved["mode"]["name"]
        conf = OmegaConf.structured(Config(mode=MODES[name].schema(name=name)))
        return OmegaConf.to_object(OmegaConf.merge(conf, saved))  # typed: a wrong type or unknown key fails
    except Exception:  # no config, not YAML, not a mapping, a key missing, a value of another type
        raise ConfigError(REFUSED) from None


def _trained_with(model: dict, batch_size: int, data: str) -> dict:
    return {**{f"model.{key}": value for key, value in model.items()}, "batch_size": batch_size, "data.name": data}


def check_resumable(state: dict, cfg: Config) -> None:
    """Refuses, before anything is written, a resume with another model, global batch or data (unless told to);
    another mode or world size is said in one line. A checkpoint that does not fit the model, optimizer or amp
    fails as the worker loads it, before it writes anything."""
    saved = saved_config(state)
    before = _trained_with(saved["model"], saved["batch_size"], saved["data"]["name"])
    after = _trained_with(cfg.model, cfg.batch_size, cfg.data.name)
    changed = [key for key in {**before, **after} if before.get(key) != after.get(key)]
    if changed and not cfg.resume_allow_changes:
        changes = "; ".join(f"{key} {before.get(key)!r} -> {after.get(key)!r}" for key in changed)
        raise ConfigError(
            f"resume: this command changes what the checkpoint was trained with ({changes}); leave that out to go on "
            "with the run's own, or add resume_allow_changes=true if it is intended"
        )
    if state["epoch"] >= cfg.epochs:
        raise ConfigError(
            f"resume: the checkpoint has finished epoch {state['epoch']} of {cfg.epochs}; "
            f"pass epochs={state['epoch'] + 1} or more to train further"
        )
    # Another mode or world size is no change, only said: the global batches, and so the training, are the same.
    now, then = (cfg.mode.name, world_size(cfg)), (saved["mode"]["name"], state["world_size"])
    if now != then:
        log.info("resuming with mode=%s on %d ranks a checkpoint written with mode=%s on %d", *now, *then)
