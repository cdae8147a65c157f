"""The GPU check's rows that run the trainer (``python -m mnist_dist`` in a fresh process each): every mode,
each mode's variants, DDP's overhead at one GPU, and time to accuracy. Each returns ``Row``s (gpu_probes.py).

The modes and variants train on generated data with dropout off (replicas would draw different masks), and
their rows say so; time to accuracy runs on Fashion-MNIST from ``--fashion`` (data/fashion-mnist, the folder
docs/gpus.md fills), or on generated data, which its row then names.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from mnist_dist.modes import MODES, Processes, compile_refusal
from mnist_dist.operations.tensorboard import read_scalars
from mnist_dist.tools.gpu_probes import Row, composed
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


def losses(run_dir: Path) -> list[float]:
    """The run's training loss per step, the mean over ranks."""
    return list(read_scalars(run_dir)["train/loss_global"].values())


def train(run_dir: Path, *overrides: str) -> tuple[dict | None, str]:
    """One training process; its results.json (None if it failed) and, if it failed, its last error line."""
    try:
        return train_in_subprocess(list(overrides), run_dir), ""
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


def check_modes(args, work: Path, gpus: int) -> tuple[list[Row], dict[str, float]]:
    """Every mode of ``args.modes`` on as many devices as it can use; the other one-process modes (the dp
    family, split) compute single's step on the whole batch, so they follow its loss. Also returns each mode's
    first loss, the baseline of its variants."""
    rows, curves = [], {}
    for name in args.modes:
        mode_gpus = MODES[name].devices(gpus)
        overrides = (f"mode={name}", f"gpus={mode_gpus}", f"epochs={args.epochs}", *common(args, work, gpus))
        results, error = train(work / "runs" / name, *overrides)
        row = Row(f"{name}, {mode_gpus} device(s), {GENERATED}", "the mode trains", error, results is not None)
        if results is not None:
            curves[name] = losses(work / "runs" / name)
            row.figure = f"{results['train_images_per_s']:,.0f} images/s, final loss {curves[name][-1]:.4f}"
        rows.append(row)
    for row, name in zip(rows, args.modes):
        if MODES[name].processes is Processes.ONE and name != "single" and name in curves and "single" in curves:
            ours, reference = torch.tensor(curves[name][:AGREE_STEPS]), torch.tensor(curves["single"][:AGREE_STEPS])
            worst = ((ours - reference).abs() / reference.abs()).max().item()
            row.proves = f"the mode trains, and follows single's loss over {AGREE_STEPS} steps"
            row.figure += f"; {worst:.1e} from single's loss (at most {TOLERANCE:g})"
            row.ok = worst <= TOLERANCE
    return rows, {name: curve[0] for name, curve in curves.items()}


def check_variants(args, work: Path, gpus: int, first_losses: dict[str, float]) -> list[Row]:
    """Each variant of each mode that ran, one epoch, ``args.jobs`` at a time; what the trainer refuses by
    design (compile_refusal) is said, not run."""
    cases = [(name, variant) for name in args.modes if name in first_losses for variant in args.variants]
    refused = {  # composed here: Hydra's global state is not for threads
        (name, variant): compile_refusal(
            composed(f"mode={name}", f"gpus={MODES[name].devices(gpus)}", *VARIANTS[variant][0]), args.device
        )
        for name, variant in cases
    }

    def run(case: tuple[str, str]) -> Row:
        name, variant = case
        overrides, tolerance = VARIANTS[variant]
        mode_gpus = MODES[name].devices(gpus)
        row = Row(f"{name} {variant}, {mode_gpus} device(s)", f"starts from {name}'s first loss", "", False)
        if refused[case]:
            row.ok, row.figure = True, f"refused as designed: {refused[case]}"
            return row
        run_dir = work / "runs" / f"{name}_{variant.replace('=', '_')}"
        results, error = train(
            run_dir, f"mode={name}", f"gpus={mode_gpus}", "epochs=1", *common(args, work, gpus), *overrides
        )
        if results is None:
            row.figure = error
            return row
        curve = losses(run_dir)
        difference = abs(curve[0] - first_losses[name]) / abs(first_losses[name])
        row.ok = difference <= tolerance and math.isfinite(curve[-1])
        row.figure = f"first loss {difference:.1e} from {name}'s (at most {tolerance:g}), last {curve[-1]:.4f}"
        return row

    with ThreadPoolExecutor(args.jobs) as pool:  # each a subprocess: the threads only wait
        return list(pool.map(run, cases))


def check_overhead(args, work: Path) -> list[Row]:
    """single, ddp and torch_ddp with gpus=1 (NCCL on CUDA, gloo on a CPU) on generated data: images/s, and
    each DDP's time against single's."""
    data = (f"data.root={work / 'data'}", "data.mirrors=[]", f"epochs={args.epochs}", "batch_size=128", warmup(args))
    speeds, rows = {}, []
    for name in ("single", "ddp", "torch_ddp"):
        results, error = train(work / "runs" / f"{name}_1", f"mode={name}", "gpus=1", f"device={args.device}", *data)
        speeds[name] = results["train_images_per_s"] if results else float("nan")
        figure = error or f"{speeds[name]:,.0f} images/s" + (
            "" if name == "single" else f", {speeds['single'] / speeds[name] - 1:+.1%} time vs single"
        )
        rows.append(Row(f"{name} gpus=1, {GENERATED}", "the trainer's CUDA path end to end", figure, not error))
    return rows


def check_time_to_accuracy(args, work: Path) -> list[Row]:
    """recipe=fast to the highest of ``args.targets`` on Fashion-MNIST if ``args.fashion`` holds it (generated
    data otherwise, said in the row): the training seconds to each target on the run's curve."""
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
    results, error = train(work / "runs" / "fast", *overrides, *data)
    if results is None or results["time_to_target_s"] is None:
        return [Row(f"recipe=fast to {target:.1%}, {where}", "time to accuracy", error or "not reached", False)]
    curve, rows = accuracy_curve(work / "runs" / "fast"), []
    for goal in args.targets:
        seconds = seconds_to(curve, goal)
        figure = "not reached" if seconds is None else f"{seconds:.2f} s"
        if goal == target:  # where the run stopped
            figure = f"{results['time_to_target_s']:.2f} s, {results['steps_to_target']} steps"
        figure += f", {results['train_images_per_s']:,.0f} images/s"
        reached = seconds is not None or goal == target
        rows.append(Row(f"recipe=fast to {goal:.1%}, {where}", "time to accuracy", figure, reached))
    return rows
