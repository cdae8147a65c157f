"""compare's own options (``modes=``, ``repeats=``, ``tolerance=``, ``early_tolerance=``), each checked into
one ``error:`` line before any run starts; every other argument is a Hydra override for every mode."""

from __future__ import annotations

import math

import yaml

from mnist_dist.config import ConfigError
from mnist_dist.modes import MODES

DEFAULTS = {
    "modes": ["single", "dp", "ddp", "torch_ddp"],
    # Modes sum the same numbers in a different order (one batch mean vs the average of per-rank means), so
    # fp32 rounding differs from the first step, and training amplifies it over a run
    # (docs/reproducibility.md shows by how much on Fashion-MNIST). So the first logged step must agree
    # closely and the rest loosely.
    "tolerance": 0.05,
    "early_tolerance": 1e-4,
    "repeats": 3,
}
OWN_KEYS = ", ".join(DEFAULTS)


def parse(argv: list[str]) -> tuple[dict, list[str]]:
    """compare's options (checked) and the overrides for every mode."""
    options, overrides = dict(DEFAULTS), []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key in DEFAULTS:
            options[key] = _checked(key, value)
        elif key.lstrip("+~") == "mode":
            raise ConfigError(f"{arg}: compare runs each mode of modes=; pass modes={value or 'single,ddp'}")
        else:
            overrides.append(arg)
    return options, overrides


def _checked(key: str, text: str):
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text if key != "modes" else None
    if key == "modes":
        return _modes(text, value)
    if key == "repeats":
        if type(value) is not int or value < 1:
            raise ConfigError(f"repeats={text} must be a whole number of rounds, at least 1")
        return value
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:  # bool is no tolerance
        raise ConfigError(f"{key}={text} must be a number, at least 0")
    return float(value)


def _modes(text: str, value) -> list[str]:
    choose = f"e.g. modes=[single,ddp], from: {', '.join(MODES)}"
    if isinstance(value, str):  # modes=single,ddp: a comma list, as Hydra's -m takes it
        value = [mode.strip() for mode in value.split(",")]
    if not isinstance(value, list):
        if value is None or isinstance(value, dict):
            raise ConfigError(f"modes={text} is not a list of modes; {choose}")
        value = [value]
    if not value:
        raise ConfigError(f"modes={text} names no mode; {choose}")
    for mode in value:
        if not isinstance(mode, str) or mode not in MODES:
            raise ConfigError(f"modes={text}: {mode} is not a mode; {choose}")
    return value
