"""Checkpoints: written so that a crash mid-write never leaves a half file under the final name,
read back with clear errors, and holding every rank's random state so that a resumed run continues
exactly where the interrupted one stopped.

A checkpoint is read with ``torch.load(weights_only=True)``: tensors and plain Python values only, so
a crafted file cannot run code. Its ``format`` key names the layout (``_ENTRIES``); this version reads
its own, ``FORMAT``, and names any other in a one-line refusal. The config it holds is read as plain
YAML (``saved_settings``): no interpolation, no resolver, no alias, bounded in size.

Every file here is written beside its target and renamed over it: a symlink planted under the final
name is replaced, never written through, and the file gets the user's umask like the rest of the run.
"""

from __future__ import annotations

import glob
import io
import json
import logging
import math
import os
import random
import re
import secrets
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from hydra.utils import instantiate

from mnist_dist.build import make_scheduler
from mnist_dist.config import Config
from mnist_dist.errors import ConfigError
from mnist_dist.step import first_non_finite

FORMAT = 4
# What each entry must be; a checkpoint lacking one, or holding something else, is refused by name.
_ENTRIES = {
    "model": dict,
    "optimizer": dict,
    "scheduler": dict,
    "scaler": dict,
    "epoch": int,  # epochs completed
    "epoch_step": int,  # steps done in the next epoch (0 at an epoch's end; checkpoint_every_steps)
    "step": int,
    "rng": list,
    "meters": list,  # by rank: clocks, images and seconds counted, a split log window's losses
    "world_size": int,
    "config": str,
}
CONFIG_BYTES = 2**20  # a saved config is about 2 KB; a larger one is not mnist_dist's

log = logging.getLogger("mnist_dist")


def _atomic_write(path: Path, data: bytes | memoryview) -> None:
    # Write beside the target, then rename: os.replace is atomic on POSIX, so readers see either
    # the old file or the new one, never a truncated mix. A write killed by a signal leaves its temp
    # file: the next save of the same file removes it (run directories are never shared).
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        stale.unlink(missing_ok=True)
    # Not mkstemp: it creates 0600, and a teammate sharing the experiment directory could not read the
    # results. O_EXCL refuses anything already under the temp name, a planted symlink included.
    tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)  # a symlink at ``path`` is replaced; what it pointed to is left alone
    except OSError as error:  # a write to a descriptor names no file: name the one that failed
        Path(tmp).unlink(missing_ok=True)
        raise OSError(error.errno, error.strerror, str(path)) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save(obj: Any, path: Path) -> None:
    """torch.save, atomically. Serialised in memory first: a full disk then fails in a plain write,
    as OSError(ENOSPC) naming ``path``, not deep in torch's zip writer."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    _atomic_write(path, buffer.getbuffer())


def save_kept(state: dict, path: Path, keep: int) -> None:
    """``save`` that keeps the ``keep - 1`` previous checkpoints as ``<name>.1.pt`` (newest), ``<name>.2.pt``...

    ``path`` is never missing nor partial: the previous file gets its new name as a hard link before the
    new one atomically replaces it. The older ones are for when the newest is unusable (a diverged
    step saved, a disk fault)."""
    older = [path.with_suffix(f".{n}.pt") for n in range(1, keep)]
    if older and path.exists():
        for newer, elder in reversed(list(zip(older, older[1:]))):
            if newer.exists():
                os.replace(newer, elder)
        older[0].unlink(missing_ok=True)
        os.link(path, older[0])
    save(state, path)


def save_json(obj: dict, path: Path) -> None:
    """Strict JSON, atomically: a nan or inf is written as null (a bare NaN is refused by strict parsers)."""
    _atomic_write(path, (json.dumps(_finite_or_none(obj), indent=2, allow_nan=False) + "\n").encode())


def save_text(text: str, path: Path) -> None:
    _atomic_write(path, text.encode())


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(item) for item in value]
    return value


def locate(resume: str) -> Path:
    """The checkpoint named by ``resume=``: a checkpoint file, or a run directory holding one."""
    path = Path(resume).expanduser().resolve()
    if path.is_dir():
        path = path / "checkpoint.pt"
    if not path.is_file():
        raise ConfigError(
            f"resume={resume}: no checkpoint there; pass a run directory that holds checkpoint.pt, or the file itself"
        )
    return path


class _Unusable(Exception):
    """Why a checkpoint file cannot be resumed from (the message, without the path)."""


class _Aliased(Exception):
    pass


def load(path: Path) -> dict:
    """The checkpoint at ``path``, in the current format, or a ConfigError (one line) saying why not and
    naming the older checkpoints kept beside it."""
    try:
        return _read(path)
    except _Unusable as why:
        older = kept_older(path)
        hint = (
            f"; older checkpoints there: {', '.join(p.name for p in older)} (resume={older[0]}; resume=auto "
            "takes the newest readable one)"
            if older
            else ""
        )
        raise ConfigError(f"resume={path}: {why}{hint}") from None


def _read(path: Path) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # truncated, not a checkpoint, crafted, unreadable: the same to the user
        detail = str(error).splitlines()[0] if str(error) else "no detail"
        raise _Unusable(f"cannot read the checkpoint ({type(error).__name__}: {detail})") from None
    if not isinstance(state, dict) or not {"model", "optimizer", "epoch"} & state.keys():
        raise _Unusable("not a mnist_dist checkpoint (final weights are in model.pt; resume from checkpoint.pt)")
    version = state.pop("format", 1)  # the first layout had no format key
    if version != FORMAT:
        raise _Unusable(
            f"checkpoint format {version!r}, but this version of mnist_dist reads format {FORMAT} only; resume it "
            "with the version that wrote it"
        )
    wrong = [key for key, kind in _ENTRIES.items() if not isinstance(state.get(key), kind)]
    if wrong:
        raise _Unusable(
            f"the checkpoint lacks or has a wrong {', '.join(wrong)} (damaged, or not written by mnist_dist); "
            "resume from another checkpoint.pt"
        )
    poisoned = first_non_finite(state["model"])  # saved by a version that did not check before saving
    if poisoned:
        raise _Unusable(f"the checkpoint's weights are not finite ({poisoned}): it was saved after training diverged")
    return state


def kept_older(path: Path) -> list[Path]:
    """The older checkpoints ``save_kept`` keeps beside ``path``, newest first: ``checkpoint.1.pt``,
    ``checkpoint.2.pt``, ... for ``checkpoint.pt``; those after it for ``checkpoint.1.pt``."""
    named = re.fullmatch(r"(.*?)(?:\.(\d+))?\.pt", path.name)
    if not named:
        return []
    base, number = named.group(1), int(named.group(2) or 0)
    found = []
    for sibling in path.parent.glob(f"{glob.escape(base)}.*.pt"):
        older = re.fullmatch(rf"{re.escape(base)}\.(\d+)\.pt", sibling.name)
        if older and int(older.group(1)) > number and sibling.is_file():
            found.append((int(older.group(1)), sibling))
    return [sibling for _, sibling in sorted(found)]


def newest_readable(run_dir: Path) -> Path | None:
    """``resume=auto``'s checkpoint: the newest one kept in ``run_dir`` that can be resumed from, saying in
    one line which it skipped; None when there is none, a ConfigError when none can be read. A torchrun
    restart or a SLURM requeue runs the same command again: refusing would fail every attempt alike."""
    newest = run_dir / "checkpoint.pt"
    skipped = []
    for path in ([newest] if newest.is_file() else []) + kept_older(newest):
        try:
            state = _read(path)
        except _Unusable as why:
            skipped.append(f"{path.name} ({why})")
            continue
        if skipped:
            log.warning("resume=auto: skipped %s; resuming from %s (step %d)", "; ".join(skipped), path, state["step"])
        return path
    if skipped:
        raise ConfigError(
            f"resume=auto: no checkpoint in {run_dir} can be read: {'; '.join(skipped)}; move them away to start afresh"
        )
    return None


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


def gather_objects(mine: Any) -> list:
    """Every rank's ``mine``, by rank (a collective; ``[mine]`` in one process)."""
    if not dist.is_initialized():
        return [mine]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def rng_states_of_all_ranks() -> list[dict]:
    """Every rank's generators (Python, torch CPU, every CUDA device's), by rank: dropout continues as if
    never stopped, also on the replicas of dp, which draw their masks on every GPU."""
    mine = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
    }
    return gather_objects(mine)


def restore_rng(states: list[dict], rank: int) -> None:
    if rank >= len(states):  # resumed on more ranks: new ranks keep their seed
        return
    random.setstate(states[rank]["python"])
    torch.set_rng_state(states[rank]["torch"])
    if states[rank]["cuda"] is not None and torch.cuda.is_initialized():
        torch.cuda.set_rng_state_all(states[rank]["cuda"][: torch.cuda.device_count()])
