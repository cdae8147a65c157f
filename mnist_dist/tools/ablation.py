"""Which of recipe=fast's choices pay, each measured over seeds: accuracy within the time budget, and speed.

    python -m mnist_dist.tools.bench --ablation                      # single, Fashion-MNIST, seeds 1-3, 60 s
    python -m mnist_dist.tools.bench --ablation --variants recipe,no_smoothing --seeds 2

Each variant is ``recipe=fast`` with a few overrides, trained in a fresh process over its whole schedule
with an exact evaluation every ``--eval-every`` steps (off the clock). Reported per variant: the test
accuracy of the last evaluation within the budget of training seconds, the accuracy at the end of the
schedule, and training images/s. Seeds run one after the other, every variant within a seed
(seed 1: recipe, ...; seed 2: ...), so drift in the machine's speed hits all of them. Writes ablation.md
and ablation.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from mnist_dist.operations import files, machine
from mnist_dist.tools.run import loadavg
from mnist_dist.tools.time_to_accuracy import SINGLE_SECONDS_TARGET, accuracy_at, train

# name: (overrides on top of recipe=fast, what the variant changes)
VARIANTS = {
    "recipe": ([], "recipe=fast as it is: widths 24-48-96, 4 epochs"),
    "previous": (["model.widths=[16,32,64]", "epochs=3"], "the recipe before: widths 16-32-64, 3 epochs"),
    "narrow": (["model.widths=[16,32,64]"], "widths 16-32-64, 4 epochs"),
    "narrow_longer": (["model.widths=[16,32,64]", "epochs=8"], "widths 16-32-64, 8 epochs (as many seconds)"),
    "shorter": (["epochs=3"], "3 epochs"),
    "no_smoothing": (["label_smoothing=0"], "no label smoothing"),
}
BUDGET_S = SINGLE_SECONDS_TARGET  # the accuracy that counts: what a minute of training gives


def variants(text: str) -> list[str]:
    """``all`` or comma-separated names of VARIANTS; argparse says a bad one in one line."""
    names = list(VARIANTS) if text == "all" else text.split(",")
    if unknown := sorted(set(names) - set(VARIANTS)):
        raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    return names


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """bench's options for --ablation, beside time to accuracy's (which it shares)."""
    group.add_argument("--ablation", action="store_true", help="recipe=fast's choices one at a time (ablation.py)")
    group.add_argument("--variants", type=variants, default="all", help="comma-separated ablation variants")


def summarize(samples: dict[str, list[dict]]) -> dict[str, dict]:
    """Per variant: mean and range of the accuracy within the budget (None: no evaluation within it),
    mean accuracy at the end, median images/s and training seconds."""
    rows = {}
    for name, runs in samples.items():
        within = [run["accuracy_within_budget"] for run in runs]
        rows[name] = {
            "within_mean": statistics.mean(within) if None not in within else None,
            "within_min": min(within) if None not in within else None,
            "within_max": max(within) if None not in within else None,
            "final_mean": statistics.mean(run["test_accuracy"] for run in runs),
            "images_per_s": statistics.median(run["train_images_per_s"] for run in runs),
            "train_s": statistics.median(run["train_time_s"] for run in runs),
            "runs": len(runs),
        }
    return rows


def markdown(rows: dict[str, dict], settings: dict, machine_info: dict, load: str) -> str:
    lines = [
        machine.summary_line(machine_info) + f"; load average {load} (1, 5, 15 min)",
        "",
        f"recipe=fast variants, single mode on {settings['dataset']} ({settings['device']}), seeds 1–"
        f"{settings['seeds']}, exact evaluation every {settings['eval_every']} steps; accuracy within "
        f"{BUDGET_S:.0f} s = the last evaluation within that much training time",
        "",
        f"| variant | change | test accuracy within {BUDGET_S:.0f} s, mean (min – max) | at the end, mean "
        "| training images/s | training time (s) |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        within = (
            "no evaluation within the budget"
            if row["within_mean"] is None
            else f"{row['within_mean']:.2%} ({row['within_min']:.2%} – {row['within_max']:.2%})"
        )
        lines.append(
            f"| {name} | {VARIANTS[name][1]} | {within} | {row['final_mean']:.2%} "
            f"| {row['images_per_s']:,.0f} | {row['train_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def run(settings: dict, out: Path) -> int:
    """Every variant for every seed, interleaved; ablation.md and ablation.json."""
    load_before = loadavg()
    every = f"eval_every_steps={settings['eval_every']}"
    samples: dict[str, list[dict]] = {name: [] for name in settings["variants"]}
    for seed in range(1, settings["seeds"] + 1):
        for name in settings["variants"]:
            run_dir = settings["work"] / "runs" / f"{name}_seed{seed}"
            overrides = ["mode=single", "recipe=fast", every, f"seed={seed}", *VARIANTS[name][0]]
            results = train(overrides, run_dir, settings)
            within = accuracy_at(run_dir, BUDGET_S)
            samples[name].append({**results, "accuracy_within_budget": within})
            reached = "no evaluation" if within is None else f"{within:.2%} test accuracy"
            print(f"seed {seed} {name}: {reached} within {BUDGET_S:.0f} s of training", flush=True)
    rows = summarize(samples)
    load = f"{load_before} before, {loadavg()} after"
    info = machine.describe()
    table = markdown(rows, settings, info, load)
    out.mkdir(parents=True, exist_ok=True)
    files.write_text(out / "ablation.md", table)
    saved = {"machine": info, "load": load, "settings": {k: str(v) for k, v in settings.items()}, "rows": rows}
    files.write_text(out / "ablation.json", json.dumps({**saved, "samples": samples}, indent=2) + "\n")
    print("\n" + table + f"\nwrote {out}/ablation.md, ablation.json")
    return 0
