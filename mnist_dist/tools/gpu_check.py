"""GPU check: on one GPU, a row for each CUDA path that nothing else runs, each able to fail for what it names.

    python -m mnist_dist.tools.gpu_check --quick         # the rows that matter
    python -m mnist_dist.tools.gpu_check                 # every mode on every GPU, and each mode's variants
    python -m mnist_dist.tools.gpu_check --device cpu --quick   # the check itself, on a CPU (CUDA rows skipped)

Rows, in order (docs/gpus.md says what each proves): the probes (gpu_probes.py: dp's replica dtype under
autocast, the TF32 policy, NCCL bound to its GPU, our DDP's overlap, BatchNorm evaluation, both DDPs' gradients
against one process); the trainer at gpus=1 in single, ddp, torch_ddp, fsdp and split against single (ddp and
torch_ddp bit for bit), with amp=bf16, compile and channels_last; recipe=fast to ``--targets``. Every probe and
training runs in a process of its own, killed with what it started after ``--timeout`` seconds (a failed row).
Each row is printed as it finishes and appended to ``--out`` under a header naming the GPU and the date, so a
killed check keeps its rows; the exit status is non-zero if one failed. Hydra is imported only after the
preflight has said whether it is installed.
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
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from mnist_dist.operations import machine
from mnist_dist.tools import bounded, fractions, train_in_subprocess
from mnist_dist.tools.synthetic import write_idx

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
AGREE_STEPS, TOLERANCE = 20, 1e-3  # relative; cuDNN picks kernels per batch shape, so replicas differ in rounding
# name: (overrides, most relative difference of the first loss from the mode's own run). The first step has the
# same weights and batch: only the arithmetic differs (bf16 keeps 8 bits of mantissa, fp16 11, TF32 10; compile,
# NHWC and non-deterministic kernels only reorder fp32 sums).
VARIANTS = {
    "amp=bf16": (["amp=bf16"], 0.02),
    "amp=fp16": (["amp=fp16"], 0.01),
    "compile": (["compile=true"], 1e-3),
    "channels_last": (["channels_last=true"], 1e-3),
    "tf32": (["tf32=true"], 0.01),
    "deterministic=false": (["deterministic=false"], 1e-3),
}


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
def probe_command(args, name: str, work: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "mnist_dist.tools.gpu_check",
        "--probe",
        name,
        "--device",
        args.device,
        "--work",
        str(work),
    ]


def probe_rows(args, work: Path) -> Iterator[Row]:
    """Each probe in a process of its own under ``args.timeout``; one that fails, hangs or crashes is a failed row."""
    for name in [name for name in PROBES if args.device == "cuda" or name not in CUDA_PROBES]:
        started = time.monotonic()
        try:
            result = bounded(probe_command(args, name, work), args.timeout)
            if result.returncode:
                raise RuntimeError(f"exit {result.returncode}: {(result.stderr.strip().splitlines() or [''])[-1]}")
            rows = [Row(**row) for row in json.loads(result.stdout.strip().splitlines()[-1])]
        except RuntimeError as error:
            rows = [Row(f"probe {name}", "", str(error), False)]
        rows[0].seconds = time.monotonic() - started
        yield from rows


# the trainer: modes and variants on generated data with dropout off (replicas would draw other masks) ----------
def train(args, run_dir: Path, *overrides: str) -> tuple[dict | None, str]:
    """One training process under ``args.timeout``; its results.json (None if it failed) and why it failed."""
    try:
        return train_in_subprocess(list(overrides), run_dir, args.timeout), ""
    except RuntimeError as error:
        return None, str(error)


def losses(run_dir: Path) -> list[float]:
    """The run's training loss per step, the mean over ranks."""
    from mnist_dist.operations.tensorboard import read_scalars

    return list(read_scalars(run_dir)["train/loss_global"].values())


def same_weights(run_dir: Path, other: Path) -> bool:
    """model.pt of both runs holds the same tensors, bit for bit, on the CPU (so that it loads without a GPU)."""
    ours, theirs = (torch.load(d / "model.pt", weights_only=True) for d in (run_dir, other))
    on_cpu = all(tensor.device.type == "cpu" for tensor in [*ours.values(), *theirs.values()])
    return on_cpu and ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def common(args, work: Path, gpus: int) -> tuple[str, ...]:
    """The overrides every mode and variant run shares: the generated data, dropout off, every step logged, and
    at most 5 warm-up steps, so that on small data some are timed (the first step after warm-up starts the clock)."""
    warmup = min(5, max(0, args.train_images * args.epochs // 128 - 2))
    where = (f"data.root={work / 'data'}", "data.mirrors=[]", f"device={args.device}", "model.dropout=false")
    return (*where, f"batch_size={128 // gpus * gpus}", "log_every=1", f"warmup_steps={warmup}")


def against_single(
    name: str, world_size: int, run_dir: Path, curve: list[float], single: Path
) -> tuple[str, str, bool]:
    """(proves, figure, passed): at world size 1 ddp and torch_ddp equal single bit for bit (the same batches
    and kernels, gradients divided by 1) and fsdp's first loss does; the other one-process modes compute single's
    step on the whole batch, so they follow its loss within TOLERANCE."""
    from mnist_dist.modes import MODES, Processes

    reference = losses(single)
    if name in ("ddp", "torch_ddp") and world_size == 1:
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
    """Each mode of ``names`` at ``gpus`` (as many as it can use), single first: images/s against single's, the
    final loss, and the comparison with single (``against_single``)."""
    from mnist_dist.modes import MODES, Processes

    speeds = {}
    for name in sorted(names, key=lambda name: name != "single"):
        mode_gpus, run_dir, started = MODES[name].devices(gpus), work / "runs" / f"{name}_{gpus}", time.monotonic()
        overrides = (f"mode={name}", f"gpus={mode_gpus}", f"epochs={args.epochs}", *common(args, work, gpus))
        results, error = train(args, run_dir, *overrides)
        row = Row(f"{name} gpus={mode_gpus}, generated data", "the mode trains", error, results is not None)
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
    from mnist_dist.modes import MODES, compile_refusal
    from mnist_dist.tools.gpu_probes import composed

    cases = [(name, variant) for name, variant in cases if (work / "runs" / f"{name}_{gpus}" / "results.json").exists()]
    refused = {  # composed here: Hydra's global state is not for threads
        (name, variant): compile_refusal(
            composed(f"mode={name}", f"gpus={MODES[name].devices(gpus)}", *VARIANTS[variant][0]), args.device
        )
        for name, variant in cases
    }

    def run(case: tuple[str, str]) -> Row:
        (name, variant), started = case, time.monotonic()
        (overrides, tolerance), mode_gpus = VARIANTS[variant], MODES[name].devices(gpus)
        row = Row(f"{name} {variant} gpus={mode_gpus}", f"starts from {name}'s first loss", "", False)
        if refused[case]:
            row.ok, row.figure = True, f"refused as designed: {refused[case]}"
            return row
        run_dir = work / "runs" / f"{name}_{variant.replace('=', '_')}"
        where = (f"mode={name}", f"gpus={mode_gpus}", "epochs=1", *common(args, work, gpus), *overrides)
        results, row.figure = train(args, run_dir, *where)
        row.seconds = time.monotonic() - started
        if results is not None:
            curve, first = losses(run_dir), losses(work / "runs" / f"{name}_{gpus}")[0]
            difference = abs(curve[0] - first) / abs(first)
            row.ok = difference <= tolerance and math.isfinite(curve[-1])
            row.figure = f"first loss {difference:.1e} from {name}'s (at most {tolerance:g}), last {curve[-1]:.4f}"
        return row

    with ThreadPoolExecutor(args.jobs) as pool:  # each a subprocess: the threads only wait
        yield from pool.map(run, cases)


def check_time_to_accuracy(args, work: Path) -> list[Row]:
    """recipe=fast to the highest of ``args.targets`` on Fashion-MNIST if ``args.fashion`` holds it (generated data
    otherwise, said in the row): the training seconds to each target. The default targets sit below the 92 % that
    recipe=fast ends near, so that reaching them is a margin, not a coin toss."""
    from mnist_dist.tools.bench import accuracy_curve, seconds_to

    if (args.fashion / "train-images-idx3-ubyte.gz").exists():
        data = ("data=fashion_mnist", f"data.mirrors=[{args.fashion.resolve()}]", f"data.root={work / 'fashion'}")
        where = f"Fashion-MNIST from {args.fashion}"
    else:  # batch 64: enough steps on the small generated set for OneCycle's warm-up and anneal phases
        data = (f"data.root={work / 'data'}", "data.mirrors=[]", "batch_size=64")
        where = f"generated data ({args.fashion} holds no Fashion-MNIST)"
    schedule = [f"epochs={args.tta_epochs}"] if args.tta_epochs else []  # default: the recipe's own
    target, started = args.targets[-1], time.monotonic()
    overrides = ("recipe=fast", f"device={args.device}", *schedule, f"target_accuracy={target}", "eval_every_steps=47")
    proves = "time to accuracy, a target recipe=fast passes with margin (it ends near 92 % on Fashion-MNIST)"
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
            rows.append(
                Row(f"recipe=fast to {goal:.1%}, {where}", proves, figure, seconds is not None or goal == target)
            )
    rows[0].seconds = time.monotonic() - started
    return rows


def trainer_rows(args, work: Path, gpus: int) -> Iterator[Row]:
    extra = [name for name in args.modes if name not in ONE_GPU] if not args.quick and gpus == 1 else []
    yield from check_modes(args, work, 1, [*ONE_GPU, *extra])
    if args.quick:
        chosen = [v for v in QUICK_VARIANTS if v in args.variants] if args.device == "cuda" else []
        yield from check_variants(args, work, 1, [("single", variant) for variant in chosen])
    else:
        if gpus > 1:
            yield from check_modes(args, work, gpus, args.modes)
        yield from check_variants(args, work, gpus, [(m, v) for m in args.modes for v in args.variants])
    yield from check_time_to_accuracy(args, work)


# the table ------------------------------------------------------------------------------------------------
def say(out: Path, *lines: str) -> None:
    """``lines`` printed at once and appended to ``out``: a check killed later keeps them."""
    print("\n".join(lines), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as file:
        file.write("\n".join(lines) + "\n")


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
        from mnist_dist.tools.gpu_probes import probe

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

    args.modes = chosen(parser, "--modes", args.modes, MODES)
    args.variants = [
        v for v in chosen(parser, "--variants", args.variants, VARIANTS) if args.compiler or v != "compile"
    ]
    started, work = time.monotonic(), Path(tempfile.mkdtemp(prefix="gpu_check_"))
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
