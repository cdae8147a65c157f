"""The GPU check's probes that need ranks: two gloo ranks sharing one device (gloo all-reduces CUDA tensors
too; NCCL refuses two ranks on one GPU; the overlap probe gives each rank a GPU of its own where there are
two), or NCCL at world size 1. Each is a function that runs on the current process group, so a test runs it
on a CPU with its bug put back, and a worker that spawns it on the GPU.
"""

from __future__ import annotations

import json
import statistics
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from mnist_dist.model import ConvNet, instantiate_model
from mnist_dist.modes import wrap_model
from mnist_dist.operations import files
from mnist_dist.parallel import DistributedDataParallel, spawn
from mnist_dist.parallel.state import model_state
from mnist_dist.step import Precision, compute_gradients, evaluate, evaluate_as_saved, train_step
from mnist_dist.tools.gpu_check import Row
from mnist_dist.tools.gpu_probes import composed
from mnist_dist.topology import kernel_policy, resolve, setup_process

GRADIENT_TOLERANCE = 1e-5  # absolute, our DDP and torch DDP against one process on the global batch
GRADIENT_BATCH = 32
OVERLAP_BATCH = 2048  # per rank: backward long enough on an H200 to hide the first bucket's all-reduce
OVERLAP_RATIO = 0.5  # the most of overlap off's exposed wait that overlap on may leave exposed


def random_batch(n: int, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 28, 28, generator=generator)
    return x.to(device), torch.randint(0, 10, (n,), generator=generator).to(device)


def ranks(worker, device_type: str, work: Path, start_method: str = "spawn", world_size: int = 2) -> dict:
    """``worker(rank, world_size, device_type, out)`` on ranks sharing one device; rank 0's report."""
    spawn(worker, world_size, device_type, str(work), start_method=start_method)
    return json.loads((work / "report.json").read_text())


def _report(out: str, report: dict) -> None:
    if dist.get_rank() == 0:
        files.write_text(Path(out, "report.json"), json.dumps(report))
    dist.barrier()  # leave together


def _device(device_type: str) -> torch.device:
    return torch.device("cuda:0" if device_type == "cuda" else "cpu")


# gradients: both DDPs against one process, TF32 off -------------------------------------------------------
def _gradients(model: torch.nn.Module, wrapped: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    for _ in range(2):  # our DDP: the first backward records the bucket plan, the second runs on it
        model.zero_grad(set_to_none=True)
        compute_gradients(wrapped, x, y, Precision("off", x.device))
    return {name: p.grad.detach().cpu() for name, p in model.named_parameters()}


def gradient_worker(rank: int, world_size: int, device_type: str, out: str) -> None:
    _rank_setup(device_type)  # TF32 off: TF32 convolutions would differ by more than the tolerance
    device = _device(device_type)
    x, y = random_batch(GRADIENT_BATCH, device)
    torch.manual_seed(0)
    model = ConvNet(dropout=False).to(device)
    expected = _gradients(model, model, x, y)
    worst = {}
    for name, wrap in (("ddp", DistributedDataParallel), ("torch_ddp", TorchDDP)):
        torch.manual_seed(0)
        model = ConvNet(dropout=False).to(device)
        found = _gradients(model, wrap(model), x.chunk(world_size)[rank], y.chunk(world_size)[rank])
        worst[name] = torch.tensor(max((found[k] - expected[k]).abs().max().item() for k in expected))
        dist.all_reduce(worst[name], op=dist.ReduceOp.MAX)
    _report(out, {name: value.item() for name, value in worst.items()})
    dist.destroy_process_group()


def gradient_rows(report: dict, device_type: str) -> list[Row]:
    return [
        Row(
            f"{name} gradients, 2 gloo ranks on one {device_type}",
            "both DDPs average as one process computes (side stream, CUDA tensors)",
            f"max difference {difference:.1e} (tolerance {GRADIENT_TOLERANCE:g}; random images)",
            difference <= GRADIENT_TOLERANCE,
        )
        for name, difference in report.items()
    ]


# overlap: our DDP's exposed wait with overlap on against off ------------------------------------------------
def exposed_wait_ms(overlap: bool, model: torch.nn.Module, x, y, steps: int = 5, warmup: int = 3) -> float:
    """Median over ``steps`` of what our DDP (mode=ddp as composed, ``mode.overlap``) waited for its
    all-reduces after backward's compute ended, by its own clock (CUDA events on the compute stream)."""
    wrapped = wrap_model(model, composed("mode=ddp", f"mode.overlap={str(overlap).lower()}").mode, x.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    waits = []
    for step in range(warmup + steps):  # the first backwards plan the buckets and rebuild them
        train_step(wrapped, optimizer, x, y, Precision("off", x.device))
        if step >= warmup:
            waits.append(1000 * wrapped.clock.last_wait_s())
    return statistics.median(waits)


def _rank_setup(device_type: str) -> None:
    """The trainer's kernels (deterministic, TF32 off by default), and one thread each for CPU ranks that
    share a core or two; then the gloo group."""
    cfg = composed()
    kernel_policy(cfg.deterministic, cfg.tf32)
    if device_type == "cpu":
        torch.set_num_threads(1)
    dist.init_process_group("gloo")


def overlap_worker(rank: int, world_size: int, device_type: str, out: str) -> None:
    _rank_setup(device_type)
    own = device_type == "cuda" and torch.cuda.device_count() >= world_size  # a GPU each: the wait means something
    device = torch.device("cuda", rank) if own else _device(device_type)
    x, y = random_batch(OVERLAP_BATCH if device_type == "cuda" else 64, device, seed=rank)
    waits = {}
    for overlap in (True, False):
        torch.manual_seed(0)
        waits[overlap] = exposed_wait_ms(overlap, ConvNet(dropout=False).to(device), x, y)
    _report(out, {"on": waits[True], "off": waits[False], "own": own})
    dist.destroy_process_group()


def overlap_row(on_ms: float, off_ms: float, where: str, unjudged: str = "") -> Row:
    """Passes where overlap on leaves at most OVERLAP_RATIO of overlap off's exposed wait. Reported, not judged,
    where ``unjudged`` says why the wait means nothing there."""
    ratio = on_ms / off_ms if off_ms else float("nan")
    ok = off_ms > 0 and on_ms <= OVERLAP_RATIO * off_ms
    figure = f"exposed wait {on_ms:.2f} ms with overlap, {off_ms:.2f} ms without ({ratio:.2f}; at most {OVERLAP_RATIO})"
    if unjudged:
        ok, figure = True, f"{figure} (not judged: {unjudged})"
    return Row(f"ddp overlap, {where}", "backward hides the all-reduces it overlaps", figure, ok)


def overlap_report_row(report: dict, device_type: str) -> Row:
    """Judged where each rank had a GPU of its own; two ranks on one GPU time-slice it (either may compute
    while the other waits), and on a CPU backward and gloo share the cores."""
    if report["own"]:
        return overlap_row(report["on"], report["off"], "2 gloo ranks, a GPU each")
    why = "2 ranks time-slice one GPU" if device_type == "cuda" else "backward and gloo share the CPU's cores"
    return overlap_row(report["on"], report["off"], f"2 gloo ranks on one {device_type}", why)


# BatchNorm: the reported evaluation is the saved model's ----------------------------------------------------
BATCHNORM_MODEL = ("model=resnet",)
TEST_IMAGES, TEST_BATCH = 512, 128


def batchnorm_report(model_cfg, mode, device: torch.device, out: str, steps: int = 3) -> dict:
    """A BatchNorm model trained ``steps`` on each rank's own batches (rank r's scaled by 1 + 2r, so that the
    ranks' running statistics differ), evaluated as the trainer does; rank 0 saves what model.pt holds."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = instantiate_model(model_cfg).to(device)
    wrapped = wrap_model(model, mode, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        x, y = random_batch(32, device, seed=1 + step * world_size + rank)
        train_step(wrapped, optimizer, x * (1 + 2 * rank), y, Precision("off", device))
    reported = evaluate_as_saved(wrapped, *random_batch(TEST_IMAGES, device, seed=99), TEST_BATCH, rank, world_size)
    state = model_state(wrapped)  # what the trainer writes to model.pt (a collective in fsdp)
    if rank == 0:
        torch.save(state, Path(out, "model.pt"))
    return {"reported": list(reported)}


def batchnorm_worker(rank: int, world_size: int, device_type: str, out: str) -> None:
    _rank_setup(device_type)
    cfg = composed("mode=ddp", *BATCHNORM_MODEL)
    _report(out, batchnorm_report(cfg.model, cfg.mode, _device(device_type), out))
    dist.destroy_process_group()


def batchnorm_row(report: dict, work: Path, device_type: str) -> Row:
    """The ranks' reported test loss and accuracy against model.pt's, evaluated here in one process."""
    device = _device(device_type)
    saved = instantiate_model(composed(*BATCHNORM_MODEL).model).to(device)
    saved.load_state_dict(torch.load(work / "model.pt", weights_only=True))
    saved_loss, saved_accuracy = evaluate(saved, *random_batch(TEST_IMAGES, device, seed=99), TEST_BATCH, 0, 1)
    loss, accuracy = report["reported"]
    ok = accuracy == saved_accuracy and abs(loss - saved_loss) <= 1e-6 * abs(saved_loss)
    figure = (
        f"reported loss {loss:.6f}, accuracy {accuracy:.2%}; model.pt's {saved_loss:.6f}, {saved_accuracy:.2%} "
        "(random images)"
    )
    return Row(
        f"BatchNorm evaluation, resnet, 2 gloo ranks on one {device_type}",
        "the reported accuracy is model.pt's",
        figure,
        ok,
    )


# NCCL: initialised bound to this GPU ------------------------------------------------------------------------
def nccl_binding(device_type: str) -> dict:
    """Process setup as the trainer's for mode=ddp gpus=1, then a barrier: the group's bound device and the
    warnings the barrier gave (torch warns at each barrier of a group initialised without device_id)."""
    cfg = composed("mode=ddp", "gpus=1", f"device={device_type}")
    setup_process(resolve(cfg), cfg.deterministic, cfg.dist.timeout_s, cfg.tf32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.barrier()
    bound = dist.group.WORLD.bound_device_id
    dist.destroy_process_group()
    return {
        "bound": str(bound),
        "warnings": [str(w.message).splitlines()[0] for w in caught if "barrier" in str(w.message)],
    }


def nccl_worker(rank: int, world_size: int, device_type: str, out: str) -> None:
    files.write_text(Path(out, "report.json"), json.dumps(nccl_binding(device_type)))


def nccl_row(report: dict) -> Row:
    ok = report["bound"] != "None" and not report["warnings"]
    figure = f"bound to {report['bound']}; barrier warnings: {len(report['warnings'])}" + "".join(
        f" ({w})" for w in report["warnings"]
    )
    return Row("NCCL process group, world size 1", "init_process_group got device_id", figure, ok)
