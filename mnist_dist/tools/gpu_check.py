"""GPU check: on one GPU, a row for each CUDA path that nothing else runs, each able to fail for what it names.

    pip install -e . && mkdir -p data/fashion-mnist && cp /usr/share/datasets/fashion-mnist/*.gz data/fashion-mnist/
    python -m mnist_dist.tools.gpu_check --quick         # the rows that matter
    python -m mnist_dist.tools.gpu_check                 # every mode and each mode's variants too
    python -m mnist_dist.tools.gpu_check --device cpu --quick   # the check itself, on a CPU (rows that need
                                                                 # CUDA are skipped, each with a note)

Rows, in order (docs/gpus.md says what each proves and which bug makes it fail):

- probes (gpu_probes.py, CUDA only): dp's and functional dp's replica dtype under autocast, two threads on
  one GPU, ours against raw torch; the TF32 policy against float64;
- probes on ranks (gpu_wrappers.py): NCCL at world size 1 bound to its GPU (CUDA only); on two gloo ranks,
  our DDP's exposed wait with overlap on against off (judged only where each rank has a GPU of its own), a
  BatchNorm model's reported evaluation against model.pt's, both DDPs' gradients against one process;
- the trainer (gpu_runs.py): single, ddp, torch_ddp, fsdp and split at gpus=1 (ddp and torch_ddp equal to
  single bit for bit); single with amp=bf16, compile=true and channels_last=true (CUDA only); time to
  accuracy on Fashion-MNIST; without --quick also every mode on every GPU and each mode's variants.

Nothing the check starts can hang it: every probe and training runs in a process of its own, killed with
the processes it started after ``--timeout`` seconds (a failed row that says so). Each row is printed as it
finishes and appended to ``--out`` (outputs/gpu_check.md) under a header naming the GPU and the date, so a killed
check leaves its rows; the end says which failed, and the exit status is non-zero if one did. The check
imports Hydra only after its preflight has said whether it is installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import importlib.metadata
import importlib.util
import itertools
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from mnist_dist.operations import machine
from mnist_dist.tools.run import bounded
from mnist_dist.tools.synthetic import write_idx
from mnist_dist.tools.time_to_accuracy import fractions

FASHION = Path("data", "fashion-mnist")  # the folder docs/gpus.md fills, under the directory it runs from
# What the package needs beyond the torch stack a GPU machine comes with: import name, distribution
NEEDED = {"hydra": "hydra-core", "omegaconf": "omegaconf", "antlr4": "antlr4-python3-runtime"}
INSTALL = (
    "pip install -e . (offline, from the prepared folder: pip install --no-index --find-links offline/wheels -e .)"
)
PROBES = ("dp", "dp_functional", "tf32", "nccl", "overlap", "batchnorm", "gradients")
CUDA_PROBES = PROBES[:4]
ONE_GPU = ("single", "ddp", "torch_ddp", "fsdp", "split")  # at gpus=1, each against single
QUICK_VARIANTS = ("amp=bf16", "compile", "channels_last")  # of single at gpus=1, on CUDA


@dataclasses.dataclass
class Row:
    name: str
    proves: str
    figure: str
    ok: bool
    seconds: float = 0.0


def preflight(args) -> tuple[list[str], list[str]]:
    """(notes, missing): what the package needs and the package itself (its Hydra configs come with it); a C
    compiler for the compile variants (torch.compile's inductor builds C++); the Fashion-MNIST files."""
    notes, missing = [], []
    for module, distribution in NEEDED.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(distribution)
    try:
        notes.append(f"mnist_dist {importlib.metadata.version('mnist_dist')} installed")
        if importlib.util.find_spec("mnist_dist.conf") is None:  # found, not run: it imports Hydra
            raise importlib.metadata.PackageNotFoundError("mnist_dist.conf")
    except importlib.metadata.PackageNotFoundError:
        missing.append("mnist_dist (installed: its Hydra configs come with it)")
    if not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")):
        args.compiler = False
        notes.append("no C compiler (cc, gcc, clang): the compile variants are skipped (apt-get install gcc)")
    if not (args.fashion / "train-images-idx3-ubyte.gz").exists():
        notes.append(f"{args.fashion} holds no Fashion-MNIST: time to accuracy runs on generated data")
    if args.device == "cpu":
        skipped = ", ".join(f"probe {name}" for name in CUDA_PROBES) + (", the variant runs" if args.quick else "")
        notes.append(f"on a CPU, what needs CUDA is skipped: {skipped}")
    return notes, missing


# probes: each in a process of its own (--probe NAME), its rows as JSON ----------------------------------------
def probe(name: str, device_type: str, work: Path) -> list[Row]:
    """Probe ``name``'s rows, computed in this process (the child a check starts)."""
    from mnist_dist.tools import gpu_probes, gpu_wrappers

    if name in ("dp", "dp_functional"):
        return [gpu_probes.replica_dtype(name, torch.device("cuda:0"))]
    if name == "tf32":
        return [gpu_probes.tf32_policy(torch.device("cuda:0"))]
    worker, rows = {
        "nccl": (gpu_wrappers.nccl_worker, lambda report: [gpu_wrappers.nccl_row(report)]),
        "overlap": (gpu_wrappers.overlap_worker, lambda report: [gpu_wrappers.overlap_report_row(report, device_type)]),
        "batchnorm": (
            gpu_wrappers.batchnorm_worker,
            lambda report: [gpu_wrappers.batchnorm_row(report, where, device_type)],
        ),
        "gradients": (gpu_wrappers.gradient_worker, lambda report: gpu_wrappers.gradient_rows(report, device_type)),
    }[name]
    where = work / name  # on 2 gloo ranks sharing the device (NCCL: 1 rank)
    where.mkdir(parents=True, exist_ok=True)
    return rows(gpu_wrappers.ranks(worker, device_type, where, world_size=1 if name == "nccl" else 2))


def probe_command(args, name: str, work: Path) -> list[str]:
    module = [sys.executable, "-m", "mnist_dist.tools.gpu_check"]
    return [*module, "--probe", name, "--device", args.device, "--work", str(work)]


def probe_rows(args, work: Path) -> Iterator[Row]:
    """Each probe in a process of its own under ``args.timeout``; one that fails, hangs or crashes is a failed row."""
    for name in [name for name in PROBES if args.device == "cuda" or name not in CUDA_PROBES]:
        started = time.monotonic()
        try:
            result = bounded(probe_command(args, name, work), args.timeout)
            if result.returncode:
                last = (result.stderr.strip().splitlines() or ["no error output"])[-1]
                raise RuntimeError(f"exit {result.returncode}: {last}")
            rows = [Row(**row) for row in json.loads(result.stdout.strip().splitlines()[-1])]
        except RuntimeError as error:
            rows = [Row(f"probe {name}", "", str(error), False)]
        rows[0].seconds = time.monotonic() - started
        yield from rows


# the trainer ----------------------------------------------------------------------------------------------
def trainer_rows(args, work: Path, gpus: int) -> Iterator[Row]:
    from mnist_dist.tools import gpu_runs

    extra = [name for name in args.modes if name not in ONE_GPU] if not args.quick and gpus == 1 else []
    yield from gpu_runs.check_modes(args, work, 1, [*ONE_GPU, *extra])
    if args.quick:
        chosen = [v for v in QUICK_VARIANTS if v in args.variants] if args.device == "cuda" else []
        yield from gpu_runs.check_variants(args, work, 1, [("single", variant) for variant in chosen])
    else:
        if gpus > 1:
            yield from gpu_runs.check_modes(args, work, gpus, args.modes)
        yield from gpu_runs.check_variants(args, work, gpus, [(m, v) for m in args.modes for v in args.variants])
    yield from gpu_runs.check_time_to_accuracy(args, work)


# the table ------------------------------------------------------------------------------------------------
def say(out: Path, *lines: str) -> None:
    """``lines`` printed at once and appended to ``out``: a check killed later keeps them."""
    text = "\n".join(lines)
    print(text, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as file:
        file.write(text + "\n")


def line(row: Row) -> str:
    seconds = f"{row.seconds:.0f}" if row.seconds else ""
    return f"| {row.name} | {row.proves} | {row.figure} | {'ok' if row.ok else '**FAILED**'} | {seconds} |"


def arguments() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="the rows that matter: no modes or variants on every GPU")
    parser.add_argument("--out", type=Path, default=Path("outputs", "gpu_check.md"), help="each row is appended here")
    parser.add_argument("--timeout", type=float, help="seconds each probe and training may take (120; a CPU: 600)")
    parser.add_argument("--train-images", type=int, default=12_800, help="generated images: x epochs / batch = steps")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--fashion", type=Path, default=FASHION, help="the four Fashion-MNIST .gz files")
    parser.add_argument("--targets", type=fractions, default="0.90,0.91", help="recipe=fast's test accuracies")
    parser.add_argument("--tta-epochs", type=int, help="recipe=fast's schedule (default: the recipe's)")
    parser.add_argument("--modes", help="comma-separated: the modes checked (all)")
    parser.add_argument("--variants", help="comma-separated: of each mode (all)")
    parser.add_argument("--jobs", type=int, default=4, help="variant runs at a time")
    parser.add_argument("--probe", choices=PROBES, help=argparse.SUPPRESS)  # in a child
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    return parser, parser.parse_args()


def chosen(parser, option: str, text: str | None, known) -> list[str]:
    names = list(known) if text is None else [name for name in text.split(",") if name]
    if unknown := set(names) - set(known):
        parser.error(f"{option}: no {', '.join(sorted(unknown))}; the choices are {', '.join(known)}")
    return names


def main() -> int:
    parser, args = arguments()
    if args.probe:
        print(json.dumps([dataclasses.asdict(row) for row in probe(args.probe, args.device, args.work)]))
        return 0
    gpus = torch.cuda.device_count() if args.device == "cuda" else 2
    if gpus == 0:
        print("gpu_check: no CUDA device is visible (--device cpu checks the script itself)")
        return 1
    args.compiler, args.timeout = True, args.timeout or (120.0 if args.device == "cuda" else 600.0)
    notes, missing = preflight(args)
    if missing:
        print(f"gpu_check: missing {', '.join(missing)}; install with {INSTALL}")
        return 1
    from mnist_dist.modes import MODES  # Hydra: installed, as the preflight found
    from mnist_dist.tools.gpu_runs import VARIANTS

    args.modes = chosen(parser, "--modes", args.modes, MODES)
    args.variants = [
        v for v in chosen(parser, "--variants", args.variants, VARIANTS) if args.compiler or v != "compile"
    ]
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    write_idx(work / "data" / "MNIST" / "raw", n_train=args.train_images, n_test=2_000)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else machine.describe()["cpu"]
    title = f"gpu_check{' --quick' if args.quick else ''} on {device} ({gpus} visible), {datetime.date.today()}"
    say(args.out, title, machine.summary_line(machine.describe()), *notes, f"work directory: {work}", "")
    say(args.out, "| row | proves | figure | result | s |", "|---|---|---|---|---|")
    failed, count = [], 0
    for row in itertools.chain(probe_rows(args, work), trainer_rows(args, work, gpus)):
        say(args.out, line(row))
        failed += [] if row.ok else [row]
        count += 1
    verdict = [f"FAILED {row.name}: {row.figure}" for row in failed] or ["all rows passed"]
    say(args.out, "", *verdict, f"{count} rows in {time.monotonic() - started:.0f} s", "")
    return 1 if failed else 0


if __name__ == "__main__":
    from mnist_dist.tools import gpu_check  # one copy of the module (and of Row) with the probes that import it

    sys.exit(gpu_check.main())
