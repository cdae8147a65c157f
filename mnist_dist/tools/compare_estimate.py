"""How long a compare will take, said before its first run: every run's optimizer steps times the cost of one,
measured by a few steps of the first mode's model and optimizer in this process (after a warm-up step, as the
trainer's own numbers skip theirs). compare says it again, at the first run's real pace, once that is done."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra.utils import instantiate

from mnist_dist.config import Config, data_root
from mnist_dist.data import raw_dir, split_size, steps_per_epoch
from mnist_dist.model import instantiate_model

PROBE_STEPS = 5
STANDARD = {True: 60_000, False: 10_000}  # images of the train and test splits before the data is here
EVAL_SHARE = 1 / 3  # an image's forward pass at evaluation, as a share of its training step (forward + backward)


def probe_step_s(cfg: Config, steps: int = PROBE_STEPS) -> float:
    """Seconds of one optimizer step at ``cfg``'s global batch on this process's device, the mean of ``steps``
    after a warm-up step (random images: the time does not depend on what they show)."""
    device = torch.device("cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = instantiate_model(cfg.model).to(device)
    optimizer = instantiate(cfg.optim)(model.parameters())
    images = torch.randn(cfg.batch_size, 1, 28, 28, device=device)
    labels = torch.randint(0, 10, (cfg.batch_size,), device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()  # the clock reads finished work

    step()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - started) / steps


def _images(cfg: Config, train: bool) -> int:
    raw = raw_dir(cfg.data.name, data_root(cfg))
    prefix = "train" if train else "t10k"
    return split_size(raw, train) if (Path(raw) / f"{prefix}-images-idx3-ubyte").is_file() else STANDARD[train]


def run_seconds(cfg: Config, step_s: float) -> tuple[float, int]:
    """One run's seconds at ``step_s`` a step, evaluation after every epoch included, and its steps."""
    steps = cfg.epochs * steps_per_epoch(_images(cfg, True), cfg.batch_size)
    evaluation = cfg.epochs * _images(cfg, False) * EVAL_SHARE * step_s / cfg.batch_size
    return steps * step_s + evaluation, steps


def up_front(configs: dict, repeats: int, probe: Callable[[Config], float] | None = None) -> str:
    """compare's first line: its runs, and about how long they take, with how that was worked out. ``configs``:
    compare's, each mode's (config, overrides); ``probe``: seconds a step (default: ``probe_step_s``)."""
    (first, _), runs = next(iter(configs.values())), len(configs) * repeats
    step_s = (probe or probe_step_s)(first)
    each, steps = run_seconds(first, step_s)
    return (
        f"compare: {len(configs)} modes x {repeats} rounds = {runs} runs, about {duration(runs * each)} "
        f"({runs} runs x ~{duration(each)}: {steps} steps at ~{1000 * step_s:.0f} ms from a {PROBE_STEPS}-step "
        f"probe of {first.mode.name}, and evaluation; start-up not counted); said again after the first run"
    )


def duration(seconds: float) -> str:
    """``40 s``, ``2 min 10 s``, ``15 min``, ``1 h 5 min``: to the precision an estimate has."""
    seconds = round(seconds)
    if seconds < 90:
        return f"{seconds} s"
    if seconds < 600:
        return f"{seconds // 60} min {seconds % 60 // 10 * 10} s" if seconds % 60 >= 10 else f"{seconds // 60} min"
    hours, minutes = divmod(round(seconds / 60), 60)
    return f"{hours} h {minutes} min" if hours else f"{minutes} min"
