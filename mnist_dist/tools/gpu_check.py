"""GPU check: every mode on the visible GPUs and the checks nothing else runs, in one go (one H200: see
docs/gpus.md for the time budget).

    mkdir -p data/fashion-mnist && cp /usr/share/datasets/fashion-mnist/*.gz data/fashion-mnist/
    python -m mnist_dist.tools.gpu_check               # on a machine with CUDA
    python -m mnist_dist.tools.gpu_check --device cpu  # every part that can run on a CPU (a smoke test)

1. modes: single, dp and its variants, split, ddp, torch_ddp and fsdp for a few hundred steps on generated
   data with dropout off (replicas would draw different masks): each exits 0, and dp, functional dp
   and block dp follow single's loss over the first steps. With 2 ranks or more, ddp's comm_wait > 0.
2. variants, per mode: amp=bf16, amp=fp16, compile, channels_last, tf32=true and deterministic=false
   (the mode's own run has tf32 off, deterministic on): each exits 0 (or is refused in one line where
   the combination cannot work) and its first loss, same weights and batch, is the mode's own within the
   variant's rounding. They run ``--jobs`` at a time: their images/s are not shown.
3. with 2 GPUs or more: the dtype dp's replicas compute in under amp=bf16 (each in a thread of its own).
4. gradients: our DDP and torch DDP on 2 gloo ranks sharing one GPU (CUDA tensors, so our DDP's side
   stream runs with real concurrency), TF32 off, equal one process's gradients within 1e-5.
5. overhead: single, ddp and torch_ddp with gpus=1 (NCCL on CUDA); ddp's images/s against single's.
6. time to accuracy: recipe=fast to each of --targets on Fashion-MNIST (data/fashion-mnist, an ignored folder;
   generated data when it is absent), the trainer's clock synchronising the device at every start and stop.

Checks 3 and 4 wrap models directly instead of training (gpu_wrappers.py). Prints one table and the time
it took; exits non-zero if any check fails. Needs nothing but the project installed.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from mnist_dist.modes import MODES, DataParallelMode
from mnist_dist.tensorboard import read_scalars
from mnist_dist.tools.gpu_wrappers import check_gradients, check_replica_dtype
from mnist_dist.tools.run import train_in_subprocess
from mnist_dist.tools.synthetic import write_idx
from mnist_dist.tools.time_to_accuracy import accuracy_curve, fractions, seconds_to

AGREE_STEPS = 20
TOLERANCE = 1e-3  # relative; cuDNN picks kernels per batch shape, so replicas differ in rounding
FASHION = Path(__file__).resolve().parent.parent / "data" / "fashion-mnist"  # ignored by git: carry it
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
REFUSED = "error: compile=true with mode="  # combinations the trainer refuses in one line, by design


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
    """The overrides every run of checks 1 and 2 shares: the generated data, dropout off, every step logged."""
    return (
        f"data.root={work / 'data'}",
        "data.mirrors=[]",
        f"batch_size={128 // gpus * gpus}",
        "log_every=1",
        warmup(args),
        f"device={args.device}",
        "model.dropout=false",
    )


def check_modes(args, work: Path, gpus: int, failed: list[str]) -> tuple[list[tuple], dict[str, dict]]:
    """Every mode of the table, on as many devices as it can use; dp variants follow single's loss. Also
    returns each mode's results.json."""
    rows, curves, done = [], {}, {}
    for name in args.modes:
        mode_gpus = MODES[name].devices(gpus)
        run_dir = work / "runs" / name
        overrides = (f"mode={name}", f"gpus={mode_gpus}", f"epochs={args.epochs}", *common(args, work, gpus))
        results, error = train(run_dir, *overrides)
        if results is None:
            failed.append(f"{name}: {error}")
            rows.append((name, mode_gpus, float("nan"), float("nan")))
            continue
        curves[name], done[name] = losses(run_dir), results
        rows.append((name, mode_gpus, results["train_images_per_s"], curves[name][-1]))
        waited = results["step_time_ms"]["comm_wait"]
        if name == "ddp" and mode_gpus > 1 and not waited > 0:  # 0: the phases were not timed on the stream
            failed.append(f"ddp: comm_wait is {waited} ms on {mode_gpus} ranks; it must be > 0")
    for name in [name for name, entry in MODES.items() if entry.schema is DataParallelMode]:
        if name in curves and "single" in curves:
            ours = torch.tensor(curves[name][:AGREE_STEPS])
            reference = torch.tensor(curves["single"][:AGREE_STEPS])
            worst = ((ours - reference).abs() / reference.abs()).max().item()
            if worst > TOLERANCE:
                failed.append(
                    f"{name}: loss differs from single by {worst:.2e} (> {TOLERANCE:g}) "
                    f"within the first {AGREE_STEPS} steps"
                )
    return rows, {name: {**results, "first_loss": curves[name][0]} for name, results in done.items()}


def check_variants(args, work: Path, gpus: int, baselines: dict[str, dict], failed: list[str]) -> list[tuple]:
    """Each variant of each mode that ran, one epoch, ``args.jobs`` at a time: (mode, variant, devices, result)."""
    cases = [(name, variant) for name in args.modes if name in baselines for variant in args.variants]

    def run(case: tuple[str, str]) -> tuple:
        name, variant = case
        overrides, tolerance = VARIANTS[variant]
        mode_gpus = MODES[name].devices(gpus)
        run_dir = work / "runs" / f"{name}_{variant.replace('=', '_')}"
        results, error = train(
            run_dir, f"mode={name}", f"gpus={mode_gpus}", "epochs=1", *common(args, work, gpus), *overrides
        )
        if results is None:
            if REFUSED in error and variant == "compile":
                return name, variant, mode_gpus, f"refused as designed: use {error.split('; use ')[-1]}"
            failed.append(f"{name} {variant}: {error}")
            return name, variant, mode_gpus, "FAILED"
        curve = losses(run_dir)
        reference = baselines[name]["first_loss"]
        difference = abs(curve[0] - reference) / abs(reference)
        if not difference <= tolerance or not math.isfinite(curve[-1]):
            failed.append(
                f"{name} {variant}: first loss {difference:.1e} from {name}'s (> {tolerance:g}), last {curve[-1]}"
            )
        return name, variant, mode_gpus, f"first loss {difference:.1e} from {name}'s, last {curve[-1]:.4f}"

    with ThreadPoolExecutor(args.jobs) as pool:  # each a subprocess: the threads only wait
        return list(pool.map(run, cases))


def check_overhead(args, work: Path, failed: list[str]) -> dict[str, float]:
    """single, and the checked ones of ddp and torch_ddp, on one device (NCCL on CUDA, gloo on CPU):
    images/s of each; single is the baseline of the others' overhead."""
    speeds = {}
    data = (f"data.root={work / 'data'}", "data.mirrors=[]", f"epochs={args.epochs}", "batch_size=128", warmup(args))
    for name in ["single", *[name for name in ("ddp", "torch_ddp") if name in args.modes]]:
        results, error = train(work / "runs" / f"{name}_1", f"mode={name}", "gpus=1", f"device={args.device}", *data)
        if results is None:
            failed.append(f"{name} gpus=1: {error}")
        speeds[name] = results["train_images_per_s"] if results else float("nan")
    return speeds


def check_time_to_accuracy(args, work: Path, failed: list[str]) -> tuple[str, dict | None]:
    """recipe=fast to the highest target on Fashion-MNIST if it is there (generated data otherwise); its
    results.json with ``seconds_to``, the training seconds to each target on the run's curve."""
    if (args.fashion / "train-images-idx3-ubyte.gz").exists():
        data, where = (
            ("data=fashion_mnist", f"data.mirrors=[{args.fashion}]", f"data.root={work / 'fashion'}"),
            "Fashion-MNIST",
        )
    else:
        # batch 64: enough steps on the small generated set for OneCycle's warm-up and anneal phases
        data = (f"data.root={work / 'data'}", "data.mirrors=[]", "batch_size=64")
        where = f"generated data ({args.fashion} is empty)"
    schedule = [f"epochs={args.tta_epochs}"] if args.tta_epochs else []  # default: the recipe's own
    target = args.targets[-1]
    results, error = train(
        work / "runs" / "fast",
        "recipe=fast",
        f"device={args.device}",
        *schedule,
        f"target_accuracy={target}",
        "eval_every_steps=47",
        *data,
    )
    if results is None or results["time_to_target_s"] is None:
        failed.append(f"recipe=fast: {error or f'did not reach {target:.1%} on {where}'}")
        return where, None
    curve = accuracy_curve(work / "runs" / "fast")
    return where, {**results, "seconds_to": [seconds_to(curve, t) for t in args.targets]}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--train-images", type=int, default=12_800, help="x 1 epoch / batch = steps")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--fashion", type=Path, default=FASHION, help="the four Fashion-MNIST .gz files")
    parser.add_argument("--targets", type=fractions, default="0.91,0.92", help="recipe=fast's test accuracies")
    parser.add_argument("--tta-epochs", type=int, help="recipe=fast's schedule (default: the recipe's)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: the modes checked (all)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated: of each mode (all)")
    parser.add_argument("--jobs", type=int, default=4, help="variant runs at a time")
    args = parser.parse_args()
    args.modes, args.variants = args.modes.split(","), [v for v in args.variants.split(",") if v]
    if unknown := set(args.modes) - set(MODES):
        parser.error(f"--modes: no mode {', '.join(sorted(unknown))}; the modes are {', '.join(MODES)}")
    if unknown := set(args.variants) - set(VARIANTS):
        parser.error(f"--variants: no variant {', '.join(sorted(unknown))}; the variants are {', '.join(VARIANTS)}")
    return args


def main() -> int:
    args = arguments()
    gpus = torch.cuda.device_count() if args.device == "cuda" else 2
    if gpus == 0:
        print("gpu_check: no CUDA device is visible (use --device cpu to check the script itself)")
        return 1
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    write_idx(work / "data" / "MNIST" / "raw", n_train=args.train_images, n_test=2_000)
    failed: list[str] = []
    rows, baselines = check_modes(args, work, gpus, failed)
    variants = check_variants(args, work, gpus, baselines, failed)
    dtypes = check_replica_dtype(failed) if args.device == "cuda" and gpus > 1 else {}
    worst = check_gradients(args.device, work, failed)
    speeds = check_overhead(args, work, failed)
    where, fast = check_time_to_accuracy(args, work, failed)
    print(
        f"\n{args.device}, {gpus} device(s), {args.epochs} epoch(s) of {args.train_images} generated images, "
        f"{time.monotonic() - started:.0f} s\n\n| check | devices | images/s | result |\n|---|---|---|---|"
    )
    for mode, mode_gpus, speed, loss in rows:
        print(f"| {mode} | {mode_gpus} | {speed:,.0f} | final loss {loss:.4f} |")
    if "ddp" in baselines and baselines["ddp"]["world_size"] > 1:
        ranks, phases = baselines["ddp"]["world_size"], baselines["ddp"]["step_time_ms"]
        print(
            f"| ddp comm_wait, {ranks} ranks | {ranks} | | {phases['comm_wait']:.3f} of {sum(phases.values()):.3f} ms |"
        )
    for mode, variant, mode_gpus, result in variants:
        print(f"| {mode} {variant} | {mode_gpus} | | {result} |")
    for name, found in dtypes.items():
        print(f"| {name} replicas under amp=bf16 | 2 | | {found} |")
    print_rest(args, worst, speeds, where, fast)
    print("\n" + ("\n".join(f"FAILED {line}" for line in failed) if failed else "all checks passed"))
    return 1 if failed else 0


def print_rest(args, worst: dict, speeds: dict, where: str, fast: dict | None) -> None:
    for name, difference in worst.items():
        print(f"| {name} gradients, 2 gloo ranks on one {args.device} | 1 | | max difference {difference:.1e} |")
    for name, speed in speeds.items():
        overhead = f"{speeds['single'] / speed - 1:+.1%} time vs single" if name != "single" else "baseline"
        print(f"| {name} gpus=1 | 1 | {speed:,.0f} | {overhead} |")
    for target, seconds in zip(args.targets, fast["seconds_to"] if fast else []):
        reached = "not reached" if seconds is None else f"{seconds:.2f} s"
        if target == args.targets[-1]:  # where the run stopped
            reached = f"{fast['time_to_target_s']:.2f} s, {fast['steps_to_target']} steps"
        print(f"| recipe=fast to {target:.1%}, {where} | 1 | {fast['train_images_per_s']:,.0f} | {reached} |")


if __name__ == "__main__":
    sys.exit(main())
