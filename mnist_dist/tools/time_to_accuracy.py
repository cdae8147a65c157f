"""Time to accuracy: ``recipe=fast`` to a target test accuracy in single, ddp and torch_ddp, over seeds.

    python -m mnist_dist.tools.bench --time-to-accuracy            # Fashion-MNIST, 91 %, 3 seeds, ddp on 2 ranks
    python -m mnist_dist.tools.bench --time-to-accuracy --target 0.92 --seeds 5

Every run is a fresh training process that evaluates exactly every ``--eval-every`` steps and stops at the
target; its time is the trainer's training clock (evaluation left out, results.json time_to_target_s).
Modes run interleaved (seed 1: single, ddp, torch_ddp; seed 2: ...), so drift in the machine's speed hits
all of them, and ddp's ratio to single is the median of per-seed ratios. One classic-recipe run gives the
contrast: its test accuracy after as much training time as fast single needed. Writes tta.md and tta.json.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from mnist_dist import machine
from mnist_dist.tensorboard import read_scalars
from mnist_dist.tools.run import train_in_subprocess

CASES = {"single": ["mode=single"], "ddp": ["mode=ddp"], "torch_ddp": ["mode=torch_ddp"]}
SINGLE_SECONDS_TARGET = 60.0  # single reaches the target within a minute of training on a 2-core CPU
DDP_RATIO_TARGET = 1.3  # ddp's time to target within 1.3x single's


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages: how shared the machine was while this ran."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def train(overrides: list[str], run_dir: Path, settings: dict) -> dict:
    """One training process; its results.json."""
    where = [
        f"gpus={settings['gpus']}",
        f"device={settings['device']}",
        f"data={settings['dataset']}",
        f"data.mirrors=[{settings['data']}]",
        f"data.root={settings['work'] / 'data'}",
    ]
    try:
        return train_in_subprocess([*overrides, *where], run_dir)
    except RuntimeError as error:
        sys.exit(f"bench: {' '.join(overrides)} failed: {error}")


def accuracy_at(run_dir: Path, seconds: float) -> float | None:
    """The last test accuracy evaluated within ``seconds`` of training (test/accuracy_by_train_ms)."""
    by_ms = read_scalars(run_dir)["test/accuracy_by_train_ms"]
    within = [accuracy for ms, accuracy in by_ms.items() if ms <= 1000 * seconds]
    return within[-1] if within else None


def summarize(samples: dict[str, list[dict]]) -> dict:
    """Per case: seeds that reached the target, median and worst time to it, accuracy spread at the stop."""
    cases = {}
    for case, runs in samples.items():
        times = [run["time_to_target_s"] for run in runs if run["time_to_target_s"] is not None]
        accuracies = [run["test_accuracy"] for run in runs]
        cases[case] = {
            "reached": len(times),
            "runs": len(runs),
            "median_s": statistics.median(times) if times else None,
            "worst_s": max(times) if len(times) == len(runs) else None,  # a miss has no finite worst
            "median_steps": statistics.median(run["steps_to_target"] for run in runs if run["steps_to_target"])
            if times
            else None,
            "accuracy_mean": statistics.mean(accuracies),
            "accuracy_min": min(accuracies),
            "accuracy_max": max(accuracies),
        }
    result = {"cases": cases}
    if "single" in cases:
        single = cases["single"]
        result["single_met"] = single["worst_s"] is not None and single["worst_s"] <= SINGLE_SECONDS_TARGET
    if "single" in samples and "ddp" in samples:
        pairs = [
            (d["time_to_target_s"], s["time_to_target_s"])
            for d, s in zip(samples["ddp"], samples["single"])
            if d["time_to_target_s"] and s["time_to_target_s"]
        ]
        ratio = statistics.median(a / b for a, b in pairs) if len(pairs) == len(samples["ddp"]) else None
        result["ddp_ratio"] = ratio
        result["ddp_met"] = ratio is not None and ratio <= DDP_RATIO_TARGET
    return result


def _seconds(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.1f}"


def markdown(result: dict, settings: dict, machine_info: dict, load: str) -> str:
    target = settings["target"]
    lines = [
        machine.summary_line(machine_info) + f"; load average {load} (1, 5, 15 min)",
        "",
        f"recipe=fast to {target:.1%} test accuracy on {settings['dataset']} ({settings['device']}, ddp cases on "
        f"{settings['gpus']} ranks), exact evaluation every {settings['eval_every']} steps, seeds 1–"
        f"{settings['seeds']} interleaved; time = training only, evaluation left out",
        "",
        "| mode | reached | time to target, median (s) | worst (s) | steps (median) | test accuracy at stop |",
        "|---|---|---|---|---|---|",
    ]
    for case, row in result["cases"].items():
        lines.append(
            f"| {case} | {row['reached']}/{row['runs']} | {_seconds(row['median_s'])} | {_seconds(row['worst_s'])} "
            f"| {row['median_steps'] or ''} | {row['accuracy_min']:.2%} – {row['accuracy_max']:.2%} "
            f"(mean {row['accuracy_mean']:.2%}) |"
        )
    lines += ["", "| target | measured | met |", "|---|---|---|"]
    if "single_met" in result:
        worst = result["cases"]["single"]["worst_s"]
        met = "yes" if result["single_met"] else "**no**"
        lines.append(
            f"| single reaches {target:.1%} within {SINGLE_SECONDS_TARGET:.0f} s "
            f"| {'not reached' if worst is None else f'worst {worst:.1f} s'} | {met} |"
        )
    if "ddp_ratio" in result:
        ratio = "—" if result["ddp_ratio"] is None else f"{result['ddp_ratio']:.2f}x"
        met = "yes" if result["ddp_met"] else "**no**"
        lines.append(f"| ddp within {DDP_RATIO_TARGET}x single's time | {ratio} (median of per-seed ratios) | {met} |")
    if result.get("classic_accuracy") is not None:
        lines += [
            "",
            f"For contrast, recipe=classic (seed 1) after the same {result['classic_seconds']:.1f} s of training "
            f"(fast single's median): {result['classic_accuracy']:.2%} test accuracy.",
        ]
    return "\n".join(lines) + "\n"


def run(settings: dict, out: Path) -> int:
    """The whole measurement: every case and seed interleaved, the classic contrast, tta.md and tta.json."""
    load_before = loadavg()
    target = ["recipe=fast", f"target_accuracy={settings['target']}", f"eval_every_steps={settings['eval_every']}"]
    samples: dict[str, list[dict]] = {case: [] for case in settings["cases"]}
    for seed in range(1, settings["seeds"] + 1):
        for case in settings["cases"]:
            run_dir = settings["work"] / "runs" / f"{case}_seed{seed}"
            results = train([*CASES[case], *target, f"seed={seed}"], run_dir, settings)
            samples[case].append(results)
            print(f"seed {seed} {case}: {_seconds(results['time_to_target_s'])} s to target", flush=True)
    result = summarize(samples)
    single = result["cases"].get("single", {}).get("median_s")
    if single and settings["classic"]:
        run_dir = settings["work"] / "runs" / "classic"
        train(["mode=single", "epochs=1", f"eval_every_steps={settings['classic_eval_every']}"], run_dir, settings)
        result.update(classic_seconds=single, classic_accuracy=accuracy_at(run_dir, single))
    load = f"{load_before} before, {loadavg()} after"
    info = machine.describe()
    table = markdown(result, {k: v for k, v in settings.items() if k != "work"}, info, load)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tta.md").write_text(table)
    saved = {"machine": info, "load": load, "settings": {k: str(v) for k, v in settings.items()}, **result}
    (out / "tta.json").write_text(json.dumps({**saved, "samples": samples}, indent=2) + "\n")
    print("\n" + table + f"\nwrote {out}/tta.md, tta.json")
    return 0
