"""Time to accuracy: ``recipe=fast`` to target test accuracies in single, ddp and torch_ddp, over seeds.

    python -m mnist_dist.tools.bench --time-to-accuracy    # Fashion-MNIST, 91 % and 92 %, 3 seeds, ddp on 2 ranks
    python -m mnist_dist.tools.bench --time-to-accuracy --targets 0.92 --seeds 5

Every run is a fresh training process that evaluates exactly every ``--eval-every`` steps and stops at the
highest target; the time to each target is the trainer's training clock at the first evaluation that
reached it (evaluation left out: test/accuracy_by_train_ms, whose last point is results.json's
time_to_target_s). Modes run interleaved (seed 1: single, ddp, torch_ddp; seed 2: ...), so drift in the
machine's speed hits all of them, and ddp's ratio to single is the median of per-seed ratios. One
classic-recipe run gives the contrast: its accuracy after as much training time as fast single needed,
and its curve beside seed 1's of each mode in tta.png. Writes tta.md, tta.json and tta.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import matplotlib

from mnist_dist.operations import files, machine
from mnist_dist.operations.tensorboard import read_scalars
from mnist_dist.tools.run import loadavg, train_in_subprocess

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

CASES = {"single": ["mode=single"], "ddp": ["mode=ddp"], "torch_ddp": ["mode=torch_ddp"]}
SINGLE_SECONDS_TARGET = 60.0  # single reaches the highest target within a minute of training on a 2-core CPU
DDP_RATIO_TARGET = 1.3  # ddp's time to it within 1.3x single's


def fractions(text: str) -> list[float]:
    """``0.91,0.92`` -> [0.91, 0.92], sorted; argparse says a bad one in one line."""
    values = sorted(float(value) for value in text.split(","))
    if not all(0 < value <= 1 for value in values):
        raise argparse.ArgumentTypeError(f"{text}: test accuracies as fractions in (0, 1], e.g. 0.91,0.92")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """bench's options for --time-to-accuracy, which --ablation shares (mnist_dist/tools/ablation.py)."""
    tta = parser.add_argument_group("time to accuracy (tools/time_to_accuracy.py, tools/ablation.py)")
    tta.add_argument("--time-to-accuracy", action="store_true", help="recipe=fast to --targets, per mode and seed")
    tta.add_argument("--targets", type=fractions, default="0.91,0.92", help="accuracies to reach; stops at the highest")
    tta.add_argument("--seeds", type=int, default=3, help="seeds 1..N, modes interleaved")
    tta.add_argument("--eval-every", type=int, default=47, help="steps between exact evaluations")
    tta.add_argument("--dataset", default="fashion_mnist", choices=["fashion_mnist", "mnist"])
    tta.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist", help="a data.mirrors entry")
    tta.add_argument("--no-classic", dest="classic", action="store_false", help="skip the classic contrast")
    return tta


def settings(args: argparse.Namespace, work: Path) -> dict:
    """What run() and ablation.run() need, from bench's command line; their runs go in ``work``."""
    chosen = (args.cases or "").split(",")
    return {
        **{key: getattr(args, key) for key in ("device", "gpus", "seeds", "eval_every", "dataset", "classic")},
        "targets": args.targets,
        "cases": [case for case in chosen if case in CASES] or list(CASES),
        "data": args.data_dir,
        "classic_eval_every": 4 * args.eval_every,  # batch 64 vs 256: about as often per image
        "work": work,
    }


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


def accuracy_curve(run_dir: Path) -> dict[float, float]:
    """Test accuracy against seconds of training (evaluation left out), from the run's TensorBoard."""
    return {ms / 1000: accuracy for ms, accuracy in read_scalars(run_dir)["test/accuracy_by_train_ms"].items()}


def accuracy_at(run_dir: Path, seconds: float) -> float | None:
    """The last test accuracy evaluated within ``seconds`` of training."""
    within = [accuracy for at, accuracy in accuracy_curve(run_dir).items() if at <= seconds]
    return within[-1] if within else None


def seconds_to(curve: dict[float, float], target: float) -> float | None:
    """Seconds of training to the first evaluation at or above ``target``; None if none reached it."""
    return next((at for at, accuracy in curve.items() if accuracy >= target), None)


def summarize(samples: dict[str, list[dict]], targets: list[float]) -> dict:
    """Per case and target: seeds that reached it, median and worst time; per case the accuracy at the stop.

    Each sample is a run's results.json with ``seconds_to`` (one time or None per target) added.
    """
    cases = {}
    for case, runs in samples.items():
        accuracies = [run["test_accuracy"] for run in runs]
        per_target = {}
        for i, target in enumerate(targets):
            times = [run["seconds_to"][i] for run in runs if run["seconds_to"][i] is not None]
            per_target[target] = {
                "reached": len(times),
                "runs": len(runs),
                "median_s": statistics.median(times) if times else None,
                "worst_s": max(times) if len(times) == len(runs) else None,  # a miss has no finite worst
            }
        cases[case] = {
            "targets": per_target,
            "accuracy_mean": statistics.mean(accuracies),
            "accuracy_min": min(accuracies),
            "accuracy_max": max(accuracies),
        }
    result = {"cases": cases}
    last = len(targets) - 1  # the targets met or not are the highest one's
    if "single" in cases:
        worst = cases["single"]["targets"][targets[last]]["worst_s"]
        result["single_met"] = worst is not None and worst <= SINGLE_SECONDS_TARGET
    if "single" in samples and "ddp" in samples:
        pairs = [
            (d["seconds_to"][last], s["seconds_to"][last])
            for d, s in zip(samples["ddp"], samples["single"])
            if d["seconds_to"][last] and s["seconds_to"][last]
        ]
        ratio = statistics.median(a / b for a, b in pairs) if len(pairs) == len(samples["ddp"]) else None
        result["ddp_ratio"] = ratio
        result["ddp_met"] = ratio is not None and ratio <= DDP_RATIO_TARGET
    return result


def _seconds(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.1f}"


def markdown(result: dict, settings: dict, machine_info: dict, load: str) -> str:
    targets = settings["targets"]
    lines = [
        machine.summary_line(machine_info) + f"; load average {load} (1, 5, 15 min)",
        "",
        f"recipe=fast to {' and '.join(f'{t:.1%}' for t in targets)} test accuracy on {settings['dataset']} "
        f"({settings['device']}, ddp cases on {settings['gpus']} ranks), exact evaluation every "
        f"{settings['eval_every']} steps, seeds 1–{settings['seeds']} interleaved; time = training only, "
        "evaluation left out",
        "",
        "| mode | target | reached | time to target, median (s) | worst (s) | test accuracy at stop |",
        "|---|---|---|---|---|---|",
    ]
    for case, row in result["cases"].items():
        stop = f"{row['accuracy_min']:.2%} – {row['accuracy_max']:.2%} (mean {row['accuracy_mean']:.2%})"
        for target, times in row["targets"].items():
            lines.append(
                f"| {case} | {target:.1%} | {times['reached']}/{times['runs']} | {_seconds(times['median_s'])} "
                f"| {_seconds(times['worst_s'])} | {stop if target == targets[-1] else ''} |"
            )
    lines += ["", "| target | measured | met |", "|---|---|---|"]
    if "single_met" in result:
        worst = result["cases"]["single"]["targets"][targets[-1]]["worst_s"]
        met = "yes" if result["single_met"] else "**no**"
        lines.append(
            f"| single reaches {targets[-1]:.1%} within {SINGLE_SECONDS_TARGET:.0f} s "
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


def chart(curves: dict[str, dict[float, float]], targets: list[float], title: str, path: Path) -> None:
    """Test accuracy against training seconds, one line per run (seed 1 of each mode, the classic contrast)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, curve in curves.items():
        ax.plot(list(curve), [100 * accuracy for accuracy in curve.values()], marker=".", label=name)
    for target in targets:
        ax.axhline(100 * target, color="grey", linewidth=0.6, linestyle="--")
    ax.axvline(SINGLE_SECONDS_TARGET, color="grey", linewidth=0.6)
    lowest = min((a for curve in curves.values() for a in curve.values()), default=0.8)
    ax.set_ylim(max(100 * lowest, 100 * targets[0] - 6), 100 * targets[-1] + 1)
    ax.set(xlabel="training seconds (evaluation left out)", ylabel="test accuracy (%)")
    ax.set_title(title, fontsize=8)
    ax.legend()
    fig.tight_layout()
    with files.atomic(path) as out:
        fig.savefig(out.file, format="png", dpi=110)
    plt.close(fig)


def run(settings: dict, out: Path) -> int:
    """The whole measurement: every case and seed interleaved, the classic contrast, tta.md, tta.json, tta.png."""
    load_before = loadavg()
    targets = settings["targets"]
    stop_at = ["recipe=fast", f"target_accuracy={targets[-1]}", f"eval_every_steps={settings['eval_every']}"]
    samples: dict[str, list[dict]] = {case: [] for case in settings["cases"]}
    curves = {}
    for seed in range(1, settings["seeds"] + 1):
        for case in settings["cases"]:
            run_dir = settings["work"] / "runs" / f"{case}_seed{seed}"
            results = train([*CASES[case], *stop_at, f"seed={seed}"], run_dir, settings)
            curve = accuracy_curve(run_dir)
            samples[case].append({**results, "seconds_to": [seconds_to(curve, target) for target in targets]})
            if seed == 1:
                curves[f"fast, {case}"] = curve
            print(f"seed {seed} {case}: {_seconds(samples[case][-1]['seconds_to'][-1])} s to target", flush=True)
    result = summarize(samples, targets)
    single = result["cases"].get("single", {}).get("targets", {}).get(targets[-1], {}).get("median_s")
    if single and settings["classic"]:
        run_dir = settings["work"] / "runs" / "classic"
        train(["mode=single", "epochs=1", f"eval_every_steps={settings['classic_eval_every']}"], run_dir, settings)
        result.update(classic_seconds=single, classic_accuracy=accuracy_at(run_dir, single))
        curves["classic, single"] = accuracy_curve(run_dir)
    load = f"{load_before} before, {loadavg()} after"
    info = machine.describe()
    table = markdown(result, {k: v for k, v in settings.items() if k != "work"}, info, load)
    out.mkdir(parents=True, exist_ok=True)
    files.write_text(out / "tta.md", table)
    saved = {"machine": info, "load": load, "settings": {k: str(v) for k, v in settings.items()}, **result}
    files.write_text(out / "tta.json", json.dumps({**saved, "samples": samples}, indent=2, default=str) + "\n")
    title = f"recipe=fast and classic on {settings['dataset']}, seed 1\n{machine.summary_line(info)}"
    chart(curves, targets, title, out / "tta.png")
    print("\n" + table + f"\nwrote {out}/tta.md, tta.json, tta.png")
    return 0
