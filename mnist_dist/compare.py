"""Do my modes agree, and which is fastest? Runs several modes on the same seed and global batch.

    python -m mnist_dist.compare modes=[single,dp,ddp,torch_ddp] gpus=2 data=fashion_mnist epochs=1

``tolerance=`` and ``early_tolerance=`` set the verdict's bounds (see below); any other argument is a
Hydra override applied to every mode. Dropout is turned off when the model
has that option: replicas in different processes draw different masks, which would hide the
question under noise. Writes compare.md, compare.json and compare.png to
outputs/compare/<date>/<time>/, beside one run directory per mode, and exits 1 if the modes disagree.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import matplotlib
import yaml
from hydra import compose, initialize_config_module
from hydra.errors import HydraException
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mnist_dist.config import ConfigError, describe_hydra_error, validate, world_size
from mnist_dist.data import DataError
from mnist_dist.launch import WorkerFailed, launch
from mnist_dist.metrics import tb_dir

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

DEFAULT_MODES = ["single", "dp", "ddp", "torch_ddp"]
# Modes sum the same numbers in a different order (one batch mean vs the average of per-rank means),
# so fp32 rounding differs from the first step, and training amplifies it: on Fashion-MNIST ddp and
# single differ by ~1e-7 at step 10, ~1e-3 by step 30 and up to ~1e-2 over an epoch. So the first
# logged step must agree closely and the rest of the run loosely.
DEFAULT_EARLY_TOLERANCE = 1e-4
DEFAULT_TOLERANCE = 0.05


def loss_curve(run_dir: Path) -> dict[int, float]:
    """Rank 0's global training loss by optimizer step."""
    events = EventAccumulator(str(tb_dir(run_dir, 0)))
    events.Reload()
    return {e.step: e.value for e in events.Scalars("train/loss_global")}


def compare(
    results: dict[str, dict], curves: dict[str, dict[int, float]], tolerance: float, early_tolerance: float
) -> dict:
    """The table's rows and the verdict; the first mode is the reference."""
    reference = next(iter(curves.values()))
    first_step = min(reference)
    rows = []
    for mode, result in results.items():
        shared = sorted(set(curves[mode]) & set(reference))
        rows.append(
            {
                "mode": mode,
                "world_size": result["world_size"],
                "test_accuracy": result["test_accuracy"],
                "final_loss": curves[mode][max(curves[mode])],
                "first_step_loss_diff": abs(curves[mode][first_step] - reference[first_step]),
                "max_loss_diff": max(abs(curves[mode][s] - reference[s]) for s in shared),
                "images_per_s": result["train_images_per_s"],
            }
        )
    early = max(rows, key=lambda row: row["first_step_loss_diff"])
    late = max(rows, key=lambda row: row["max_loss_diff"])
    agree = early["first_step_loss_diff"] <= early_tolerance and late["max_loss_diff"] <= tolerance
    verdict = (
        f"{'modes agree' if agree else 'MODES DISAGREE'} with {rows[0]['mode']}: training loss "
        f"within {early['first_step_loss_diff']:.1e} at step {first_step} (tolerance "
        f"{early_tolerance:g}, {early['mode']}) and within {late['max_loss_diff']:.1e} over the "
        f"run (tolerance {tolerance:g}, {late['mode']})"
    )
    return {
        "rows": rows,
        "agree": agree,
        "verdict": verdict,
        "first_step": first_step,
        "tolerance": tolerance,
        "early_tolerance": early_tolerance,
    }


def markdown(report: dict) -> str:
    reference = report["rows"][0]["mode"]
    lines = [
        f"| mode | world size | test accuracy | final loss | Δloss at step {report['first_step']} | "
        f"max Δloss | images/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        lines.append(
            f"| {row['mode']} | {row['world_size']} | {100 * row['test_accuracy']:.2f} % | "
            f"{row['final_loss']:.4f} | {row['first_step_loss_diff']:.1e} | "
            f"{row['max_loss_diff']:.1e} | {row['images_per_s']:,.0f} |"
        )
    return "\n".join(lines) + f"\n\nΔloss: training-loss difference from {reference}. {report['verdict']}\n"


def chart(report: dict, curves: dict[str, dict[int, float]], path: Path) -> None:
    figure, (losses, speed) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    for (mode, curve), style in zip(curves.items(), ["-", "--", ":", "-."] * 3):
        # Agreeing modes lie on top of each other: a line style each keeps every one visible.
        losses.plot(list(curve), list(curve.values()), style, label=mode, linewidth=1.2)
    losses.set(
        xlabel="optimizer step (same global batch in every mode)", ylabel="training loss", yscale="log", title="loss"
    )
    losses.legend()
    modes = [row["mode"] for row in report["rows"]]
    speed.bar(modes, [row["images_per_s"] for row in report["rows"]], color="tab:blue")
    speed.set(ylabel="images/s (global)", title="throughput")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str]) -> int:
    options = {"modes": DEFAULT_MODES, "tolerance": DEFAULT_TOLERANCE, "early_tolerance": DEFAULT_EARLY_TOLERANCE}
    overrides = []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key in options:
            options[key] = yaml.safe_load(value)
        else:
            overrides.append(arg)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # libraries: warnings only
    logging.getLogger("mnist_dist").setLevel(logging.INFO)
    out = Path("outputs", "compare", time.strftime("%Y-%m-%d"), time.strftime("%H-%M-%S"))
    results, curves = {}, {}
    try:
        with initialize_config_module("mnist_dist.conf", version_base="1.3"):
            configs = {}
            for mode in options["modes"]:
                cfg = compose("config", overrides=[*overrides, f"mode={mode}"])
                if "dropout" in cfg.model:
                    cfg.model.dropout = False
                configs[mode] = OmegaConf.to_object(cfg)
                validate(configs[mode])
        for mode, cfg in configs.items():  # all configs are checked before the first run starts
            run_dir = out / mode
            run_dir.mkdir(parents=True)
            print(f"== {mode} ({world_size(cfg)} process(es)) -> {run_dir}", flush=True)
            launch(cfg, run_dir)
            results[mode] = json.loads((run_dir / "results.json").read_text())
            curves[mode] = loss_curve(run_dir)
    except HydraException as error:
        sys.exit(f"error: {describe_hydra_error(error)}")
    except (ConfigError, DataError, WorkerFailed) as error:
        sys.exit(f"error: {error}")
    report = compare(results, curves, options["tolerance"], options["early_tolerance"])
    table = markdown(report)
    print("\n" + table)
    (out / "compare.md").write_text(table)
    (out / "compare.json").write_text(json.dumps(report, indent=2) + "\n")
    chart(report, curves, out / "compare.png")
    print(f"wrote {out}/compare.md, compare.json, compare.png")
    return 0 if report["agree"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
