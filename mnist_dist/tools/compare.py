"""Do my modes agree, and which is fastest? Runs several modes on the same seed and global batch.

    python -m mnist_dist.tools.compare modes=[single,dp,ddp,torch_ddp] gpus=2 data=fashion_mnist epochs=1

``tolerance=`` (default 0.05) and ``early_tolerance=`` (1e-4) bound the verdict, ``repeats=`` (3) the rounds:
every mode runs once per round, rounds interleaved, so a machine that slows down slows every mode alike;
images/s is the median over rounds, with its spread. Any other argument is a Hydra override for every mode.
Dropout is turned off where the model has it (replicas in different processes draw different masks). Writes
compare.md and .json to outputs/compare/<date>/<time>/, beside the runs (``<mode>``, ``<mode>_<round>``
after round 1), and exits 1 if the modes disagree. Loss and accuracy come from round 1 (runs are
deterministic). A warning line says when the throughput column is not to be trusted: a spread over 10 % or a
load average above the cores. A run that Ctrl-C or an error stops is removed: only complete runs stay.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from mnist_dist.operations.errors import NOTHING_STARTED, DataError, command, interrupted, on_interrupt

if __name__ == "__main__":
    on_interrupt(NOTHING_STARTED)  # before the slow imports below (torch, Hydra): Ctrl-C meanwhile is one line too

import yaml
from hydra import compose, initialize_config_module
from hydra.errors import HydraException
from omegaconf import OmegaConf
from torch import nn

from mnist_dist.config import Config, ConfigError, describe_hydra_error, validate
from mnist_dist.launch import WorkerFailed, launch
from mnist_dist.model import instantiate_model
from mnist_dist.modes import MODES, world_size
from mnist_dist.operations import files, machine
from mnist_dist.step import TrainingDiverged
from mnist_dist.tools import machine_line, read_scalars
from mnist_dist.topology import resolve

# Modes sum the same numbers in a different order (one batch mean vs the average of per-rank means), so fp32
# rounding differs from the first step, and training amplifies it: the first logged step must agree closely.
OPTIONS = {"modes": ["single", "dp", "ddp", "torch_ddp"], "tolerance": 0.05, "early_tolerance": 1e-4, "repeats": 3}
SPREAD_WARNING = 0.10  # (max - min) / median of a mode's images/s over the rounds: above it, ranking is noise


def loss_curve(run_dir: Path) -> dict[int, float]:
    """Rank 0's global training loss by optimizer step."""
    curve = read_scalars(run_dir).get("train/loss_global")
    if not curve:
        raise ConfigError(
            f"{run_dir} logged no training loss: its run took fewer steps than log_every; pass a smaller "
            "log_every= or more epochs="
        )
    return curve


def compare(results: dict, curves: dict, tolerance: float, early_tolerance: float, speeds: dict | None = None) -> dict:
    """The table's rows and the verdict; the first mode is the reference. ``speeds``: each mode's images/s in
    every round (default: the one in its results)."""
    speeds = speeds or {mode: [result["train_images_per_s"]] for mode, result in results.items()}
    reference = next(iter(curves.values()))
    first_step = min(reference)
    rows = []
    for mode, result in results.items():
        curve, speed, median = curves[mode], speeds[mode], statistics.median(speeds[mode])
        rows.append({
            "mode": mode, "world_size": result["world_size"], "test_accuracy": result["test_accuracy"],
            "final_loss": curve[max(curve)],
            "first_step_loss_diff": abs(curve[first_step] - reference[first_step]),
            "max_loss_diff": max(abs(curve[s] - reference[s]) for s in set(curve) & set(reference)),
            "images_per_s": median, "images_per_s_rounds": speed, "spread": (max(speed) - min(speed)) / median,
            # parameters, gradients and optimizer state on the fullest rank: what sharding buys
            "model_state_mib": max(result.get("model_state_mib") or [float("nan")]),
        })  # fmt: skip
    early = max(rows, key=lambda row: row["first_step_loss_diff"])
    late = max(rows, key=lambda row: row["max_loss_diff"])
    agree = early["first_step_loss_diff"] <= early_tolerance and late["max_loss_diff"] <= tolerance
    verdict = (
        f"{'modes agree' if agree else 'MODES DISAGREE'} with {rows[0]['mode']}: training loss within "
        f"{early['first_step_loss_diff']:.1e} at step {first_step} (tolerance {early_tolerance:g}, {early['mode']}) "
        f"and within {late['max_loss_diff']:.1e} over the run (tolerance {tolerance:g}, {late['mode']})"
    )
    return {"rows": rows, "agree": agree, "verdict": verdict, "first_step": first_step}


def warnings(report: dict, load_average: float, cores: int) -> list[str]:
    """Lines that say when the throughput column cannot be trusted (empty when it can)."""
    noisy = ", ".join(f"{row['mode']} {row['spread']:.0%}" for row in report["rows"] if row["spread"] > SPREAD_WARNING)
    spread = f"warning: images/s varied by more than {SPREAD_WARNING:.0%} between rounds ({noisy}): the ranking by "
    spread += "speed may be noise; rerun on an idle machine or with more repeats="
    return [line for line in [noisy and spread, machine.load_warning(load_average, cores)] if line]


def markdown(report: dict) -> str:
    reference = report["rows"][0]["mode"]
    rounds = len(report["rows"][0]["images_per_s_rounds"])
    lines = [
        machine_line(report["machine"]),
        "",
        f"| mode | world size | test accuracy | final loss | Δloss at step {report['first_step']} | "
        f"max Δloss | images/s (median of {rounds}) | min – max | spread | model state per rank (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        speed = row["images_per_s_rounds"]
        lines.append(
            f"| {row['mode']} | {row['world_size']} | {100 * row['test_accuracy']:.2f} % | "
            f"{row['final_loss']:.4f} | {row['first_step_loss_diff']:.1e} | {row['max_loss_diff']:.1e} | "
            f"{row['images_per_s']:,.0f} | {min(speed):,.0f} – {max(speed):,.0f} | "
            f"{row['spread']:.0%} | {row['model_state_mib']:.1f} |"
        )
    text = "\n".join(lines) + f"\n\nΔloss: training-loss difference from {reference}. {report['verdict']}\n"
    return text + "".join(f"\n{line}\n" for line in report["warnings"])


def main(argv: list[str], load: Callable[[], float] = lambda: os.getloadavg()[0]) -> int:
    """``load``: the machine's load average now (injectable, so tests can play a busy machine)."""
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # libraries: warnings only
    logging.getLogger("mnist_dist").setLevel(logging.INFO)
    out = Path("outputs", "compare", time.strftime("%Y-%m-%d"), time.strftime("%H-%M-%S"))
    try:
        options, overrides = parse(argv)
        configs = compose_configs(options["modes"], overrides)  # all checked before the first run starts
        out = fresh_dir(out)
        try:
            results, curves, speeds, peak_load = run_rounds(configs, options["repeats"], out, load)
        except BaseException:
            for directory in (out, *out.parents):  # each one left empty: no complete run in it
                with contextlib.suppress(OSError):
                    directory.rmdir()
            raise
    except HydraException as error:
        message = describe_hydra_error(error)
        if "valid keys: " in message:
            message += f", {', '.join(OPTIONS)} (compare's own)"
        sys.exit(f"error: {message}")
    except (ConfigError, DataError, WorkerFailed, TrainingDiverged) as error:  # one line each
        sys.exit(f"error: {error}")
    except KeyboardInterrupt:
        interrupted(f"interrupted; no report written{f' (the complete runs: {out})' if out.is_dir() else ''}")
    report = compare(results, curves, options["tolerance"], options["early_tolerance"], speeds)
    report |= {"machine": machine.describe(), "load_average_max": peak_load}
    report["warnings"] = warnings(report, peak_load, report["machine"]["cores"])
    table = markdown(report)
    print("\n" + table)
    files.write_text(out / "compare.md", table)
    files.write_text(out / "compare.json", json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}: compare.md, compare.json")
    return 0 if report["agree"] else 1


def fresh_dir(path: Path) -> Path:
    """``path`` created, or ``path_2``, ``path_3``, ... when another compare of the same second has it."""
    for n in itertools.count(1):
        candidate = path if n == 1 else path.with_name(f"{path.name}_{n}")
        with contextlib.suppress(FileExistsError):
            candidate.mkdir(parents=True)
            return candidate


def parse(argv: list[str]) -> tuple[dict, list[str]]:
    """compare's own options, each checked into one line before any run starts; the overrides for every mode."""
    options, overrides = dict(OPTIONS), []
    for arg in argv:
        key, _, text = arg.partition("=")
        if key.lstrip("+~") == "mode":
            raise ConfigError(f"{arg}: compare runs each mode of modes=; pass modes={text or 'single,ddp'}")
        if key not in OPTIONS:
            overrides.append(arg)
            continue
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = None
        if key == "modes":  # modes=[single,ddp] or modes=single,ddp (a comma list, as Hydra's -m takes it)
            value = [mode.strip() for mode in value.split(",")] if isinstance(value, str) else value
            if not isinstance(value, list) or not value or not all(m in MODES for m in map(str, value)):
                raise ConfigError(
                    f"modes={text} is no list of modes; e.g. modes=[single,ddp], from: {', '.join(MODES)}"
                )
            options[key] = value
        elif key == "repeats":
            if type(value) is not int or value < 1:
                raise ConfigError(f"repeats={text} must be a whole number of rounds, at least 1")
            options[key] = value
        elif type(value) not in (int, float) or not math.isfinite(value) or value < 0:  # bool is no tolerance
            raise ConfigError(f"{key}={text} must be a number, at least 0")
        else:
            options[key] = float(value)
    return options, overrides


def compose_configs(modes: list[str], overrides: list[str]) -> dict[str, tuple[Config, list[str]]]:
    """Each mode's config, checked, and the overrides that make it (its run's console line says them):
    dropout off where the model has it, and BatchNorm synchronised where the mode can (ranks would
    otherwise each normalise with their own share's statistics, which single does not)."""
    configs = {}
    with initialize_config_module("mnist_dist.conf", version_base="1.3"):
        for mode in modes:
            said = [*overrides, f"mode={mode}"]
            cfg = compose("config", overrides=said)
            if "dropout" in cfg.model:
                cfg.model.dropout = False
                said.append("model.dropout=false")
            batchnorm = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
            if not cfg.mode.get("sync_batchnorm", True) and any(
                isinstance(module, batchnorm) for module in instantiate_model(cfg.model).modules()
            ):
                cfg.mode.sync_batchnorm = True
                said.append("mode.sync_batchnorm=true")
                print(f"compare: mode={mode} with mode.sync_batchnorm=true: its BatchNorm sees the global batch")
            configs[mode] = OmegaConf.to_object(cfg), said
            validate(configs[mode][0], resolve(configs[mode][0]))  # every mode checked before the first runs
    return configs


def run_rounds(configs: dict, repeats: int, out: Path, load: Callable[[], float]) -> tuple:
    """Runs every mode once per round, in reverse order every other round (no mode always first); returns round 1's
    results and curves, every round's images/s per mode, and the highest load average seen before a run. A run that
    does not finish (Ctrl-C, an error) is removed: no half run for TensorBoard to list."""
    results, curves, speeds, peak_load = {}, {}, {mode: [] for mode in configs}, 0.0
    for round_ in range(1, repeats + 1):
        for mode, (cfg, said) in list(configs.items())[:: 1 if round_ % 2 else -1]:
            run_dir = out / (mode if round_ == 1 else f"{mode}_{round_}")
            try:  # from its mkdir on: a Ctrl-C as the run's line is printed leaves no empty run behind
                run_dir.mkdir(parents=True)
                peak_load = max(peak_load, load())
                print(f"== round {round_}/{repeats}: {mode} ({world_size(cfg)} process(es)) -> {run_dir}", flush=True)
                launch(cfg, run_dir, said)
            except BaseException:
                shutil.rmtree(run_dir, ignore_errors=True)
                raise
            result = json.loads((run_dir / "results.json").read_text())
            speeds[mode].append(result["train_images_per_s"])
            if round_ == 1:
                results[mode], curves[mode] = result, loss_curve(run_dir)
    return results, curves, speeds, max(peak_load, load())


if __name__ == "__main__":
    on_interrupt()  # Ctrl-C and SIGTERM: the workers are stopped, then one line
    with command():  # once it has its status, no interpreter teardown for a late Ctrl-C to land in
        sys.exit(main(sys.argv[1:]))
