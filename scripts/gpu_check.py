"""GPU check: every mode on the visible GPUs, on generated data, in one go (under 5 minutes on one GPU).

    python scripts/gpu_check.py                 # on a machine with CUDA
    python scripts/gpu_check.py --device cpu    # the same checks on the CPU (a smoke test of this script)

Runs single, dp and its variants, split, ddp, torch_ddp and fsdp for a few hundred steps with dropout off
(replicas would draw different masks), checks each exits 0, that dp, functional dp and block dp
follow single's loss over the first steps, and prints one table: mode, images/s, final loss.
Exits non-zero if any check fails. Needs nothing but the project installed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mnist_dist.modes import MODES, DataParallelMode
from mnist_dist.synthetic import write_idx

AGREE_STEPS = 20
TOLERANCE = 1e-3  # relative; cuDNN picks kernels per batch shape, so replicas differ in rounding


def losses(run_dir: Path) -> list[float]:
    events = EventAccumulator(str(run_dir / "tb"))  # rank 0: mnist_dist.metrics.tb_dir
    events.Reload()
    return [e.value for e in events.Scalars("train/loss")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--train-images", type=int, default=12_800, help="x 1 epoch / batch = steps")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    gpus = torch.cuda.device_count() if args.device == "cuda" else 2
    if gpus == 0:
        print("gpu_check: no CUDA device is visible (use --device cpu to check the script itself)")
        return 1
    batch = 128 // gpus * gpus
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    write_idx(work / "data" / "MNIST" / "raw", n_train=args.train_images, n_test=2_000)
    # Every mode of the table, on as many devices as it can use.
    modes = {name: mode.devices(gpus) for name, mode in MODES.items()}
    rows, curves, failed = [], {}, []
    for mode, mode_gpus in modes.items():
        run_dir = work / "runs" / mode
        command = [
            sys.executable,
            "-m",
            "mnist_dist",
            f"mode={mode}",
            f"gpus={mode_gpus}",
            f"device={args.device}",
            f"data.root={work / 'data'}",
            "data.mirrors=[]",
            f"epochs={args.epochs}",
            f"batch_size={batch}",
            "model.dropout=false",
            "log_every=1",
            "progress=false",
            f"hydra.run.dir={run_dir}",
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode:
            failed.append(f"{mode}: exit {result.returncode}: {result.stderr.strip().splitlines()[-1:]}")
            rows.append((mode, mode_gpus, float("nan"), float("nan")))
            continue
        results = json.loads((run_dir / "results.json").read_text())
        curves[mode] = losses(run_dir)
        rows.append((mode, mode_gpus, results["train_images_per_s"], curves[mode][-1]))
    for mode in [name for name, entry in MODES.items() if entry.schema is DataParallelMode]:
        if mode in curves and "single" in curves:
            ours = torch.tensor(curves[mode][:AGREE_STEPS])
            reference = torch.tensor(curves["single"][:AGREE_STEPS])
            worst = ((ours - reference).abs() / reference.abs()).max().item()
            if worst > TOLERANCE:
                failed.append(
                    f"{mode}: loss differs from single by {worst:.2e} (> {TOLERANCE:g}) "
                    f"within the first {AGREE_STEPS} steps"
                )
    print(
        f"\n{args.device}, {gpus} device(s), global batch {batch}, {args.epochs} epoch(s) of "
        f"{args.train_images} generated images\n"
    )
    print("| mode | devices | images/s | final loss |\n|---|---|---|---|")
    for mode, mode_gpus, speed, loss in rows:
        print(f"| {mode} | {mode_gpus} | {speed:,.0f} | {loss:.4f} |")
    print("\n" + ("\n".join(f"FAILED {line}" for line in failed) if failed else "all checks passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
