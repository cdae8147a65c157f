"""GPU check: on one GPU, a row for each CUDA path that nothing else runs, each able to fail for what it names.

    pip install -e . && mkdir -p data/fashion-mnist && cp /usr/share/datasets/fashion-mnist/*.gz data/fashion-mnist/
    python -m mnist_dist.tools.gpu_check --quick         # the rows that matter: about 3 minutes on one H200
    python -m mnist_dist.tools.gpu_check                 # every mode and each mode's variants too
    python -m mnist_dist.tools.gpu_check --device cpu --quick   # the check itself, on a CPU (rows that need
                                                                 # CUDA are skipped, each with a note)

Rows, in order (docs/gpus.md says what each proves and which bug makes it fail):

- probes in this process (gpu_probes.py): dp's and functional dp's replica dtype under autocast, two threads
  on one GPU, ours against raw torch; the TF32 policy against float64;
- probes on ranks (gpu_wrappers.py): NCCL at world size 1 bound to its GPU; on two gloo ranks sharing the
  GPU, our DDP's exposed wait with overlap on against off, a BatchNorm model's reported evaluation against
  model.pt's, both DDPs' gradients against one process;
- the trainer (gpu_runs.py): single, ddp and torch_ddp at gpus=1 (NCCL); time to accuracy on Fashion-MNIST;
  without --quick also every mode and each mode's variants (amp, compile, channels_last, tf32, deterministic).

Prints a table naming the GPU and the date, each row's figure and seconds; exits non-zero if a row fails.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from mnist_dist.modes import MODES
from mnist_dist.operations import machine
from mnist_dist.tools import gpu_runs, gpu_wrappers
from mnist_dist.tools.gpu_probes import Row, replica_dtype, tf32_policy, timed
from mnist_dist.tools.synthetic import write_idx
from mnist_dist.tools.time_to_accuracy import fractions

FASHION = Path("data", "fashion-mnist")  # the folder docs/gpus.md fills, under the directory it runs from


def preflight(args) -> tuple[list[str], list[str]]:
    """(notes, problems): the package installed (its configs are found through it), a C compiler for the
    compile variants (torch.compile's inductor builds C++), the Fashion-MNIST files."""
    notes, problems = [], []
    try:
        notes.append(f"mnist_dist {importlib.metadata.version('mnist_dist')} installed")
        importlib.import_module("mnist_dist.conf")
    except (importlib.metadata.PackageNotFoundError, ModuleNotFoundError):
        problems.append("mnist_dist is not installed (its Hydra configs come with it): pip install -e .")
    compiler = next((shutil.which(cc) for cc in ("cc", "gcc", "clang") if shutil.which(cc)), None)
    if compiler is None and "compile" in args.variants:
        args.variants.remove("compile")
        notes.append("no C compiler (cc, gcc, clang): the compile variants are skipped (apt-get install gcc)")
    if not (args.fashion / "train-images-idx3-ubyte.gz").exists():
        notes.append(f"{args.fashion} holds no Fashion-MNIST: time to accuracy runs on generated data")
    return notes, problems


def on_ranks(name: str, device_type: str, work: Path) -> list[Row]:
    """One of gpu_wrappers' rank probes: its worker on 2 gloo ranks sharing the device (NCCL: 1 rank)."""
    worker, rows = RANK_PROBES[name]
    where = work / name
    where.mkdir(parents=True, exist_ok=True)
    report = gpu_wrappers.ranks(worker, device_type, where, world_size=1 if name == "nccl" else 2)
    return rows(report, where, device_type)


RANK_PROBES = {
    "nccl": (gpu_wrappers.nccl_worker, lambda report, where, device: gpu_wrappers.nccl_row(report)),
    "overlap": (
        gpu_wrappers.overlap_worker,
        lambda r, where, device: gpu_wrappers.overlap_row(
            r["on"], r["off"], f"2 gloo ranks on one {device}", judged=device == "cuda"
        ),
    ),
    "batchnorm": (gpu_wrappers.batchnorm_worker, gpu_wrappers.batchnorm_row),
    "gradients": (
        gpu_wrappers.gradient_worker,
        lambda report, where, device: gpu_wrappers.gradient_rows(report, device),
    ),
}


def probe_rows(args, work: Path) -> list[Row]:
    """The probes: in this process (CUDA only: on a CPU the wrappers pass through and fp32 is fp32, so
    tests/test_gpu_probes.py fakes CUDA there instead), then on ranks."""
    rows = []
    if args.device == "cuda":
        device = torch.device("cuda:0")
        for name in ("dp", "dp_functional"):
            rows += timed(replica_dtype, name, device)
        rows += timed(tf32_policy, device)
        rows += timed(on_ranks, "nccl", args.device, work)
    for name in ("overlap", "batchnorm", "gradients"):
        rows += timed(on_ranks, name, args.device, work)
    return rows


def trainer_rows(args, work: Path, gpus: int) -> list[Row]:
    rows = []
    if not args.quick:
        mode_rows, first_losses = gpu_runs.check_modes(args, work, gpus)
        rows += mode_rows + gpu_runs.check_variants(args, work, gpus, first_losses)
    for check in (gpu_runs.check_overhead, gpu_runs.check_time_to_accuracy):
        started = time.monotonic()
        found = check(args, work)
        found[0].seconds = time.monotonic() - started
        rows += found
    return rows


def table(rows: list[Row], header: list[str]) -> str:
    lines = [*header, "", "| row | proves | figure | result | s |", "|---|---|---|---|---|"]
    for row in rows:
        seconds = f"{row.seconds:.0f}" if row.seconds else ""
        lines.append(f"| {row.name} | {row.proves} | {row.figure} | {'ok' if row.ok else '**FAILED**'} | {seconds} |")
    return "\n".join(lines)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="the rows that matter: no modes or variants")
    parser.add_argument("--train-images", type=int, default=12_800, help="generated images: x epochs / batch = steps")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--fashion", type=Path, default=FASHION, help="the four Fashion-MNIST .gz files")
    parser.add_argument("--targets", type=fractions, default="0.91,0.92", help="recipe=fast's test accuracies")
    parser.add_argument("--tta-epochs", type=int, help="recipe=fast's schedule (default: the recipe's)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: the modes checked (all)")
    parser.add_argument("--variants", default=",".join(gpu_runs.VARIANTS), help="comma-separated: of each mode (all)")
    parser.add_argument("--jobs", type=int, default=4, help="variant runs at a time")
    args = parser.parse_args()
    args.modes, args.variants = args.modes.split(","), [v for v in args.variants.split(",") if v]
    if unknown := set(args.modes) - set(MODES):
        parser.error(f"--modes: no mode {', '.join(sorted(unknown))}; the modes are {', '.join(MODES)}")
    if unknown := set(args.variants) - set(gpu_runs.VARIANTS):
        known = ", ".join(gpu_runs.VARIANTS)
        parser.error(f"--variants: no variant {', '.join(sorted(unknown))}; the variants are {known}")
    return args


def main() -> int:
    args = arguments()
    gpus = torch.cuda.device_count() if args.device == "cuda" else 2
    if gpus == 0:
        print("gpu_check: no CUDA device is visible (--device cpu checks the script itself)")
        return 1
    notes, problems = preflight(args)
    if problems:
        print("\n".join(f"gpu_check: {problem}" for problem in problems))
        return 1
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    write_idx(work / "data" / "MNIST" / "raw", n_train=args.train_images, n_test=2_000)
    rows = probe_rows(args, work) + trainer_rows(args, work, gpus)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else machine.describe()["cpu"]
    header = [
        f"gpu_check{' --quick' if args.quick else ''} on {device} ({gpus} visible), "
        f"{datetime.date.today().isoformat()}, {time.monotonic() - started:.0f} s",
        machine.summary_line(machine.describe()),
        *notes,
    ]
    print("\n" + table(rows, header))
    failed = [row for row in rows if not row.ok]
    print("\n" + ("\n".join(f"FAILED {row.name}: {row.figure}" for row in failed) if failed else "all rows passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
