"""GPU check: on one GPU, a row for each CUDA path that nothing else runs, each able to fail for what it names.

    python -m mnist_dist.tools.gpu_check --quick         # the rows that matter
    python -m mnist_dist.tools.gpu_check                 # and every mode on every GPU
    python -m mnist_dist.tools.gpu_check --device cpu --quick   # the check itself, on a CPU (CUDA rows skipped)

Rows (docs/gpus.md says what each proves): the probes (dp's replica dtype under autocast, NCCL bound to its GPU);
the trainer at gpus=1 in single, ddp, torch_ddp, fsdp and split (ddp and torch_ddp bit for bit against single),
single with amp=bf16, compile and channels_last; recipe=fast to 90 % and 91 %. Every probe and training runs in
a process of its own, killed with what it started after ``--timeout`` seconds (a failed row). Each row is printed
and appended to ``--out`` as it finishes; the exit status is non-zero if one failed. Hydra is imported only after
the preflight has said it is installed.
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
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from mnist_dist.operations import files, machine
from mnist_dist.tools import bounded, composed, machine_line, read_scalars, train_in_subprocess, write_idx

# The module nn.DataParallel calls parallel_apply through (torch.nn.parallel exports a function of that name).
torch_data_parallel = importlib.import_module("torch.nn.parallel.data_parallel")

FASHION = Path("data", "fashion-mnist")  # the folder docs/gpus.md fills, under the directory it runs from
NEEDED = {"hydra": "hydra-core", "omegaconf": "omegaconf", "antlr4": "antlr4-python3-runtime"}
PROBES = ("dp", "dp_functional", "nccl")  # each needs CUDA
ONE_GPU = ("single", "ddp", "torch_ddp", "fsdp", "split")  # at gpus=1, each against single
TRAIN_IMAGES, EPOCHS = 12_800, 2  # the generated data and each mode's run on it
TARGETS = (0.90, 0.91)  # below the 92 % recipe=fast ends near on Fashion-MNIST: reaching them is a margin
# Of single at gpus=1, on CUDA: the most relative difference of the first loss from single's. The first step has
# the same weights and batch: only the arithmetic differs (bf16 keeps 8 bits of mantissa; compile and NHWC only
# reorder fp32 sums).
VARIANTS = {"amp=bf16": 0.02, "compile=true": 1e-3, "channels_last=true": 1e-3}


@dataclasses.dataclass
class Row:
    name: str
    proves: str
    figure: str
    ok: bool


def preflight(args) -> tuple[list[str], list[str]]:
    """(notes, missing): what the package needs, the package itself (its Hydra configs come with it), a C
    compiler for the compile rows (inductor builds C++), the Fashion-MNIST files."""
    notes, missing = [], [dist for module, dist in NEEDED.items() if importlib.util.find_spec(module) is None]
    try:
        notes.append(f"mnist_dist {importlib.metadata.version('mnist_dist')} installed")
        if importlib.util.find_spec("mnist_dist.conf") is None:  # found, not run: it imports Hydra
            raise importlib.metadata.PackageNotFoundError("mnist_dist.conf")
    except importlib.metadata.PackageNotFoundError:
        missing.append("mnist_dist (installed: its Hydra configs come with it)")
    args.compiler = any(shutil.which(cc) for cc in ("cc", "gcc", "clang"))
    if not args.compiler:
        notes.append("no C compiler (cc, gcc, clang): the compile rows are skipped (apt-get install gcc)")
    if not (args.fashion / "train-images-idx3-ubyte.gz").exists():
        notes.append(f"{args.fashion} holds no Fashion-MNIST: time to accuracy runs on generated data")
    if args.device == "cpu":
        notes.append("on a CPU, what needs CUDA is skipped: the probes and the variants of single")
    return notes, missing


# probes: each run by a child process of its own (--probe NAME) that prints its rows as JSON --------------------
def replica_dtype(name: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> Row:
    """mode=``name``'s wrapper, as the trainer builds it, under autocast(``dtype``): its replicas' threads (two on
    one device) against raw torch's parallel_apply. On CUDA the thread default is fp16, so bf16 shows the bug; on
    a CPU (a test) it is bf16, so the test asks for fp16."""
    from mnist_dist.modes import wrap_model
    from mnist_dist.parallel.state import OUTER

    probe, seen = torch.nn.Linear(8, 8).to(device), []
    # The thread itself, not its ident: an ident is handed on to the next thread once its owner has ended.
    probe.register_forward_hook(lambda module, args, y: seen.append((threading.current_thread(), y.dtype)))
    wrapped = wrap_model(probe, composed(f"mode={name}").mode, device, 1)
    wrapper = next(m for m in wrapped.modules() if isinstance(m, OUTER))
    wrapper.device_ids = [device.index or 0] * 2  # two replicas' threads on this one device
    inputs, found = [(chunk,) for chunk in torch.randn(4, 8, device=device).chunk(2)], {}
    for who, apply in (("ours", wrapper.parallel_apply), ("raw torch", torch_data_parallel.parallel_apply)):
        seen.clear()
        with torch.autocast(device.type, dtype=dtype):
            apply([probe, probe], inputs, None, *([] if who == "ours" else [wrapper.device_ids]))
        found[who] = {d for _, d in seen}, len({thread for thread, _ in seen})
    said = {who: f"{'/'.join(sorted(str(d)[6:] for d in dtypes))} in {n} threads" for who, (dtypes, n) in found.items()}
    figure = f"{type(wrapper).__name__}: {said['ours']}; raw torch: {said['raw torch']}"
    visible = found["raw torch"][0] != {dtype}  # torch's own bug shows: the probe can see it
    figure += "" if visible else " (raw torch keeps the dtype too: this probe cannot see the bug)"
    proves = f"mode={name}'s replicas compute in the caller's {str(dtype)[6:]}"
    title = f"{name} replica dtype, amp, 2 threads on {device}"
    return Row(title, proves, figure, found["ours"] == ({dtype}, 2) and visible)


def nccl_row(device_type: str) -> Row:
    """Process setup as the trainer's for mode=ddp gpus=1, then a barrier: the group must be bound to its device,
    and the barrier warn nothing (torch warns at each barrier of a group initialised without device_id)."""
    import torch.distributed as dist

    from mnist_dist.topology import resolve, setup_process

    cfg = composed("mode=ddp", "gpus=1", f"device={device_type}")
    setup_process(resolve(cfg), cfg.deterministic, cfg.dist.timeout_s, cfg.tf32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.barrier()
    said = [str(w.message).splitlines()[0] for w in caught if "barrier" in str(w.message)]
    bound = dist.group.WORLD.bound_device_id
    dist.destroy_process_group()
    figure = f"bound to {bound}; barrier warnings: {len(said)}" + "".join(f" ({w})" for w in said)
    title, proves = "NCCL process group, world size 1", "init_process_group got device_id"
    return Row(title, proves, figure, bound is not None and not said)


def nccl_worker(rank: int, world_size: int, device_type: str, out: str) -> None:
    files.write_text(Path(out), json.dumps(dataclasses.asdict(nccl_row(device_type))))


def probe(name: str, device_type: str, work: Path) -> Row:
    """Probe ``name``'s row, computed in this process (the child a check starts)."""
    from mnist_dist.parallel import spawn

    if name in ("dp", "dp_functional"):
        return replica_dtype(name, torch.device("cuda:0"))
    work.mkdir(parents=True, exist_ok=True)
    spawn(nccl_worker, 1, device_type, str(work / "row.json"))  # a rank: setup_process reads its environment
    return Row(**json.loads((work / "row.json").read_text()))


def probe_rows(args, work: Path) -> Iterator[Row]:
    """Each probe in a process of its own under ``args.timeout``; one that fails, hangs or crashes is a failed row."""
    for name in PROBES if args.device == "cuda" else ():
        command = [sys.executable, "-m", "mnist_dist.tools.gpu_check", "--probe", name, "--device", args.device]
        try:
            result = bounded([*command, "--work", str(work / name)], args.timeout)
            if result.returncode:
                raise RuntimeError(f"exit {result.returncode}: {(result.stderr.strip().splitlines() or [''])[-1]}")
            yield Row(**json.loads(result.stdout.strip().splitlines()[-1]))
        except RuntimeError as error:
            yield Row(f"probe {name}", "", str(error), False)


def train(args, run_dir: Path, *overrides: str) -> tuple[dict | None, str]:
    """One training process under ``args.timeout``; its results.json (None if it failed) and why it failed."""
    try:
        return train_in_subprocess(list(overrides), run_dir, args.timeout), ""
    except RuntimeError as error:
        return None, str(error)


def losses(run_dir: Path) -> list[float]:
    """The run's training loss per step, the mean over ranks."""
    return list(read_scalars(run_dir)["train/loss_global"].values())


def common(args, work: Path, gpus: int) -> tuple[str, ...]:
    """What every mode and variant run shares: the generated data, dropout off (replicas would draw other masks),
    every step logged, and at most 5 warm-up steps, so that on small data some are timed."""
    warmup = min(5, max(0, TRAIN_IMAGES * EPOCHS // 128 - 2))
    where = (f"data.root={work / 'data'}", "data.mirrors=[]", f"device={args.device}", "model.dropout=false")
    return (*where, f"batch_size={128 // gpus * gpus}", "log_every=1", f"warmup_steps={warmup}")


def bitwise(run_dir: Path, curve: list[float], single: Path) -> tuple[str, bool]:
    """At world size 1 ddp and torch_ddp equal single bit for bit (the same batches and kernels, gradients divided
    by 1): every step's loss, and model.pt, which holds CPU tensors. (figure, passed)."""
    reference = losses(single)
    differs = next((step for step, (a, b) in enumerate(zip(curve, reference), 1) if a != b), None)
    ours, theirs = (torch.load(d / "model.pt", weights_only=True) for d in (run_dir, single))
    on_cpu = all(tensor.device.type == "cpu" for tensor in [*ours.values(), *theirs.values()])
    weights = on_cpu and ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    figure = f"loss curve {'identical' if differs is None else f'differs from step {differs}'} ({len(curve)} steps)"
    figure += f", model.pt {'identical, on the CPU' if weights else 'differs, or not on the CPU'}"
    return figure, differs is None and len(curve) == len(reference) and weights


def check_modes(args, work: Path, gpus: int, names) -> Iterator[Row]:
    """Each mode of ``names`` at ``gpus`` (as many as it can use), single first: images/s, the final loss, and at
    gpus=1 ddp and torch_ddp against single (``bitwise``)."""
    from mnist_dist.modes import MODES

    for name in sorted(names, key=lambda name: name != "single"):
        mode_gpus, run_dir = MODES[name].devices(gpus), work / "runs" / f"{name}_{gpus}"
        overrides = (f"mode={name}", f"gpus={mode_gpus}", f"epochs={EPOCHS}", *common(args, work, gpus))
        results, error = train(args, run_dir, *overrides)
        row = Row(f"{name} gpus={mode_gpus}, generated data", "the mode trains", error, results is not None)
        if results is not None:
            curve = losses(run_dir)
            row.ok = math.isfinite(curve[-1])
            row.figure = f"{results['train_images_per_s']:,.0f} images/s, final loss {curve[-1]:.4f}"
            single = work / "runs" / "single_1"
            if gpus == 1 and name in ("ddp", "torch_ddp") and (single / "results.json").exists():
                row.proves = "equals single bit for bit at world size 1 (loss curve, model.pt)"
                said, same = bitwise(run_dir, curve, single)
                row.figure, row.ok = f"{row.figure}; {said}", row.ok and same
        yield row


def check_variants(args, work: Path) -> Iterator[Row]:
    """Each of VARIANTS of single at gpus=1, one epoch, its first loss against single's."""
    for variant, tolerance in VARIANTS.items():
        if variant == "compile=true" and not args.compiler:
            continue
        run_dir = work / "runs" / f"single_{variant.split('=')[0]}"
        results, error = train(args, run_dir, "gpus=1", "epochs=1", *common(args, work, 1), variant)
        row = Row(f"single {variant} gpus=1", "starts from single's first loss", error, False)
        if results is not None:
            curve, first = losses(run_dir), losses(work / "runs" / "single_1")[0]
            difference = abs(curve[0] - first) / abs(first)
            row.ok = difference <= tolerance and math.isfinite(curve[-1])
            row.figure = f"first loss {difference:.1e} from single's (at most {tolerance:g}), last {curve[-1]:.4f}"
        yield row


def check_time_to_accuracy(args, work: Path) -> list[Row]:
    """recipe=fast to TARGETS on Fashion-MNIST if ``args.fashion`` holds it (else generated data, said in the row),
    stopping at the highest: the training seconds to each."""
    from mnist_dist.tools.bench import accuracy_curve, seconds_to

    if (args.fashion / "train-images-idx3-ubyte.gz").exists():
        data = ("data=fashion_mnist", f"data.mirrors=[{args.fashion.resolve()}]", f"data.root={work / 'fashion'}")
        where = f"Fashion-MNIST from {args.fashion}"
    else:  # batch 64: enough steps on the small generated set for OneCycle's warm-up and anneal phases
        data, where = (f"data.root={work / 'data'}", "data.mirrors=[]", "batch_size=64"), "generated data"
    proves = "time to accuracy, at targets recipe=fast passes with margin"
    overrides = ("recipe=fast", f"device={args.device}", f"target_accuracy={TARGETS[-1]}", "eval_every_steps=47")
    results, error = train(args, work / "runs" / "fast", *overrides, *data)
    reached = results is not None and results["time_to_target_s"] is not None
    curve = accuracy_curve(work / "runs" / "fast") if reached else {}
    rows = []
    for goal in TARGETS:
        seconds = seconds_to(curve, goal)
        figure = error or "not reached" if seconds is None else f"{seconds:.2f} s of training"
        rows.append(Row(f"recipe=fast to {goal:.1%}, {where}", proves, figure, seconds is not None))
    return rows


def trainer_rows(args, work: Path, gpus: int) -> Iterator[Row]:
    from mnist_dist.modes import MODES

    yield from check_modes(args, work, 1, ONE_GPU)
    if args.device == "cuda" and (work / "runs" / "single_1" / "results.json").exists():
        yield from check_variants(args, work)
    if not args.quick:
        yield from check_modes(args, work, gpus, [name for name in MODES if gpus > 1 or name not in ONE_GPU])
    yield from check_time_to_accuracy(args, work)


def say(out: Path, *lines: str) -> None:
    """``lines`` printed at once and appended to ``out``: a check killed later keeps them."""
    print("\n".join(lines), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as file:
        file.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="the rows that matter: no modes on every GPU")
    parser.add_argument("--out", type=Path, default=Path("outputs", "gpu_check.md"), help="each row is appended here")
    parser.add_argument("--timeout", type=float, help="seconds each probe and training may take (120; a CPU: 600)")
    parser.add_argument("--fashion", type=Path, default=FASHION, help="the four Fashion-MNIST .gz files")
    parser.add_argument("--probe", choices=PROBES, help=argparse.SUPPRESS)  # in a child
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        print(json.dumps(dataclasses.asdict(probe(args.probe, args.device, args.work))))
        return 0
    gpus = torch.cuda.device_count() if args.device == "cuda" else 2
    if gpus == 0:
        print("gpu_check: no CUDA device is visible (--device cpu checks the script itself)")
        return 1
    args.timeout = args.timeout or (120.0 if args.device == "cuda" else 600.0)
    notes, missing = preflight(args)
    if missing:
        offline = "pip install --no-index --find-links offline/wheels -e ."
        print(f"gpu_check: missing {', '.join(missing)}; install with pip install -e . (offline: {offline})")
        return 1
    started, work = time.monotonic(), Path(tempfile.mkdtemp(prefix="gpu_check_"))
    write_idx(work / "data" / "MNIST" / "raw", n_train=TRAIN_IMAGES, n_test=2_000)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else machine.describe()["cpu"]
    title = f"gpu_check{' --quick' if args.quick else ''} on {device} ({gpus} visible), {datetime.date.today()}"
    say(args.out, title, machine_line(machine.describe()), *notes, f"work directory: {work}", "")
    say(args.out, "| row | proves | figure | result |", "|---|---|---|---|")
    rows = []
    for row in itertools.chain(probe_rows(args, work), trainer_rows(args, work, gpus)):
        rows.append(row)
        say(args.out, f"| {row.name} | {row.proves} | {row.figure} | {'ok' if row.ok else '**FAILED**'} |")
    failed = [f"FAILED {row.name}: {row.figure}" for row in rows if not row.ok]
    say(args.out, "", *failed or ["all rows passed"], f"{len(rows)} rows in {time.monotonic() - started:.0f} s", "")
    return 1 if failed else 0


if __name__ == "__main__":
    from mnist_dist.tools import gpu_check  # the module as imported, not __main__: the rank finds nccl_worker there

    sys.exit(gpu_check.main())
