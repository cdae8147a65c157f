"""What a resume runs with (``resumed_config``) and whether the checkpoint may resume it, checked in the
parent before anything is written. The checkpoint's config is read as plain YAML (``yaml.safe_load``): no
interpolation, no resolver.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import yaml
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from omegaconf import OmegaConf

from mnist_dist.config import Config
from mnist_dist.model import make_scheduler
from mnist_dist.modes import MODES, world_size
from mnist_dist.operations.errors import ConfigError
from mnist_dist.parallel.state import load_optimizer_state

log = logging.getLogger("mnist_dist")

REFUSED = "resume: the checkpoint's config {}; resume another checkpoint.pt"


# The key that names a group's class: another class brings its own keys
GROUPS = {"mode": "name", "model": "_target_", "optim": "_target_", "scheduler": "_target_"}


def _plain(state: dict) -> Any:
    try:
        return yaml.safe_load(state["config"])  # plain data only
    except Exception:  # not YAML: the same to the user as a config of another program
        return None


def saved_settings(state: dict) -> dict:
    """What the resume check compares, from the checkpoint's config read as plain data: model, batch_size,
    epochs, the data set's name and the mode's. Never through OmegaConf, whose interpolations and resolvers
    (``${oc.env:...}``, or any registered resolver) a crafted file would run."""
    saved = _plain(state)
    try:
        settings = {key: saved[key] for key in ("model", "batch_size", "epochs")}
        settings |= {"data": saved["data"]["name"], "mode": saved["mode"]["name"]}
    except Exception:  # not a mapping, a key missing: the same to the user
        settings = {}
    kinds = {"model": dict, "batch_size": int, "epochs": int, "data": str, "mode": str}
    if not all(type(settings.get(key)) is kind for key, kind in kinds.items()):  # bool is no batch size
        raise ConfigError(REFUSED.format("is not a mnist_dist config"))
    return settings


def resumed_config(state: dict, cfg: Config, named: Sequence[str] = ()) -> Config:
    """The checkpoint's own config, with what this command sets: the settings in which ``cfg`` differs from
    the defaults, and those ``named`` on its command line (``epochs=14`` is set, though it is the default).
    A group whose class the command changes (``model=resnet``) is the command's whole."""
    saved_settings(state)  # the parts every check reads are there, of their types
    saved, mine, default = _plain(state), _leaves(_container(cfg)), _leaves(_container(_defaults()))
    keys = {arg.lstrip("~+").split("=", 1)[0] for arg in named}
    on_command_line = {path for path in mine if any(path == key or path.startswith(f"{key}.") for key in keys)}
    chosen = {path for path in mine if mine[path] != default.get(path, _NONE) or path in on_command_line}
    chosen |= {path for path in default if path not in mine}  # ~model.dropout
    replaced = {group for group, key in GROUPS.items() if f"{group}.{key}" in chosen}
    merged = {path: value for path, value in _leaves(saved).items() if path.split(".")[0] not in replaced}
    merged |= {path: mine[path] for path in mine if path in chosen or path.split(".")[0] in replaced}
    merged = {path: value for path, value in merged.items() if path in mine or path not in chosen}
    merged["resume"] = cfg.resume
    if any("${" in str(part) for item in merged.items() for part in item):  # never resolved: refused
        raise ConfigError(REFUSED.format("is not a mnist_dist config"))
    try:
        tree = _tree(merged)
        conf = OmegaConf.structured(Config)
        name = tree["mode"]["name"]
        conf.mode = OmegaConf.merge(OmegaConf.structured(MODES[name].schema(name=name)), tree.pop("mode"))
        return OmegaConf.to_object(OmegaConf.merge(conf, tree))  # typed: a wrong type or unknown key fails
    except Exception:
        raise ConfigError(REFUSED.format("is not a mnist_dist config")) from None


_NONE = object()


def _defaults() -> Config:
    if GlobalHydra.instance().is_initialized():  # in the command's own Hydra job
        return OmegaConf.to_object(compose("config"))
    with initialize_config_module("mnist_dist.conf", version_base="1.3"):
        return OmegaConf.to_object(compose("config"))


def _container(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"model._target_": ..., "data.name": ...}``: the settings of a config tree by dotted path."""
    if not isinstance(tree, dict) or (prefix and not tree):
        return {prefix[:-1]: tree} if prefix else {}
    return {path: v for key, value in tree.items() for path, v in _leaves(value, f"{prefix}{key}.").items()}


def _tree(leaves: dict[str, Any]) -> dict:
    tree: dict = {}
    for path, value in leaves.items():
        *parents, key = path.split(".")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[key] = value
    return tree


def check_resumable(state: dict, cfg: Config) -> None:
    """Refuses to continue a run with a different model, global batch or data, unless told to, and anything
    the run could not restore: checked before anything is written, on a config that passed config.validate.
    Another mode or world size is said in one line."""
    saved = saved_settings(state)
    before = _leaves({"model": saved["model"], "batch_size": saved["batch_size"], "data": {"name": saved["data"]}})
    after = _leaves({"model": _container(cfg)["model"], "batch_size": cfg.batch_size, "data": {"name": cfg.data.name}})
    changed = [path for path in {**before, **after} if before.get(path, _NONE) != after.get(path, _NONE)]
    if changed and not cfg.resume_allow_changes:
        changes = "; ".join(f"{path} {_shown(before, path)} -> {_shown(after, path)}" for path in changed)
        whole = "model" if "model._target_" in changed else None  # another class: leave out model=...
        names = list(dict.fromkeys(whole if path.startswith("model.") and whole else path for path in changed))
        try:
            _check_restorable(state, cfg)
            allowed = ", or add resume_allow_changes=true if that is intended"
        except ConfigError:  # weights that do not fit: allowing the change would not help
            allowed = ""
        raise ConfigError(
            f"resume: this command changes what the checkpoint was trained with ({changes}); leave "
            f"{' and '.join([', '.join(names[:-1]), names[-1]] if len(names) > 1 else names)} out to go on with "
            f"the run's own{allowed}"
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
    # Another mode or world size is no change, only said: the global batches, and so the training, are the same.
    ranks, written = world_size(cfg), state["world_size"]  # launch has set gpus to what runs
    changed = [(f"with mode={cfg.mode.name}", f"with mode={saved['mode']}")] if cfg.mode.name != saved["mode"] else []
    if ranks != written:
        changed.append((f"on {ranks} ranks", f"on {written}"))
    if changed:
        now, then = (" ".join(said) for said in zip(*changed))
        split = f", split {ranks} ways" if ranks != written else ""
        log.info("resuming %s a checkpoint written %s: the same global batches follow%s", now, then, split)


def _shown(settings: dict, path: str) -> str:
    # a crafted value must not break the one line, nor fill a screen
    text = str(settings.get(path, "(none)")).replace("\n", "\\n")
    return text if len(text) <= 200 else f"{text[:200]}..."


def _check_plan(state: dict, saved: dict, cfg: Config) -> None:
    # A schedule over all steps (OneCycleLR) plans the checkpoint's epochs x steps per epoch: resumed with
    # another length it would step past its plan (an error after the run directory was written to) or stop short.
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
    except Exception as error:
        detail = str(error).strip().splitlines()[0] if str(error).strip() else "no detail"
        raise ConfigError(
            f"resume: the checkpoint does not fit model={cfg.model.get('_target_')} with optim="
            f"{cfg.optim.get('_target_')} ({type(error).__name__}: {detail.rstrip(':')}); resume with the model and "
            "optimizer it was trained with"
        ) from None
    return per_step
