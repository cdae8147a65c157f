"""How fast is each mode, and how do they compare? Side-by-side, repeatable throughput numbers.

    python -m mnist_dist.tools.bench                      # defaults: < 10 minutes on a 2-core CPU
    python -m mnist_dist.tools.bench --device cuda --batch 512 --steps 400 --gpus 4
    python -m mnist_dist.tools.bench --time-to-accuracy   # recipe=fast to 91 % and 92 % (time_to_accuracy.py)
    python -m mnist_dist.tools.bench --ablation           # recipe=fast's choices, one at a time (ablation.py)
    python -m mnist_dist.tools.bench --bucket-sweep       # both DDPs over bucket sizes (bucket_sweep.py)

Every case is a fresh process training the same convnet on the same generated data (so no
download), timed by the trainer itself: device synchronised, warm-up steps left out, evaluation not
counted. Cases that are compared run interleaved (A B A B ...), so drift in the machine's speed hits
both; each ratio is the median of the per-round ratios. By default a case that cannot mean anything on
the machine (bf16 on a CPU that emulates it) is skipped, with a note; ``--cases`` runs what it names.
Writes bench.md, bench.json and bench.png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn

from mnist_dist.operations.errors import exit_on_interrupt, interrupted, raise_on_interrupt

if __name__ == "__main__":
    exit_on_interrupt()  # before the imports below (torch: seconds): Ctrl-C meanwhile is one line too

import matplotlib
import torch

from mnist_dist.operations import files, machine
from mnist_dist.tools import ablation, bucket_sweep, time_to_accuracy
from mnist_dist.tools.baselines import measure_here
from mnist_dist.tools.run import median_counters, paired_ratio, run_trainer, summarize, write_data

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# Trainer cases: overrides of `python -m mnist_dist`; "classic" and "ceiling" are measured here.
CASES = {
    "single": [],
    "classic": None,  # DataLoader over the torchvision dataset, per-sample ToTensor + Normalize
    "ceiling": None,  # forward + backward + step on one resident batch: nothing else to do
    "single_bf16": ["amp=bf16"],
    "single_ckpt100": ["checkpoint_every_steps=100"],  # one mid-epoch checkpoint in the timed steps
    "single_profile": ["profile=true"],  # 5 profiled steps and the trace export in the timed steps
    "ddp": ["mode=ddp"],  # torch's default buckets: fc2 and fc1, then the convolutions
    "torch_ddp": ["mode=torch_ddp"],
    "ddp_no_overlap": ["mode=ddp", "mode.overlap=false"],
    "ddp_1_bucket": ["mode=ddp", "mode.bucket_cap_mb=25"],
    "ddp_per_param": ["mode=ddp", "mode.bucket_cap_mb=1e-6"],  # each gradient all-reduced in its .grad
    "fsdp": ["mode=fsdp"],  # each rank holds 1/gpus of the model and gathers each layer group as it runs
}
GROUPS = [
    ["single", "classic", "ceiling", "single_bf16", "single_ckpt100", "single_profile"],
    ["ddp", "torch_ddp", "ddp_no_overlap", "ddp_1_bucket", "ddp_per_param", "fsdp"],
]
# (case, baseline, target ratio or None, what it answers)
COMPARISONS = [
    ("single", "classic", 1.15, "resident data vs a DataLoader with per-sample transforms"),
    ("single", "ceiling", 0.95, "the trainer vs bare forward+backward+step"),
    ("ddp", "torch_ddp", 1.05, "our DDP vs torch DDP, 2 ranks"),
    ("ddp", "ddp_no_overlap", None, "all-reduce overlapped with backward vs after it"),
    ("ddp_per_param", "ddp_1_bucket", None, "one bucket per parameter vs one bucket"),
    ("ddp", "ddp_1_bucket", None, "torch's 2 buckets (default) vs one bucket"),
    ("fsdp", "ddp", None, "sharded parameters, gradients and optimizer state vs replicas, 2 ranks"),
    ("single_bf16", "single", 1.5, "bf16 autocast vs fp32"),
    ("single_ckpt100", "single", None, "checkpoint_every_steps=100 vs epoch ends only"),
    ("single_profile", "single", None, "profile=true vs off"),
]
EXPOSED_COMM_TARGET = 0.05  # ddp: share of the step spent waiting for the all-reduce after backward


def skips(device: str, cpu_flags: list[str]) -> dict[str, str]:
    """The cases a default run leaves out on this machine, each with why (``--cases`` still runs them)."""
    if device == "cpu" and not machine.native_bf16(cpu_flags):
        # Emulated bf16 ran at 80 images/s against 579 for fp32 on a 2-core EPYC: minutes for a known answer.
        return {"single_bf16": "no avx512_bf16 or amx_bf16 on this CPU: bf16 is emulated, several times slower"}
    return {}


def choose(cases: str | None, device: str, cpu_flags: list[str]) -> tuple[list[str], dict[str, str]]:
    """(cases to run, skipped cases with why): ``--cases`` as given, else every case that means something here."""
    if not cases:
        skipped = skips(device, cpu_flags)
        return [case for case in CASES if case not in skipped], skipped
    unknown = sorted(set(cases.split(",")) - set(CASES))
    if unknown:
        sys.exit(f"bench: unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    return cases.split(","), {}


def report(samples: dict[str, list[dict]], skipped: dict[str, str] | None = None) -> dict:
    """The numbers behind the tables, from every run's measurement; ``skipped``: case -> why it did not run."""
    skipped = skipped or {}
    speed = {case: [run["images_per_s"] for run in runs] for case, runs in samples.items()}
    cases = {
        case: {
            **summarize(values),
            "peak_rss_mib": max(max(run["peak_rss_mib"]) for run in samples[case]),
            "model_state_mib": max(max(run["model_state_mib"]) for run in samples[case]),
            "ddp_backward_ms": median_counters(samples[case]),
        }
        for case, values in speed.items()
    }
    comparisons = []
    for case, baseline, target, question in COMPARISONS:
        why = skipped.get(case) or skipped.get(baseline)
        if why:
            comparisons.append(
                {"name": f"{case} / {baseline}", "question": question, "kind": "skipped", "why": why, "target": target}
            )
        elif case in speed and baseline in speed:
            ratio = paired_ratio(speed[case], speed[baseline])
            comparisons.append(
                {
                    "name": f"{case} / {baseline}",
                    "question": question,
                    "kind": "ratio",
                    **ratio,
                    "target": target,
                    "met": None if target is None else ratio["median"] >= target,
                }
            )
    if "ddp" in samples:
        shares = [run["step_time_ms"]["comm_wait"] / sum(run["step_time_ms"].values()) for run in samples["ddp"]]
        comparisons.append(
            {
                "name": "ddp: exposed communication",
                "kind": "share",
                "question": "time waiting for the all-reduce after backward / step time",
                **summarize(shares),
                "target": EXPOSED_COMM_TARGET,
                "met": statistics.median(shares) <= EXPOSED_COMM_TARGET,
            }
        )
    return {"cases": cases, "comparisons": comparisons, "skipped": skipped}


def counters_table(result: dict) -> list[str]:
    """Both DDPs on the counters torch DDP keeps: backward compute, communication, and the part of the
    communication backward hid; exposed = communication - overlapped."""
    rows = [(case, row["ddp_backward_ms"]) for case, row in result["cases"].items() if row.get("ddp_backward_ms")]
    if not rows:
        return []
    lines = [
        "",
        "| case (rank 0, ms per backward) | backward compute | communication | overlapped | exposed |",
        "|---|---|---|---|---|",
    ]
    for case, c in rows:
        exposed = c["backward_comm"] - c["backward_overlap"]
        lines.append(
            f"| {case} | {c['backward_compute']:.1f} | {c['backward_comm']:.1f} | {c['backward_overlap']:.1f} | "
            f"{exposed:.1f} |"
        )
    return lines


def markdown(result: dict, settings: dict, machine_info: dict) -> str:
    lines = [
        machine.summary_line(machine_info),
        "",
        f"{settings['device']}, global batch {settings['batch']}, {settings['steps']} timed steps "
        f"per run, {settings['repeats']} interleaved rounds, ddp cases on {settings['gpus']} ranks",
        "",
        *(line for case, why in result.get("skipped", {}).items() for line in (f"skipped {case}: {why}", "")),
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
        if row["kind"] == "skipped":
            lines.append(f"| {row['name']} | skipped: {row['why']} | | | |")
            continue
        share = row["kind"] == "share"
        target = "" if row["target"] is None else (f"≤ {row['target']:.0%}" if share else f"≥ {row['target']:.2f}")
        value = (
            f"{row['median']:.1%} | {row['min']:.1%} – {row['max']:.1%}"
            if share
            else f"{row['median']:.2f} | {row['min']:.2f} – {row['max']:.2f}"
        )
        met = "" if row["met"] is None else ("yes" if row["met"] else "**no**")
        lines.append(f"| {row['name']} | {value} | {target} | {met} |")
    return "\n".join(lines + counters_table(result)) + "\n"


def chart(result: dict, path: Path) -> None:
    names = list(result["cases"])
    rows = [result["cases"][name] for name in names]
    medians = [row["median"] for row in rows]
    errors = [[m - row["min"] for m, row in zip(medians, rows)], [row["max"] - m for m, row in zip(medians, rows)]]
    figure, axis = plt.subplots(figsize=(9, 3.8))
    axis.bar(names, medians, yerr=errors, capsize=4, color="tab:blue")
    axis.set(ylabel="images/s (global, median, min–max)", title="throughput per case")
    axis.tick_params(axis="x", rotation=30)
    figure.tight_layout()
    with files.atomic(path) as out:
        figure.savefig(out.file, format="png", dpi=110)
    plt.close(figure)


def run_case(case: str, work: Path, settings: dict, round_: int) -> dict:
    if CASES[case] is not None:
        return run_trainer(case, CASES[case], work, settings, round_)
    command = [
        *(sys.executable, "-m", "mnist_dist.tools.bench", "--measure", case),
        *("--data", str(work / "data" / "MNIST" / "raw"), "--device", settings["device"]),
        *("--batch", str(settings["batch"]), "--steps", str(settings["steps"]), "--warmup", str(settings["warmup"])),
    ]
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)


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


def parse_args() -> argparse.Namespace:
    parser = _Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--gpus", type=at_least(1), default=2, help="ranks of the ddp cases")
    parser.add_argument("--batch", type=at_least(1), default=64, help="global batch")
    parser.add_argument("--steps", type=at_least(1), help="timed steps per run (default 150; --bucket-sweep: its own)")
    parser.add_argument("--warmup", type=at_least(0), default=10, help="untimed steps first")
    parser.add_argument("--repeats", type=at_least(1), help="interleaved rounds (default 3; --bucket-sweep: its own)")
    parser.add_argument("--cases", help="comma-separated subset (default: every case that means something here)")
    parser.add_argument("--out", type=Path, default=Path("outputs", "bench", time.strftime("%Y-%m-%d_%H-%M-%S")))
    ablation.add_arguments(time_to_accuracy.add_arguments(parser))
    sweep = parser.add_argument_group("bucket sizes (mnist_dist/tools/bucket_sweep.py)")
    sweep.add_argument("--bucket-sweep", action="store_true", help="ddp and torch_ddp over bucket sizes")
    sweep.add_argument("--sizes", help="bucket sizes in MB (MiB), comma-separated (default 0.05,0.25,1,4,25)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # internal: one in-process case
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args()


def run_settings(args: argparse.Namespace, steps: int, repeats: int) -> dict:
    """What every run is given; ``steps`` and ``repeats`` where the command line gives none."""
    given = {key: getattr(args, key) for key in ("device", "gpus", "batch", "warmup")}
    return {**given, "steps": args.steps or steps, "repeats": args.repeats or repeats}


def main() -> int:
    args = parse_args()
    if args.measure:
        root = args.data.parent.parent  # torchvision wants <root>/MNIST/raw
        device = torch.device(args.device)
        print(json.dumps(measure_here(args.measure, root, args.batch, args.steps, args.warmup, device)))
        return 0
    # The generated data and the runs' directories (~20 MB): removed however the bench ends, Ctrl-C included.
    with tempfile.TemporaryDirectory(prefix="mnist_dist_bench_", ignore_cleanup_errors=True) as scratch:
        work = Path(scratch)
        if args.ablation:
            return ablation.run({**time_to_accuracy.settings(args, work), "variants": args.variants}, args.out)
        if args.time_to_accuracy:
            return time_to_accuracy.run(time_to_accuracy.settings(args, work), args.out)
        if args.bucket_sweep:
            settings = run_settings(args, bucket_sweep.STEPS, bucket_sweep.REPEATS)  # which fit its time budget
            return bucket_sweep.run(settings, bucket_sweep.parse_sizes(args.sizes), args.out, work)
        chosen, skipped = choose(args.cases, args.device, machine.describe()["cpu_flags"])
        for case, why in skipped.items():
            print(f"skipped {case}: {why}", flush=True)
        return run_bench(chosen, skipped, run_settings(args, 150, 3), args.out, work)


def run_bench(chosen: list[str], skipped: dict[str, str], settings: dict, out: Path, work: Path) -> int:
    """Every chosen case, group by group, rounds interleaved within a group, in ``work``; bench.md, bench.json,
    bench.png in ``out``."""
    started = time.monotonic()
    write_data(work, settings)
    samples: dict[str, list[dict]] = {case: [] for case in chosen}
    for group in GROUPS:
        group = [case for case in group if case in chosen]
        for round_ in range(settings["repeats"]):
            for case in group:
                samples[case].append(run_case(case, work, settings, round_))
                print(
                    f"round {round_ + 1}/{settings['repeats']} {case}: "
                    f"{samples[case][-1]['images_per_s']:,.0f} images/s",
                    flush=True,
                )
    result = report(samples, skipped)
    out.mkdir(parents=True, exist_ok=True)
    info = machine.describe()
    table = markdown(result, settings, info)
    files.write_text(out / "bench.md", table)
    files.write_text(
        out / "bench.json",
        json.dumps({"machine": info, "settings": settings, "samples": samples, **result}, indent=2) + "\n",
    )
    chart(result, out / "bench.png")
    minutes = (time.monotonic() - started) / 60
    print("\n" + table + f"\nwrote {out}/bench.md, bench.json, bench.png ({minutes:.1f} minutes)")
    return 0


if __name__ == "__main__":
    raise_on_interrupt()  # Ctrl-C and SIGTERM: the running case is stopped (subprocess.run kills it), then one line
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        interrupted("interrupted; no report written")
