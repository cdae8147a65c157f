"""How fast is each mode? Throughput per case, or time to accuracy; every run a fresh training process.

    python -m mnist_dist.tools.bench                      # throughput
    python -m mnist_dist.tools.bench --device cuda --batch 512 --steps 400 --gpus 4
    python -m mnist_dist.tools.bench --time-to-accuracy   # recipe=fast to 91 % and 92 % on Fashion-MNIST, 3 seeds

Throughput: each case trains on the same generated data, timed by the trainer; cases run interleaved (A B A B),
so drift in the machine's speed hits all alike, and a ratio is the median of per-round ratios. A case that means
nothing here (bf16 that the CPU emulates) is skipped with a note; ``--cases`` runs what it names. Time to
accuracy: recipe=fast per mode, seeds interleaved, each run stopping at 92 %; a target's time is the training
clock at its first evaluation that reached it. Writes bench (or tta) .md and .json to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn

from mnist_dist.operations.errors import NOTHING_STARTED, interrupted, on_interrupt

if __name__ == "__main__":
    on_interrupt(NOTHING_STARTED)  # before the imports below (torch): Ctrl-C meanwhile is one line too

from mnist_dist.operations import files, machine
from mnist_dist.tools import machine_line, read_scalars, train_in_subprocess, write_idx

CASES = {  # overrides of `python -m mnist_dist`
    "single": [],
    "single_bf16": ["amp=bf16"],
    "ddp": ["mode=ddp"],
    "torch_ddp": ["mode=torch_ddp"],
    "fsdp": ["mode=fsdp"],  # each rank holds 1/gpus of the model and gathers each layer group as it runs
}
# our DDP vs torch's, sharded state vs replicas, bf16 vs fp32
COMPARISONS = [("ddp", "torch_ddp"), ("fsdp", "ddp"), ("single_bf16", "single")]
TTA_MODES, TARGETS, EVAL_EVERY = ("single", "ddp", "torch_ddp"), (0.91, 0.92), 47


def choose(cases: str | None, device: str, cpu_flags: list[str]) -> tuple[list[str], dict[str, str]]:
    """(cases to run, skipped cases with why): ``--cases`` as given, else every case that means something here."""
    if cases:
        if unknown := sorted(set(cases.split(",")) - set(CASES)):
            sys.exit(f"bench: unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
        return cases.split(","), {}
    skipped = {}
    if device == "cpu" and not {"avx512_bf16", "amx_bf16"} & set(cpu_flags):  # bf16 matmuls in hardware
        skipped["single_bf16"] = "no avx512_bf16 or amx_bf16 on this CPU: bf16 is emulated, several times slower"
    return [case for case in CASES if case not in skipped], skipped


def summarize(samples: list[float], form: str = ",.0f") -> str:
    return f"{statistics.median(samples):{form}} | {min(samples):{form}} – {max(samples):{form}}"


def markdown(samples: dict[str, list[dict]], skipped: dict[str, str], args: argparse.Namespace) -> str:
    """The tables, from every run's results.json: images/s per case, and each comparison as the median of the
    ratios of paired rounds (round i of both cases ran back to back); ``skipped``: case -> why it did not run."""
    speed = {case: [run["train_images_per_s"] for run in runs] for case, runs in samples.items()}
    lines = [
        f"{args.device}, global batch {args.batch}, {args.steps} timed steps per run, {args.repeats} interleaved "
        f"rounds, ddp cases on {args.gpus} ranks",
        "",
        *(line for case, why in skipped.items() for line in (f"skipped {case}: {why}", "")),
        "| case | images/s (median) | min – max | model state per rank (MiB) |",
        "|---|---|---|---|",
        *(
            f"| {case} | {summarize(speed[case])} | {max(max(run['model_state_mib']) for run in runs):,.1f} |"
            for case, runs in samples.items()
        ),
        "",
        "| comparison | ratio (median) | min – max |",
        "|---|---|---|",
    ]
    for case, baseline in COMPARISONS:
        if why := skipped.get(case) or skipped.get(baseline):
            lines.append(f"| {case} / {baseline} | skipped: {why} | |")
        elif case in speed and baseline in speed:
            lines.append(
                f"| {case} / {baseline} | {summarize([a / b for a, b in zip(speed[case], speed[baseline])], '.2f')} |"
            )
    return "\n".join(lines) + "\n"


def train(name: str, overrides: list[str], run_dir: Path) -> dict:
    try:
        return train_in_subprocess(overrides, run_dir)
    except RuntimeError as error:
        sys.exit(f"bench: {name} failed: {error}")


def run_bench(args: argparse.Namespace, chosen: list[str], skipped: dict[str, str], work: Path) -> tuple:
    """Every chosen case once per round, interleaved, on generated data in ``work``: one epoch is warm-up + timed
    steps + the first step after warm-up, which the trainer's clock also skips."""
    write_idx(work / "data" / "MNIST" / "raw", n_train=(args.warmup + args.steps + 1) * args.batch)
    where = [f"gpus={args.gpus}", f"device={args.device}", f"data.root={work / 'data'}", "data.mirrors=[]"]
    shape = ["epochs=1", f"batch_size={args.batch}", f"warmup_steps={args.warmup}"]
    samples, loads = {case: [] for case in chosen}, []
    for round_ in range(args.repeats):
        for case in chosen:
            loads.append(os.getloadavg()[0])
            samples[case].append(train(case, [*CASES[case], *where, *shape], work / "runs" / f"{case}_{round_}"))
            speed = samples[case][-1]["train_images_per_s"]
            print(f"round {round_ + 1}/{args.repeats} {case}: {speed:,.0f} images/s", flush=True)
    return write_report(args, "bench", markdown(samples, skipped, args), samples, loads)


def write_report(args: argparse.Namespace, name: str, table: str, samples: dict, loads: list[float]) -> str:
    """``name``.md (the machine, ``table``, a warning line if the machine was busy) and .json (the machine, the
    settings and every run's results) in ``args.out``; the text of the .md."""
    info, warning = machine.describe(), machine.load_warning(max(loads + [os.getloadavg()[0]]))
    text = f"{machine_line(info)}\n\n{table}" + (f"\n{warning}\n" if warning else "")
    args.out.mkdir(parents=True, exist_ok=True)
    files.write_text(args.out / f"{name}.md", text)
    saved = {"machine": info, "settings": vars(args), "samples": samples}
    files.write_text(args.out / f"{name}.json", json.dumps(saved, indent=2, default=str) + "\n")
    return text


def accuracy_curve(run_dir: Path) -> dict[float, float]:
    """Test accuracy against seconds of training (evaluation left out), from the run's TensorBoard."""
    tags = read_scalars(run_dir)
    return {tags["time/train_s"][step]: accuracy for step, accuracy in tags["test/accuracy"].items()}


def seconds_to(curve: dict[float, float], target: float) -> float | None:
    """Seconds of training to the first evaluation at or above ``target``; None if none reached it."""
    return next((at for at, accuracy in curve.items() if accuracy >= target), None)


def tta_markdown(samples: dict[str, list[dict]], args: argparse.Namespace) -> str:
    """Per mode and target: the seeds that reached it, the median and the worst time. Each sample is a
    results.json with ``seconds_to`` (a time or None per target) added."""
    show = lambda value: "not reached" if value is None else f"{value:.1f}"  # noqa: E731
    lines = [
        f"recipe=fast to {' and '.join(f'{t:.1%}' for t in TARGETS)} test accuracy on Fashion-MNIST "
        f"({args.device}, ddp cases on {args.gpus} ranks), exact evaluation every {EVAL_EVERY} steps, "
        f"seeds 1–{args.seeds} interleaved; time = training only",
        "",
        "| mode | target | reached | time to target, median (s) | worst (s) |",
        "|---|---|---|---|---|",
    ]
    for case, runs in samples.items():
        for i, target in enumerate(TARGETS):
            times = [run["seconds_to"][i] for run in runs if run["seconds_to"][i] is not None]
            median = statistics.median(times) if times else None
            worst = max(times) if len(times) == len(runs) else None  # a miss has no finite worst
            lines.append(f"| {case} | {target:.1%} | {len(times)}/{len(runs)} | {show(median)} | {show(worst)} |")
    return "\n".join(lines) + "\n"


def run_tta(args: argparse.Namespace, work: Path) -> tuple:
    where = [f"gpus={args.gpus}", f"device={args.device}", "data=fashion_mnist", f"data.mirrors=[{args.data_dir}]"]
    stop_at = ["recipe=fast", f"target_accuracy={TARGETS[-1]}", f"eval_every_steps={EVAL_EVERY}"]
    samples, loads = {case: [] for case in TTA_MODES}, []
    for seed in range(1, args.seeds + 1):
        for case in TTA_MODES:
            run_dir = work / "runs" / f"{case}_seed{seed}"
            loads.append(os.getloadavg()[0])
            overrides = [f"mode={case}", *stop_at, f"seed={seed}", *where, f"data.root={work / 'data'}"]
            results = train(f"{case} seed {seed}", overrides, run_dir)
            curve = accuracy_curve(run_dir)
            samples[case].append({**results, "seconds_to": [seconds_to(curve, target) for target in TARGETS]})
            reached = samples[case][-1]["seconds_to"][-1]
            print(f"seed {seed} {case}: {'not reached' if reached is None else f'{reached:.1f} s'}", flush=True)
    return write_report(args, "tta", tta_markdown(samples, args), samples, loads)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not the usage as well: --help shows that
        sys.exit(f"bench: {message} (--help lists the options)")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--gpus", type=int, default=2, help="ranks of the ddp cases")
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--steps", type=int, default=150, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--cases", help="comma-separated subset (default: every case that means something here)")
    parser.add_argument("--out", type=Path, default=Path("outputs", "bench", time.strftime("%Y-%m-%d_%H-%M-%S")))
    parser.add_argument("--time-to-accuracy", action="store_true", help="recipe=fast to 91 %% and 92 %% per mode")
    parser.add_argument("--seeds", type=int, default=3, help="time to accuracy: seeds 1..N, modes interleaved")
    parser.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist", help="Fashion-MNIST's folder")
    args = parser.parse_args(argv)
    for flag, least in {"gpus": 1, "batch": 1, "steps": 1, "warmup": 0, "repeats": 1, "seeds": 1}.items():
        if getattr(args, flag) < least:
            parser.error(f"--{flag} {getattr(args, flag)}: at least {least}")
    if not args.time_to_accuracy:
        chosen, skipped = choose(args.cases, args.device, machine.describe()["cpu_flags"])
        for case, why in skipped.items():
            print(f"skipped {case}: {why}", flush=True)
    # The generated data and the runs' directories: removed however the bench ends, Ctrl-C included.
    with tempfile.TemporaryDirectory(prefix="mnist_dist_bench_", ignore_cleanup_errors=True) as scratch:
        work = Path(scratch)
        table = run_tta(args, work) if args.time_to_accuracy else run_bench(args, chosen, skipped, work)
    print(f"\n{table}\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    on_interrupt()  # Ctrl-C and SIGTERM: the running case is stopped with its ranks, then one line
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        interrupted("interrupted; no report written")
