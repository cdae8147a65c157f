"""How fast is each mode? Throughput per case, or time to accuracy; every run a fresh training process.

    python -m mnist_dist.tools.bench                      # throughput: a few minutes on a 2-core CPU
    python -m mnist_dist.tools.bench --device cuda --batch 512 --steps 400 --gpus 4
    python -m mnist_dist.tools.bench --time-to-accuracy   # recipe=fast to 91 % and 92 % on Fashion-MNIST, 3 seeds

Throughput: each case trains on the same generated data, timed by the trainer itself; cases run interleaved
(A B A B ...), so drift in the machine's speed hits all alike, and a ratio is the median of per-round ratios.
A case that means nothing here (bf16 that the CPU emulates) is skipped with a note; ``--cases`` runs what it
names. Time to accuracy: recipe=fast per mode, seeds interleaved, each run stopping at the highest of
``--targets``; a target's time is the training clock at the first evaluation that reached it. Writes
bench (or tta) .md, .json and .png to ``--out``, with one warning line if the machine was busy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn

from mnist_dist.operations.errors import exit_on_interrupt, interrupted, raise_on_interrupt

if __name__ == "__main__":
    exit_on_interrupt()  # before the imports below (torch: seconds): Ctrl-C meanwhile is one line too

from mnist_dist.operations import files, machine
from mnist_dist.operations.tensorboard import read_scalars
from mnist_dist.tools import fractions, save_chart, train_in_subprocess
from mnist_dist.tools.synthetic import write_idx

CASES = {  # overrides of `python -m mnist_dist`
    "single": [],
    "single_bf16": ["amp=bf16"],
    "ddp": ["mode=ddp"],
    "torch_ddp": ["mode=torch_ddp"],
    "ddp_no_overlap": ["mode=ddp", "mode.overlap=false"],
    "fsdp": ["mode=fsdp"],  # each rank holds 1/gpus of the model and gathers each layer group as it runs
}
COMPARISONS = [  # (case, baseline, target ratio or None, what it answers)
    ("ddp", "torch_ddp", 1.05, "our DDP vs torch DDP"),
    ("ddp", "ddp_no_overlap", None, "all-reduce overlapped with backward vs after it"),
    ("fsdp", "ddp", None, "sharded parameters, gradients and optimizer state vs replicas"),
    ("single_bf16", "single", 1.5, "bf16 autocast vs fp32"),
]
TTA_MODES = ("single", "ddp", "torch_ddp")
SINGLE_SECONDS_TARGET = 60.0  # single reaches the highest target within a minute of training on a 2-core CPU
DDP_RATIO_TARGET = 1.3  # ddp's time to it within 1.3x single's


def skips(device: str, cpu_flags: list[str]) -> dict[str, str]:
    """The cases a default run leaves out on this machine, each with why (``--cases`` still runs them)."""
    if device == "cpu" and not machine.native_bf16(cpu_flags):
        return {"single_bf16": "no avx512_bf16 or amx_bf16 on this CPU: bf16 is emulated, several times slower"}
    return {}


def choose(cases: str | None, device: str, cpu_flags: list[str]) -> tuple[list[str], dict[str, str]]:
    """(cases to run, skipped cases with why): ``--cases`` as given, else every case that means something here."""
    if not cases:
        skipped = skips(device, cpu_flags)
        return [case for case in CASES if case not in skipped], skipped
    if unknown := sorted(set(cases.split(",")) - set(CASES)):
        sys.exit(f"bench: unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    return cases.split(","), {}


def summarize(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def report(samples: dict[str, list[dict]], skipped: dict[str, str] | None = None) -> dict:
    """The numbers behind the tables, from every run's results; ``skipped``: case -> why it did not run."""
    skipped = skipped or {}
    speed = {case: [run["train_images_per_s"] for run in runs] for case, runs in samples.items()}
    cases = {
        case: {
            **summarize(speed[case]),
            "peak_rss_mib": max(max(run["peak_rss_mib"]) for run in runs),
            "model_state_mib": max(max(run["model_state_mib"]) for run in runs),
        }
        for case, runs in samples.items()
    }
    comparisons = []
    for case, baseline, target, question in COMPARISONS:
        row = {"name": f"{case} / {baseline}", "question": question, "target": target}
        if why := skipped.get(case) or skipped.get(baseline):
            comparisons.append({**row, "why": why})
        elif case in speed and baseline in speed:  # round i of both ran back to back
            ratio = summarize([a / b for a, b in zip(speed[case], speed[baseline])])
            comparisons.append({**row, **ratio, "met": None if target is None else ratio["median"] >= target})
    return {"cases": cases, "comparisons": comparisons, "skipped": skipped}


def markdown(result: dict, settings: dict, machine_info: dict) -> str:
    lines = [
        machine.summary_line(machine_info),
        "",
        f"{settings['device']}, global batch {settings['batch']}, {settings['steps']} timed steps per run, "
        f"{settings['repeats']} interleaved rounds, ddp cases on {settings['gpus']} ranks",
        "",
        *(line for case, why in result["skipped"].items() for line in (f"skipped {case}: {why}", "")),
        "| case | images/s (median) | min – max | peak RSS per rank (MiB) | model state per rank (MiB) |",
        "|---|---|---|---|---|",
    ]
    for case, row in result["cases"].items():
        lines.append(
            f"| {case} | {row['median']:,.0f} | {row['min']:,.0f} – {row['max']:,.0f} | {row['peak_rss_mib']:,.0f} | "
            f"{row['model_state_mib']:,.1f} |"
        )
    lines += ["", "| comparison | ratio (median) | min – max | target | met |", "|---|---|---|---|---|"]
    for row in result["comparisons"]:
        if "why" in row:
            lines.append(f"| {row['name']} | skipped: {row['why']} | | | |")
            continue
        target = "" if row["target"] is None else f"≥ {row['target']:.2f}"
        met = "" if row["met"] is None else ("yes" if row["met"] else "**no**")
        lines.append(
            f"| {row['name']} | {row['median']:.2f} | {row['min']:.2f} – {row['max']:.2f} | {target} | {met} |"
        )
    return "\n".join(lines + [line for line in [result.get("warning")] if line]) + "\n"


def bar_chart(result: dict):
    def draw(plt):
        names, rows = list(result["cases"]), list(result["cases"].values())
        medians = [row["median"] for row in rows]
        errors = [[m - row["min"] for m, row in zip(medians, rows)], [row["max"] - m for m, row in zip(medians, rows)]]
        figure, axis = plt.subplots(figsize=(9, 3.8))
        axis.bar(names, medians, yerr=errors, capsize=4, color="tab:blue")
        axis.set(ylabel="images/s (global, median, min–max)", title="throughput per case")
        return figure

    return draw


def train(name: str, overrides: list[str], run_dir: Path) -> dict:
    try:
        return train_in_subprocess(overrides, run_dir)
    except RuntimeError as error:
        sys.exit(f"bench: {name} failed: {error}")


def run_bench(chosen: list[str], skipped: dict[str, str], settings: dict, out: Path, work: Path) -> tuple:
    """Every chosen case once per round, interleaved, on generated data in ``work``: one epoch is warm-up + timed
    steps + the first step after warm-up, which the trainer's clock also skips."""
    write_idx(work / "data" / "MNIST" / "raw", n_train=(settings["warmup"] + settings["steps"] + 1) * settings["batch"])
    where = [f"gpus={settings['gpus']}", f"device={settings['device']}", f"data.root={work / 'data'}"]
    shape = ["data.mirrors=[]", "epochs=1", f"batch_size={settings['batch']}", f"warmup_steps={settings['warmup']}"]
    samples, loads = {case: [] for case in chosen}, []
    for round_ in range(settings["repeats"]):
        for case in chosen:
            loads.append(os.getloadavg()[0])
            samples[case].append(train(case, [*CASES[case], *where, *shape], work / "runs" / f"{case}_{round_}"))
            speed = samples[case][-1]["train_images_per_s"]
            print(f"round {round_ + 1}/{settings['repeats']} {case}: {speed:,.0f} images/s", flush=True)
    result = {**report(samples, skipped), "warning": machine.load_warning(max(loads + [os.getloadavg()[0]]))}
    saved = {"machine": machine.describe(), "settings": settings, "samples": samples, **result}
    return write_report(out, "bench", markdown(result, settings, saved["machine"]), saved, bar_chart(result))


def write_report(out: Path, name: str, table: str, saved: dict, draw) -> tuple[str, list[str]]:
    """``name``.md, .json and .png in ``out``: the table and the names of what was written."""
    out.mkdir(parents=True, exist_ok=True)
    files.write_text(out / f"{name}.md", table)
    files.write_text(out / f"{name}.json", json.dumps(saved, indent=2) + "\n")
    return table, [f"{name}.md", f"{name}.json", save_chart(out / f"{name}.png", draw)]


# time to accuracy ------------------------------------------------------------------------------------------
def accuracy_curve(run_dir: Path) -> dict[float, float]:
    """Test accuracy against seconds of training (evaluation left out), from the run's TensorBoard."""
    return {ms / 1000: accuracy for ms, accuracy in read_scalars(run_dir)["test/accuracy_by_train_ms"].items()}


def seconds_to(curve: dict[float, float], target: float) -> float | None:
    """Seconds of training to the first evaluation at or above ``target``; None if none reached it."""
    return next((at for at, accuracy in curve.items() if accuracy >= target), None)


def tta_summary(samples: dict[str, list[dict]], targets: list[float]) -> dict:
    """Per mode and target: seeds that reached it, median and worst time; per mode the accuracy at the stop;
    whether single and ddp met their targets. Each sample is a results.json with ``seconds_to`` (a time or
    None per target) added."""
    cases = {}
    for case, runs in samples.items():
        accuracies, per_target = [run["test_accuracy"] for run in runs], {}
        for i, target in enumerate(targets):
            times = [run["seconds_to"][i] for run in runs if run["seconds_to"][i] is not None]
            per_target[target] = {
                "reached": len(times),
                "runs": len(runs),
                "median_s": statistics.median(times) if times else None,
                "worst_s": max(times) if len(times) == len(runs) else None,  # a miss has no finite worst
            }
        cases[case] = {"targets": per_target, "accuracy": summarize(accuracies)}
    result = {"cases": cases}
    if "single" in cases:
        worst = cases["single"]["targets"][targets[-1]]["worst_s"]
        result["single_met"] = worst is not None and worst <= SINGLE_SECONDS_TARGET
    if "single" in samples and "ddp" in samples:
        pairs = [(d["seconds_to"][-1], s["seconds_to"][-1]) for d, s in zip(samples["ddp"], samples["single"])]
        ratios = [a / b for a, b in pairs if a and b]
        result["ddp_ratio"] = statistics.median(ratios) if len(ratios) == len(pairs) else None
        result["ddp_met"] = result["ddp_ratio"] is not None and result["ddp_ratio"] <= DDP_RATIO_TARGET
    return result


def _seconds(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.1f}"


def tta_markdown(result: dict, settings: dict, machine_info: dict) -> str:
    targets = settings["targets"]
    lines = [
        machine.summary_line(machine_info),
        "",
        f"recipe=fast to {' and '.join(f'{t:.1%}' for t in targets)} test accuracy on {settings['dataset']} "
        f"({settings['device']}, ddp cases on {settings['gpus']} ranks), exact evaluation every "
        f"{settings['eval_every']} steps, seeds 1–{settings['seeds']} interleaved; time = training only",
        "",
        "| mode | target | reached | time to target, median (s) | worst (s) | test accuracy at stop |",
        "|---|---|---|---|---|---|",
    ]
    for case, row in result["cases"].items():
        accuracy = row["accuracy"]
        stop = f"{accuracy['min']:.2%} – {accuracy['max']:.2%} (median {accuracy['median']:.2%})"
        for target, times in row["targets"].items():
            lines.append(
                f"| {case} | {target:.1%} | {times['reached']}/{times['runs']} | {_seconds(times['median_s'])} "
                f"| {_seconds(times['worst_s'])} | {stop if target == targets[-1] else ''} |"
            )
    lines += ["", "| target | measured | met |", "|---|---|---|"]
    if "single_met" in result:
        worst = result["cases"]["single"]["targets"][targets[-1]]["worst_s"]
        measured, met = (
            "not reached" if worst is None else f"worst {worst:.1f} s",
            "yes" if result["single_met"] else "**no**",
        )
        lines.append(f"| single reaches {targets[-1]:.1%} within {SINGLE_SECONDS_TARGET:.0f} s | {measured} | {met} |")
    if "ddp_ratio" in result:
        ratio = "—" if result["ddp_ratio"] is None else f"{result['ddp_ratio']:.2f}x"
        met = "yes" if result["ddp_met"] else "**no**"
        lines.append(f"| ddp within {DDP_RATIO_TARGET}x single's time | {ratio} (median of per-seed ratios) | {met} |")
    return "\n".join(lines + [line for line in [result.get("warning")] if line]) + "\n"


def curve_chart(curves: dict[str, dict[float, float]], targets: list[float]):
    def draw(plt):
        figure, axis = plt.subplots(figsize=(7, 4))
        for name, curve in curves.items():
            axis.plot(list(curve), [100 * accuracy for accuracy in curve.values()], marker=".", label=name)
        for target in targets:
            axis.axhline(100 * target, color="grey", linewidth=0.6, linestyle="--")
        axis.set(xlabel="training seconds (evaluation left out)", ylabel="test accuracy (%)", title="seed 1")
        axis.legend()
        return figure

    return draw


def run_tta(args: argparse.Namespace, out: Path, work: Path) -> tuple:
    targets, loads = args.targets, []
    where = [f"gpus={args.gpus}", f"device={args.device}", f"data={args.dataset}", f"data.mirrors=[{args.data_dir}]"]
    stop_at = ["recipe=fast", f"target_accuracy={targets[-1]}", f"eval_every_steps={args.eval_every}"]
    samples, curves = {case: [] for case in TTA_MODES}, {}
    for seed in range(1, args.seeds + 1):
        for case in TTA_MODES:
            run_dir = work / "runs" / f"{case}_seed{seed}"
            loads.append(os.getloadavg()[0])
            overrides = [f"mode={case}", *stop_at, f"seed={seed}", *where, f"data.root={work / 'data'}"]
            results = train(f"{case} seed {seed}", overrides, run_dir)
            curve = accuracy_curve(run_dir)
            curves.setdefault(case, curve)  # seed 1's
            samples[case].append({**results, "seconds_to": [seconds_to(curve, target) for target in targets]})
            print(f"seed {seed} {case}: {_seconds(samples[case][-1]['seconds_to'][-1])} s to target", flush=True)
    result = {**tta_summary(samples, targets), "warning": machine.load_warning(max(loads + [os.getloadavg()[0]]))}
    settings = {key: getattr(args, key) for key in ("targets", "dataset", "device", "gpus", "eval_every", "seeds")}
    saved = {"machine": machine.describe(), "settings": settings, **result}
    table = tta_markdown(result, settings, saved["machine"])
    return write_report(out, "tta", table, json.loads(json.dumps(saved, default=str)), curve_chart(curves, targets))


# the command line ------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not the usage as well: --help shows that
        sys.exit(f"bench: {message} (--help lists the options)")


def at_least(least: int):
    """An argparse type: a whole number, at least ``least``."""

    def count(text: str) -> int:
        with contextlib.suppress(ValueError):
            if int(text) >= least:
                return int(text)
        raise argparse.ArgumentTypeError(f"{text} must be a whole number, at least {least}")

    return count


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = _Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--gpus", type=at_least(1), default=2, help="ranks of the ddp cases")
    parser.add_argument("--batch", type=at_least(1), default=64, help="global batch")
    parser.add_argument("--steps", type=at_least(1), default=150, help="timed steps per run")
    parser.add_argument("--warmup", type=at_least(0), default=10, help="untimed steps first")
    parser.add_argument("--repeats", type=at_least(1), default=3, help="interleaved rounds")
    parser.add_argument("--cases", help="comma-separated subset (default: every case that means something here)")
    parser.add_argument("--out", type=Path, default=Path("outputs", "bench", time.strftime("%Y-%m-%d_%H-%M-%S")))
    tta = parser.add_argument_group("time to accuracy")
    tta.add_argument("--time-to-accuracy", action="store_true", help="recipe=fast to --targets, per mode and seed")
    tta.add_argument("--targets", type=fractions, default="0.91,0.92", help="accuracies to reach; stops at the highest")
    tta.add_argument("--seeds", type=at_least(1), default=3, help="seeds 1..N, modes interleaved")
    tta.add_argument("--eval-every", type=at_least(1), default=47, help="steps between exact evaluations")
    tta.add_argument("--dataset", default="fashion_mnist", choices=["fashion_mnist", "mnist"])
    tta.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist", help="a data.mirrors entry")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, started = parse_args(argv), time.monotonic()
    if not args.time_to_accuracy:
        chosen, skipped = choose(args.cases, args.device, machine.describe()["cpu_flags"])
        for case, why in skipped.items():
            print(f"skipped {case}: {why}", flush=True)
    # The generated data and the runs' directories: removed however the bench ends, Ctrl-C included.
    with tempfile.TemporaryDirectory(prefix="mnist_dist_bench_", ignore_cleanup_errors=True) as scratch:
        if args.time_to_accuracy:
            table, written = run_tta(args, args.out, Path(scratch))
        else:
            settings = {key: getattr(args, key) for key in ("device", "gpus", "batch", "warmup", "steps", "repeats")}
            table, written = run_bench(chosen, skipped, settings, args.out, Path(scratch))
    minutes = (time.monotonic() - started) / 60
    print(f"\n{table}\nwrote {args.out}: {', '.join(written)} ({minutes:.1f} minutes)")
    return 0


if __name__ == "__main__":
    raise_on_interrupt()  # Ctrl-C and SIGTERM: the running case is stopped with its ranks, then one line
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        interrupted("interrupted; no report written")
