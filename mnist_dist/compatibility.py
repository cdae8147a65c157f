"""Whether a checkpoint may resume this config, checked in the parent before anything is written: the
same model, global batch and data (unless told otherwise), weights and optimizer state that fit, a
schedule over all steps of the same length, epochs left to train.

The checkpoint's config is read as plain YAML (``saved_settings``): no interpolation, no resolver, no
alias, bounded in size.
"""

from __future__ import annotations

from typing import Any

import yaml
from hydra.utils import instantiate

from mnist_dist.build import make_scheduler
from mnist_dist.config import Config
from mnist_dist.errors import ConfigError

CONFIG_BYTES = 2**20  # a saved config is about 2 KB; a larger one is not mnist_dist's


class _Aliased(Exception):
    pass


class _PlainYaml(yaml.SafeLoader):
    """YAML as plain data and without aliases: mnist_dist writes none, and a few hundred bytes of nested
    aliases expand to billions of nodes (a "billion laughs") in whatever walks the result."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise _Aliased
        return super().compose_node(parent, index)


def saved_settings(state: dict) -> dict:
    """What the resume check compares, from the checkpoint's config read as plain data: model, batch_size,
    epochs and the data set's name. Never through OmegaConf, whose interpolations and resolvers
    (``${oc.env:...}``, or mnist_dist's ``unique_dir``, which creates directories) a crafted file would run."""
    text, refused = state["config"], "resume: the checkpoint's config {}; resume another checkpoint.pt"
    if len(text.encode()) > CONFIG_BYTES:
        raise ConfigError(refused.format("is over 1 MiB, far more than mnist_dist writes"))
    try:
        saved = yaml.load(text, Loader=_PlainYaml)  # a SafeLoader: plain data only
        settings = {key: saved[key] for key in ("model", "batch_size", "epochs")} | {"data": saved["data"]["name"]}
    except _Aliased:
        raise ConfigError(refused.format("uses YAML aliases, which mnist_dist never writes")) from None
    except Exception:  # not YAML, not a mapping, a key missing, nested too deep: the same to the user
        settings = {}
    kinds = {"model": dict, "batch_size": int, "epochs": int, "data": str}
    if not all(type(settings.get(key)) is kind for key, kind in kinds.items()):  # bool is no batch size
        raise ConfigError(refused.format("is not a mnist_dist config"))
    return settings


def check_resumable(state: dict, cfg: Config) -> None:
    """Refuses to continue a run with a different model, global batch or data, unless told to, and anything
    the run could not restore: checked before anything is written. Another world size is no change: the
    global batches, and so the training, are the same at every world size that divides the batch."""
    saved = saved_settings(state)
    compared = [
        ("model", saved["model"], cfg.model),
        ("batch_size", saved["batch_size"], cfg.batch_size),
        ("data", saved["data"], cfg.data.name),
    ]
    changes = [f"{key} {_shown(before)} -> {_shown(after)}" for key, before, after in compared if before != after]
    if changes and not cfg.resume_allow_changes:
        raise ConfigError(
            f"resume: the checkpoint was trained with other settings ({'; '.join(changes)}); "
            "use the same settings, or resume_allow_changes=true if that is intended"
        )
    if _check_restorable(state, cfg):
        _check_plan(state, saved, cfg)
    if state["epoch"] >= cfg.epochs:
        raise ConfigError(
            f"resume: the checkpoint has finished epoch {state['epoch']} of {cfg.epochs}; "
            f"pass epochs={state['epoch'] + 1} or more to train further"
        )
    if cfg.amp == "fp16" and not state["scaler"]:
        raise ConfigError(
            "resume: the checkpoint holds no fp16 loss scale (written with amp=off or bf16); resume with the amp "
            "it was trained with"
        )


def _shown(value: Any) -> str:
    text = str(value).replace("\n", "\\n")  # a crafted value must not break the one line, nor fill a screen
    return text if len(text) <= 200 else f"{text[:200]}..."


def _check_plan(state: dict, saved: dict, cfg: Config) -> None:
    # A schedule over all steps (OneCycleLR) plans the checkpoint's epochs x steps per epoch. Resumed with
    # another length it would step past its plan (an error after the run directory was written to) or
    # stop short of it.
    name = str(cfg.scheduler.get("_target_", "scheduler")).rsplit(".", 1)[-1]
    if state["epoch"] >= saved["epochs"]:
        raise ConfigError(
            f"resume: the checkpoint has finished epoch {state['epoch']} of {saved['epochs']}, and its {name} "
            "schedule ended there; start a new run to train longer"
        )
    if (saved["epochs"], saved["batch_size"]) != (cfg.epochs, cfg.batch_size):
        raise ConfigError(
            f"resume: the checkpoint's {name} plans the learning rate over epochs={saved['epochs']} at "
            f"batch_size={saved['batch_size']}, this run over epochs={cfg.epochs} at batch_size={cfg.batch_size}; "
            f"a schedule over all steps cannot change length: resume with epochs={saved['epochs']} "
            f"batch_size={saved['batch_size']}, or start a new run"
        )


def _check_restorable(state: dict, cfg: Config) -> bool:
    # What train does on resume, done here on the CPU: a model or optimizer that does not fit fails
    # now, with one line, not in every worker after the run directory was written to. Returns whether
    # the scheduler steps after every step (it then plans the whole run: _check_plan).
    try:
        model = instantiate(cfg.model)
        model.load_state_dict(state["model"])
        optimizer = instantiate(cfg.optim)(model.parameters())
        optimizer.load_state_dict(state["optimizer"])
        # total_steps: any plan; OneCycleLR's state holds the run's own
        scheduler, per_step = make_scheduler(cfg.scheduler, optimizer, cfg.epochs)
        scheduler.load_state_dict(state["scheduler"])
    except Exception as error:
        detail = str(error).strip().splitlines()[0] if str(error).strip() else "no detail"
        raise ConfigError(
            f"resume: the checkpoint does not fit model={cfg.model.get('_target_')} with optim="
            f"{cfg.optim.get('_target_')} ({type(error).__name__}: {detail.rstrip(':')}); resume with the model and "
            "optimizer it was trained with"
        ) from None
    return per_step
