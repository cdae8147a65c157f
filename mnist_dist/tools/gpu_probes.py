"""The GPU check's probes, each run by ``gpu_check`` in a child process of its own (``probe``): each returns rows
that say what they prove, their figure, and whether they passed, and fails when the bug it names is put back
(tests/test_gpu_probes.py puts each back on a CPU, with the CUDA part faked). The probes that need ranks run on
two gloo ranks sharing one device (gloo all-reduces CUDA tensors too; NCCL refuses two ranks on one GPU; the
overlap probe gives each rank a GPU of its own where there are two), or NCCL at world size 1. Modes are composed
through Hydra (``composed``), as the trainer's are.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import statistics
import threading
import time
import warnings
from importlib import resources
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from mnist_dist.config import Config
from mnist_dist.model import ConvNet, instantiate_model
from mnist_dist.modes import wrap_model
from mnist_dist.operations import files
from mnist_dist.parallel import DistributedDataParallel, spawn
from mnist_dist.parallel.dp import DataParallel, FunctionalDataParallel
from mnist_dist.parallel.state import OUTER, model_state
from mnist_dist.step import Precision, compute_gradients, evaluate, evaluate_as_saved, train_step
from mnist_dist.tools.gpu_check import Row
from mnist_dist.topology import kernel_policy, resolve, setup_process

# The module nn.DataParallel calls parallel_apply through (torch.nn.parallel exports a function of that name).
torch_data_parallel = importlib.import_module("torch.nn.parallel.data_parallel")
FP32_TOLERANCE = 1e-5  # relative (norm of the error / norm of the float64 gradient): fp32 ~1e-7, TF32 ~1e-3


def composed(*overrides: str) -> Config:
    """The Config the trainer would run with these overrides."""
    with initialize_config_module("mnist_dist.conf", version_base="1.3"):
        return OmegaConf.to_object(compose("config", overrides=list(overrides)))


class ThreadProbe(nn.Module):
    """Records the dtype its linear layer computes in and the thread it ran in (replicas share the list).
    It keeps the thread itself: an ident is handed on to the next thread once its owner has ended."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.seen: list[tuple[threading.Thread, torch.dtype]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        self.seen.append((threading.current_thread(), y.dtype))
        return y


def _dtypes(seen: list[tuple[threading.Thread, torch.dtype]]) -> str:
    threads = {thread for thread, _ in seen}
    names = sorted({str(dtype).removeprefix("torch.") for _, dtype in seen})
    return f"{'/'.join(names)} in {len(threads)} threads"


def replica_dtype(name: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> Row:
    """mode=``name``'s wrapper, as the trainer builds it, under autocast(``dtype``): its replicas' threads
    (two on one device: parallel_apply with devices [i, i]) against raw torch's parallel_apply. On CUDA the
    thread default is fp16, so bf16 shows the bug; on a CPU (a test) it is bf16, so the test asks for fp16."""
    mode = composed(f"mode={name}").mode
    probe = ThreadProbe().to(device)
    wrapped = wrap_model(probe, mode, device, 1)
    wrapper = next(m for m in wrapped.modules() if isinstance(m, OUTER))  # dp_block's is inside
    said = OmegaConf.load(resources.files("mnist_dist.conf") / "mode" / f"{name}.yaml")  # what the YAML says
    expected = FunctionalDataParallel if said.get("dp_functional", False) else DataParallel
    wrapper.device_ids = [device.index or 0] * 2  # two replicas' threads on this one device
    inputs = [(chunk,) for chunk in torch.randn(4, 8, device=device).chunk(2)]
    found = {}
    for who, apply in (("ours", wrapper.parallel_apply), ("raw torch", torch_data_parallel.parallel_apply)):
        probe.seen = []
        with torch.autocast(device.type, dtype=dtype):
            apply([probe, probe], inputs, None, *([] if who == "ours" else [wrapper.device_ids]))
        found[who] = probe.seen
    ours_ok = len({t for t, _ in found["ours"]}) == 2 and {d for _, d in found["ours"]} == {dtype}
    visible = {d for _, d in found["raw torch"]} != {dtype}  # torch's own bug shows: the probe can see it
    ok = ours_ok and visible and type(wrapper) is expected
    figure = f"{type(wrapper).__name__}: {_dtypes(found['ours'])}; raw torch: {_dtypes(found['raw torch'])}"
    figure += "" if visible else " (raw torch keeps the dtype too: this probe cannot see the bug)"
    figure += "" if type(wrapper) is expected else f"; its YAML makes a {expected.__name__}"
    proves = f"mode={name}'s replicas compute in the caller's {str(dtype).removeprefix('torch.')}"
    return Row(f"{name} replica dtype, amp, 2 threads on {device}", proves, figure, ok)


def _gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.detach().cpu().double() for p in model.parameters()]


def _error(found: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    return max(((f - r).norm() / r.norm()).item() for f, r in zip(found, reference))


def tf32_policy(device: torch.device) -> Row:
    """The convnet's fp32 gradients on ``device`` under the trainer's TF32 setting (default off), against
    float64 on the CPU: within fp32's tolerance; with TF32 on, outside it (the probe sees the difference)."""
    cfg = composed()
    torch.manual_seed(0)
    reference_model = ConvNet(dropout=False).double()
    x, y = torch.randn(64, 1, 28, 28, dtype=torch.float64), torch.randint(0, 10, (64,))
    reference = _gradients(reference_model, x, y)
    errors = {}
    try:
        for tf32 in (cfg.tf32, True):
            kernel_policy(cfg.deterministic, tf32)  # what setup_process sets in every training process
            model = ConvNet(dropout=False).to(device)
            model.load_state_dict(reference_model.state_dict())  # copied into fp32
            errors[tf32] = _error(_gradients(model, x.float().to(device), y.to(device)), reference)
    finally:
        kernel_policy(cfg.deterministic, cfg.tf32)
    ok = errors[cfg.tf32] <= FP32_TOLERANCE < errors[True]
    figure = (
        f"tf32={str(cfg.tf32).lower()}: {errors[cfg.tf32]:.1e} from float64; tf32=true: {errors[True]:.1e} "
        f"(tolerance {FP32_TOLERANCE:g}; random images)"
    )
    return Row(f"TF32 policy, convnet gradients on {device}", "the trainer's fp32 is full fp32", figure, ok)


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
def _ddp_gradients(model: torch.nn.Module, wrapped: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
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
    expected = _ddp_gradients(model, model, x, y)
    worst = {}
    for name, wrap in (("ddp", DistributedDataParallel), ("torch_ddp", TorchDDP)):
        torch.manual_seed(0)
        model = ConvNet(dropout=False).to(device)
        found = _ddp_gradients(model, wrap(model), x.chunk(world_size)[rank], y.chunk(world_size)[rank])
        worst[name] = torch.tensor(max((found[k] - expected[k]).abs().max().item() for k in expected))
        dist.all_reduce(worst[name], op=dist.ReduceOp.MAX)
    _report(out, {name: value.item() for name, value in worst.items()})
    dist.destroy_process_group()


def gradient_rows(report: dict, device_type: str) -> list[Row]:
    proves = "both DDPs average as one process computes (side stream, CUDA tensors)"
    figure = "max difference {:.1e} (tolerance " + f"{GRADIENT_TOLERANCE:g}; random images)"
    name = "{} gradients, 2 gloo ranks on one " + device_type
    return [Row(name.format(k), proves, figure.format(v), v <= GRADIENT_TOLERANCE) for k, v in report.items()]


# overlap: our DDP's exposed wait with overlap on against off ------------------------------------------------
def exposed_wait_ms(overlap: bool, model: torch.nn.Module, x, y, steps: int = 5, warmup: int = 3) -> float:
    """Median over ``steps`` of how much longer a synchronised backward of our DDP (mode=ddp as composed,
    ``mode.overlap``) takes than the same backward under ``no_sync()``: the all-reduce time it left exposed."""
    wrapped = wrap_model(model, composed("mode=ddp", f"mode.overlap={str(overlap).lower()}").mode, x.device)
    precision = Precision("off", x.device)

    def seconds(synced: bool) -> float:
        wrapped.zero_grad(set_to_none=True)
        _sync(x.device)
        start = time.perf_counter()
        with contextlib.nullcontext() if synced else wrapped.no_sync():
            compute_gradients(wrapped, x, y, precision)
        _sync(x.device)
        return time.perf_counter() - start

    waits = []
    for step in range(warmup + steps):  # the first backwards plan the buckets and rebuild them
        alone, synced = seconds(False), seconds(True)
        if step >= warmup:
            waits.append(1000 * max(0.0, synced - alone))
    return statistics.median(waits)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    figure = f"reported loss {loss:.6f}, accuracy {accuracy:.2%}; model.pt's {saved_loss:.6f}, {saved_accuracy:.2%}"
    name = f"BatchNorm evaluation, resnet, 2 gloo ranks on one {device_type}"
    return Row(name, "the reported accuracy is model.pt's", figure + " (random images)", ok)


# NCCL: initialised bound to this GPU ------------------------------------------------------------------------
def nccl_binding(device_type: str) -> dict:
    """Process setup as the trainer's for mode=ddp gpus=1, then a barrier: the group's bound device and the
    warnings the barrier gave (torch warns at each barrier of a group initialised without device_id)."""
    cfg = composed("mode=ddp", "gpus=1", f"device={device_type}")
    setup_process(resolve(cfg), cfg.deterministic, cfg.dist.timeout_s, cfg.tf32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.barrier()
    bound = str(dist.group.WORLD.bound_device_id)
    dist.destroy_process_group()
    return {"bound": bound, "warnings": [str(w.message).splitlines()[0] for w in caught if "barrier" in str(w.message)]}


def nccl_worker(rank: int, world_size: int, device_type: str, out: str) -> None:
    files.write_text(Path(out, "report.json"), json.dumps(nccl_binding(device_type)))


def nccl_row(report: dict) -> Row:
    ok = report["bound"] != "None" and not report["warnings"]
    figure = f"bound to {report['bound']}; barrier warnings: {len(report['warnings'])}"
    figure += "".join(f" ({w})" for w in report["warnings"])
    return Row("NCCL process group, world size 1", "init_process_group got device_id", figure, ok)


def probe(name: str, device_type: str, work: Path) -> list[Row]:
    """Probe ``name``'s rows, computed in this process (the child a check starts)."""
    if name in ("dp", "dp_functional"):
        return [replica_dtype(name, torch.device("cuda:0"))]
    if name == "tf32":
        return [tf32_policy(torch.device("cuda:0"))]
    where = work / name
    where.mkdir(parents=True, exist_ok=True)
    worker = {"nccl": nccl_worker, "overlap": overlap_worker, "batchnorm": batchnorm_worker}.get(name, gradient_worker)
    report = ranks(worker, device_type, where, world_size=1 if name == "nccl" else 2)
    if name == "nccl":
        return [nccl_row(report)]
    if name == "overlap":
        return [overlap_report_row(report, device_type)]
    return [batchnorm_row(report, where, device_type)] if name == "batchnorm" else gradient_rows(report, device_type)
