"""The GPU check's rows that run the trainer (``python -m mnist_dist`` in a fresh process each, killed with
its ranks after ``args.timeout`` seconds): modes at a number of GPUs, variants of a mode, and time to accuracy.
Each yields ``Row``s as its runs finish.

The modes and variants train on generated data with dropout off (replicas would draw different masks), and
their rows say so. Against single at the same number of GPUs: at world size 1 ddp and torch_ddp equal it bit
for bit (loss curve and model.pt: the same batches and kernels, gradients divided by 1) and fsdp's first loss
does (the same forward); the other one-process modes (the dp family, split) compute single's step on the
whole batch, so they follow its loss within TOLERANCE. A variant starts from its mode's first loss within its
own tolerance. Time to accuracy runs on Fashion-MNIST from ``--fashion`` (data/fashion-mnist, the folder
docs/gpus.md fills), or on generated data, which its row then names.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from mnist_dist.modes import MODES, Processes, compile_refusal
from mnist_dist.operations.tensorboard import read_scalars
from mnist_dist.tools.gpu_check import Row
from mnist_dist.tools.gpu_probes import composed
from mnist_dist.tools.run import train_in_subprocess
from mnist_dist.tools.time_to_accuracy import accuracy_curve, seconds_to

AGREE_STEPS = 20
TOLERANCE = 1e-3  # relative; cuDNN picks kernels per batch shape, so replicas differ in rounding
# name: (overrides, most relative difference of the first loss from the mode's own run). The first step
# has the same weights and batch: only the arithmetic differs (bf16 keeps 8 bits of mantissa, fp16 11,
# TF32 10; compile, NHWC and non-deterministic kernels only reorder fp32 sums).
VARIANTS = {
    "amp=bf16": (["amp=bf16"], 0.02),
    "amp=fp16": (["amp=fp16"], 0.01),
    "compile": (["compile=true"], 1e-3),
    "channels_last": (["channels_last=true"], 1e-3),
    "tf32": (["tf32=true"], 0.01),
    "deterministic=false": (["deterministic=false"], 1e-3),
}
GENERATED = "generated data"
BITWISE = ("ddp", "torch_ddp")  # at world size 1: single's whole run; fsdp: its first loss


def losses(run_dir: Path) -> list[float]:
    """The run's training loss per step, the mean over ranks."""
    return list(read_scalars(run_dir)["train/loss_global"].values())


def same_weights(run_dir: Path, other: Path) -> bool:
    """model.pt of both runs holds the same tensors, bit for bit, on the CPU (so that it loads without a GPU)."""
    ours, theirs = (torch.load(d / "model.pt", weights_only=True) for d in (run_dir, other))
    on_cpu = all(tensor.device.type == "cpu" for tensor in [*ours.values(), *theirs.values()])
    return on_cpu and ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def train(args, run_dir: Path, *overrides: str) -> tuple[dict | None, str]:
    """One training process under ``args.timeout``; its results.json (None if it failed or timed out) and,
    if so, its last error line or the timeout."""
    try:
        return train_in_subprocess(list(overrides), run_dir, args.timeout), ""
    except RuntimeError as error:
        return None, str(error)


def warmup(args) -> str:
    """Steps left out of images/s: 5 (the trainer's default), fewer on small data so that some are timed."""
    # the first step after warm-up starts the clock, so at least two must follow it
    return f"warmup_steps={min(5, max(0, args.train_images * args.epochs // 128 - 2))}"


def common(args, work: Path, gpus: int) -> tuple[str, ...]:
    """The overrides every mode and variant run shares: the generated data, dropout off, every step logged."""
    return (
        f"data.root={work / 'data'}",
        "data.mirrors=[]",
        f"batch_size={128 // gpus * gpus}",
        "log_every=1",
        warmup(args),
        f"device={args.device}",
        "model.dropout=false",
    )


def against_single(
    name: str, world_size: int, run_dir: Path, curve: list[float], single: Path
) -> tuple[str, str, bool]:
    """(proves, figure, passed): mode ``name``'s run against single's at the same number of GPUs."""
    reference = losses(single)
    if name in BITWISE and world_size == 1:
        differs = next((step for step, (a, b) in enumerate(zip(curve, reference), 1) if a != b), None)
        weights = same_weights(run_dir, single)
        figure = f"loss curve {'identical' if differs is None else f'differs from step {differs}'} ({len(curve)} steps)"
        figure += f", model.pt {'identical, on the CPU' if weights else 'differs, or not on the CPU'}"
        ok = differs is None and len(curve) == len(reference) and weights
        return "equals single bit for bit at world size 1 (loss curve, model.pt)", figure, ok
    if name == "fsdp" and world_size == 1:
        same = curve[0] == reference[0]
        figure = f"first loss {'identical' if same else f'{curve[0]!r} against {reference[0]!r}'}"
        return "starts from single's first loss bit for bit at world size 1", figure, same
    if MODES[name].processes is Processes.ONE:
        ours, theirs = torch.tensor(curve[:AGREE_STEPS]), torch.tensor(reference[:AGREE_STEPS])
        worst = ((ours - theirs).abs() / theirs.abs()).max().item()
        figure = f"{worst:.1e} from single's loss (at most {TOLERANCE:g})"
        return f"the mode trains, and follows single's loss over {AGREE_STEPS} steps", figure, worst <= TOLERANCE
    return "the mode trains", "", True


def check_modes(args, work: Path, gpus: int, names: list[str]) -> Iterator[Row]:
    """Each mode of ``names`` at ``gpus`` (as many as it can use), single first: images/s against single's,
    the final loss, and the comparison with single (``against_single``)."""
    speeds = {}
    for name in sorted(names, key=lambda name: name != "single"):
        mode_gpus, run_dir, started = MODES[name].devices(gpus), work / "runs" / f"{name}_{gpus}", time.monotonic()
        overrides = (f"mode={name}", f"gpus={mode_gpus}", f"epochs={args.epochs}", *common(args, work, gpus))
        results, error = train(args, run_dir, *overrides)
        row = Row(f"{name} gpus={mode_gpus}, {GENERATED}", "the mode trains", error, results is not None)
        if results is not None:
            curve, speeds[name] = losses(run_dir), results["train_images_per_s"]
            compared = name != "single" and "single" in speeds
            row.figure, row.ok = f"{speeds[name]:,.0f} images/s", math.isfinite(curve[-1])
            row.figure += f", {speeds['single'] / speeds[name] - 1:+.1%} time vs single" if compared else ""
            row.figure += f", final loss {curve[-1]:.4f}"
            if compared:
                world_size = mode_gpus if MODES[name].processes is Processes.PER_DEVICE else 1
                single = work / "runs" / f"single_{gpus}"
                row.proves, said, same = against_single(name, world_size, run_dir, curve, single)
                row.figure, row.ok = row.figure + (f"; {said}" if said else ""), row.ok and same
        row.seconds = time.monotonic() - started
        yield row


def check_variants(args, work: Path, gpus: int, cases: list[tuple[str, str]]) -> Iterator[Row]:
    """Each (mode, variant) of ``cases`` whose mode ran at ``gpus``, one epoch, ``args.jobs`` at a time, its first
    loss against the mode's; what the trainer refuses by design (compile_refusal) is said, not run."""
    cases = [(name, variant) for name, variant in cases if (work / "runs" / f"{name}_{gpus}" / "results.json").exists()]
    refused = {  # composed here: Hydra's global state is not for threads
        (name, variant): compile_refusal(
            composed(f"mode={name}", f"gpus={MODES[name].devices(gpus)}", *VARIANTS[variant][0]), args.device
        )
        for name, variant in cases
    }

    def run(case: tuple[str, str]) -> Row:
        name, variant = case
        overrides, tolerance = VARIANTS[variant]
        mode_gpus, started = MODES[name].devices(gpus), time.monotonic()
        row = Row(f"{name} {variant} gpus={mode_gpus}", f"starts from {name}'s first loss", "", False)
        if refused[case]:
            row.ok, row.figure = True, f"refused as designed: {refused[case]}"
            return row
        run_dir = work / "runs" / f"{name}_{variant.replace('=', '_')}"
        results, error = train(
            args, run_dir, f"mode={name}", f"gpus={mode_gpus}", "epochs=1", *common(args, work, gpus), *overrides
        )
        row.seconds = time.monotonic() - started
        if results is None:
            row.figure = error
            return row
        curve, first = losses(run_dir), losses(work / "runs" / f"{name}_{gpus}")[0]
        difference = abs(curve[0] - first) / abs(first)
        row.ok = difference <= tolerance and math.isfinite(curve[-1])
        row.figure = f"first loss {difference:.1e} from {name}'s (at most {tolerance:g}), last {curve[-1]:.4f}"
        return row

    with ThreadPoolExecutor(args.jobs) as pool:  # each a subprocess: the threads only wait
        yield from pool.map(run, cases)


def check_time_to_accuracy(args, work: Path) -> list[Row]:
    """recipe=fast to the highest of ``args.targets`` on Fashion-MNIST if ``args.fashion`` holds it (generated
    data otherwise, said in the row): the training seconds to each target on the run's curve. The default
    targets sit below the 92 % that recipe=fast ends near, so that reaching them is a margin, not a coin toss."""
    if (args.fashion / "train-images-idx3-ubyte.gz").exists():
        data = ("data=fashion_mnist", f"data.mirrors=[{args.fashion.resolve()}]", f"data.root={work / 'fashion'}")
        where = f"Fashion-MNIST from {args.fashion}"
    else:
        # batch 64: enough steps on the small generated set for OneCycle's warm-up and anneal phases
        data = (f"data.root={work / 'data'}", "data.mirrors=[]", "batch_size=64")
        where = f"{GENERATED} ({args.fashion} holds no Fashion-MNIST)"
    schedule = [f"epochs={args.tta_epochs}"] if args.tta_epochs else []  # default: the recipe's own
    target = args.targets[-1]
    overrides = ("recipe=fast", f"device={args.device}", *schedule, f"target_accuracy={target}", "eval_every_steps=47")
    proves = "time to accuracy, a target recipe=fast passes with margin (it ends near 92 % on Fashion-MNIST)"
    started = time.monotonic()
    results, error = train(args, work / "runs" / "fast", *overrides, *data)
    if results is None or results["time_to_target_s"] is None:
        rows = [Row(f"recipe=fast to {target:.1%}, {where}", proves, error or "not reached", False)]
    else:
        curve, rows = accuracy_curve(work / "runs" / "fast"), []
        for goal in args.targets:
            seconds = seconds_to(curve, goal)
            figure = "not reached" if seconds is None else f"{seconds:.2f} s"
            if goal == target:  # where the run stopped
                figure = f"{results['time_to_target_s']:.2f} s, {results['steps_to_target']} steps"
            figure += f", {results['train_images_per_s']:,.0f} images/s"
            reached = seconds is not None or goal == target
            rows.append(Row(f"recipe=fast to {goal:.1%}, {where}", proves, figure, reached))
    rows[0].seconds = time.monotonic() - started
    return rows
