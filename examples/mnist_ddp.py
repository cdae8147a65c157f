"""Data-parallel MNIST / Fashion-MNIST training in one file that needs only torch: copy it and run it.

    torchrun --nproc_per_node=2 mnist_ddp.py           # torchrun starts the ranks (several machines too)
    python mnist_ddp.py --nproc 2                      # or this file does, with torch.multiprocessing
    python mnist_ddp.py --data DIR --dataset mnist     # a folder of the four IDX files (.gz or not)
    python mnist_ddp.py --model fastnet                # a BatchNorm net (mnist_dist's FastNet)
    python mnist_ddp.py --loader                       # DistributedSampler + DataLoader, as for your own Dataset
    python mnist_ddp.py --ddp ours                     # our DDP: ddp.py copied beside this file

pytorch/examples mnist (its convnet and recipe: Adadelta lr 1.0, StepLR x 0.7 per epoch, batch 64, seed 1)
as one process per device: gloo on CPU, NCCL on CUDA (one GPU per rank). It computes what the app's
``python -m mnist_dist mode=ddp gpus=2`` computes, step for step (tests/test_examples.py checks it on
CPU): the same initial weights, the same global batches (one seeded permutation per epoch, rank r taking
the r-th part of each batch), per-rank dropout masks, exact sharded evaluation. The whole data set sits
on the device as one tensor (``--loader`` draws batches through a DataLoader instead: other batches, so
other numbers). The default data is Debian's Fashion-MNIST (apt-get install dataset-fashion-mnist):
nothing is downloaded. For data of your own, rewrite ``load_data``, the one function marked YOUR DATA
(and the model's first and last layers, if the shapes differ): nothing else reads files.

Rank 0 prints one line per epoch, writes ``--checkpoint`` after every epoch and the plain model's weights
at the end (``--save``, they load into ``mnist_dist.model.ConvNet`` or ``FastNet``). The checkpoint
records the settings that shape the run (``SETTINGS``). Started again with the same ones, a run goes on
from it on every rank, exactly: killed and started again (by hand, or ``torchrun --max-restarts``), it
ends with the weights of an uninterrupted run; a larger ``--epochs`` trains on; a finished run says so
and trains nothing. With other settings it refuses, in one line: another ``--checkpoint`` starts afresh.
Ctrl-C, or a SIGINT to the launcher alone, stops every rank at once and says so in one line (torchrun
passes it on to the ranks too, and reports it its own way); the checkpoint of the last whole epoch stays.

It imports only the standard library and torch. ``--ddp torch`` (the default) wraps with
``torch.nn.parallel.DistributedDataParallel``; ``--ddp ours`` with the one class of ``ddp.py``, our
hand-written DDP, which must then sit beside this file (copy ``examples/ddp.py`` too): the same numbers
come out. Every line that a one-process version would not have, or would write otherwise, ends in
``# ADDED FOR DISTRIBUTED``: ``grep -n "ADDED FOR DISTRIBUTED" mnist_ddp.py`` lists them, 98 lines
(this one included).
"""

from __future__ import annotations

import argparse
import gzip
import math
import os
import signal  # ADDED FOR DISTRIBUTED: Ctrl-C reaches every rank
import socket  # ADDED FOR DISTRIBUTED: a free port for the launcher
import struct
import sys
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist  # ADDED FOR DISTRIBUTED
import torch.distributed.nn.functional  # noqa: F401  # ADDED FOR DISTRIBUTED: before init, or gloo can abort the exit
import torch.multiprocessing as mp  # ADDED FOR DISTRIBUTED
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # ADDED FOR DISTRIBUTED: the sampler

DEBIAN = Path("/usr/share/datasets/fashion-mnist")  # apt-get install dataset-fashion-mnist
# What shapes a run: a checkpoint resumes only under the same (--epochs may grow, --ddp and --device change).
SETTINGS = ("dataset", "model", "loader", "batch_size", "lr", "gamma", "seed", "nproc")  # ADDED FOR DISTRIBUTED


class ConvNet(nn.Module):
    """pytorch/examples mnist's convnet, with the parameter names of mnist_dist.model.ConvNet."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Dropout(0.25),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(nn.Linear(9216, 128), nn.ReLU(), nn.Dropout(0.5), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class FastNet(nn.Module):
    """mnist_dist.model.FastNet, the fast recipe's net: (conv 3x3, maxpool, BatchNorm, ReLU) x 3, linear.
    BatchNorm's running statistics are buffers, which each rank updates from its own share of a batch."""

    def __init__(self, widths: tuple[int, int, int] = (24, 48, 96)) -> None:
        super().__init__()
        layers, channels_in = [], 1
        for channels in widths:
            layers += [nn.Conv2d(channels_in, channels, 3, padding=1, bias=False), nn.MaxPool2d(2)]
            layers += [nn.BatchNorm2d(channels), nn.ReLU()]
            channels_in = channels
        self.features = nn.Sequential(*layers, nn.Flatten())
        self.classifier = nn.Linear(widths[-1] * 3 * 3, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


MODELS = {"convnet": ConvNet, "fastnet": FastNet}


# YOUR DATA: the one function to rewrite for another data set (the rest takes any tensors it returns).
def load_data(folder: Path, dataset: str, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``split`` ("train" or "test") on the CPU: images float32 [N, 1, 28, 28] normalised, labels int64 [N].
    Read from ``folder``'s four IDX files (.gz or not); a missing one raises FileNotFoundError, said in one
    line before any rank starts."""
    mean, std = {"mnist": (0.1307, 0.3081), "fashion-mnist": (0.2860, 0.3530)}[dataset]  # of the training images
    tensors = []
    for kind in ("images-idx3", "labels-idx1"):
        name = f"{'t10k' if split == 'test' else 'train'}-{kind}-ubyte"
        path = next((p for p in (folder / name, folder / f"{name}.gz") if p.is_file()), None)
        if path is None:
            raise FileNotFoundError(f"{folder} holds neither {name} nor {name}.gz")
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
            data = f.read()
        ndim = data[3]  # bytes 0-3: zero, zero, the item type (uint8), the number of dimensions
        shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
        tensors.append(torch.frombuffer(bytearray(data[4 + 4 * ndim :]), dtype=torch.uint8).view(shape))
    images, labels = tensors
    return images.unsqueeze(1).float().div(255).sub_(mean).div_(std), labels.long()


def resident_batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int, epoch: int):
    """An epoch of batches of the tensors on the device: one permutation, a function of the seed and the epoch."""
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).to(x.device)
    rank, world_size = dist.get_rank(), dist.get_world_size()  # ADDED FOR DISTRIBUTED: the same order on every rank
    per_rank = batch_size // world_size  # ADDED FOR DISTRIBUTED: batch_size is global
    for start in range(0, len(order) - batch_size + 1, batch_size):  # the last partial batch dropped
        indices = order[start + rank * per_rank : start + (rank + 1) * per_rank]  # ADDED FOR DISTRIBUTED
        yield x[indices], y[indices]


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Loss and accuracy over the whole test set."""
    model.eval()
    # Each rank scores a contiguous share and the sums are added: every image counts once, no padding.
    n = len(x)
    rank, world_size = dist.get_rank(), dist.get_world_size()  # ADDED FOR DISTRIBUTED
    share = slice(n * rank // world_size, n * (rank + 1) // world_size)  # ADDED FOR DISTRIBUTED
    x, y = x[share], y[share]  # ADDED FOR DISTRIBUTED
    totals = torch.zeros(2, dtype=torch.float64, device=x.device)  # ADDED FOR DISTRIBUTED: loss sum, correct
    for batch in range(0, len(x), 1000):
        logits = model(x[batch : batch + 1000])
        totals[0] += F.cross_entropy(logits, y[batch : batch + 1000], reduction="sum")
        totals[1] += (logits.argmax(1) == y[batch : batch + 1000]).sum()
    dist.all_reduce(totals)  # ADDED FOR DISTRIBUTED
    loss, correct = totals.tolist()
    return loss / n, correct / n


def rng_state(device: torch.device) -> dict:
    """This process's random state: its dropout masks to come, the DataLoader's seeds."""
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"].cpu())  # map_location moved it; the generator takes a CPU tensor
    if state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def settings(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in SETTINGS}


def leave(message: str, code: int) -> NoReturn:
    """Say ``message`` (on stderr if ``code`` is not 0) and exit with ``code``."""
    if os.environ.get("RANK", "0") == "0":  # ADDED FOR DISTRIBUTED: torchrun runs this in every rank: say it once
        print(message, file=sys.stderr if code else sys.stdout, flush=True)
    sys.exit(code)


def check_checkpoint(args: argparse.Namespace) -> None:
    """Refuse a checkpoint of other settings; stop, saying so, if it holds the whole run."""
    if not args.checkpoint.exists():
        return
    try:
        state = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
    except Exception as error:  # another file, cut short, or not safe to load: torch raises one of several
        why = f"{args.checkpoint} is not a checkpoint ({type(error).__name__})"
        leave(f"error: {why}; another --checkpoint starts afresh", 1)
    if not isinstance(state, dict) or "settings" not in state:
        leave(f"error: {args.checkpoint} records no settings; another --checkpoint starts afresh", 1)
    now = settings(args)
    changed = [f"--{k.replace('_', '-')} {v} (now {now[k]})" for k, v in state["settings"].items() if now[k] != v]
    if changed:
        again = "rerun with its settings, or another --checkpoint starts afresh"
        leave(f"error: {args.checkpoint} is a run with other settings: {', '.join(changed)}; {again}", 1)
    if state["epoch"] >= args.epochs:
        leave(f"finished: {args.checkpoint} holds all {state['epoch']} epochs (a larger --epochs goes on)", 0)


def train(args: argparse.Namespace) -> None:
    # Ctrl-C ends a rank at once and silently, even inside a collective; the checkpoint is whole or not there.
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # ADDED FOR DISTRIBUTED
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # ADDED FOR DISTRIBUTED
    local_rank = int(os.environ["LOCAL_RANK"])  # ADDED FOR DISTRIBUTED: the device's index on this machine
    device = torch.device(f"cuda:{local_rank}" if args.device == "cuda" else "cpu")  # ADDED FOR DISTRIBUTED
    if device.type == "cuda":  # ADDED FOR DISTRIBUTED
        torch.cuda.set_device(device)  # ADDED FOR DISTRIBUTED
        dist.init_process_group("nccl", device_id=device)  # ADDED FOR DISTRIBUTED: address, rank, size from env
    else:  # ADDED FOR DISTRIBUTED: the processes on a machine share its cores, rather than each taking all
        local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])  # ADDED FOR DISTRIBUTED
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))  # ADDED FOR DISTRIBUTED
        dist.init_process_group("gloo")  # ADDED FOR DISTRIBUTED
    train_x, train_y = load_data(args.data, args.dataset, "train")
    test_x, test_y = (t.to(device) for t in load_data(args.data, args.dataset, "test"))
    if args.loader:  # a Dataset of your own goes here; the DataLoader draws its batches
        dataset = TensorDataset(train_x, train_y)
        sampler = DistributedSampler(dataset, seed=args.seed, drop_last=True)  # ADDED FOR DISTRIBUTED: a share each
        per_rank = args.batch_size // world_size  # ADDED FOR DISTRIBUTED
        loader = DataLoader(dataset, per_rank, sampler=sampler, drop_last=True)  # ADDED FOR DISTRIBUTED
    else:
        train_x, train_y = train_x.to(device), train_y.to(device)
    torch.manual_seed(args.seed)  # the same initial weights everywhere (DDP broadcasts rank 0's anyway)
    model = MODELS[args.model]().to(device)
    # A restarted job goes on from the last epoch's checkpoint (of these settings: checked before the
    # ranks started); every rank reads it onto its own device.
    state = torch.load(args.checkpoint, map_location=device, weights_only=True) if args.checkpoint.exists() else None
    if state is not None:
        model.load_state_dict(state["model"])
    if args.ddp == "ours":  # ADDED FOR DISTRIBUTED
        from ddp import DistributedDataParallel  # ADDED FOR DISTRIBUTED: ddp.py beside this file

        model = DistributedDataParallel(model)  # ADDED FOR DISTRIBUTED
    else:  # ADDED FOR DISTRIBUTED
        device_ids = [local_rank] if device.type == "cuda" else None  # ADDED FOR DISTRIBUTED
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)  # ADDED FOR DISTRIBUTED
    torch.manual_seed(args.seed + rank)  # ADDED FOR DISTRIBUTED: each rank its own dropout masks
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=args.gamma)
    first_epoch = 1
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"][rank], device)  # ADDED FOR DISTRIBUTED: this rank's own
        first_epoch = state["epoch"] + 1
        if rank == 0:  # ADDED FOR DISTRIBUTED
            print(f"resuming after epoch {state['epoch']} of {args.epochs} from {args.checkpoint}", flush=True)

    losses = []  # each step's loss, kept on the device: no synchronisation per step
    for epoch in range(first_epoch, args.epochs + 1):
        model.train()
        if args.loader:
            sampler.set_epoch(epoch)  # ADDED FOR DISTRIBUTED: else every epoch repeats the first one's order
            batches = ((x.to(device), y.to(device)) for x, y in loader)
        else:
            batches = resident_batches(train_x, train_y, args.batch_size, args.seed, epoch)
        for x, y in batches:
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()  # the gradients are averaged over the ranks when it returns
            optimizer.step()
            losses.append(loss.detach())
        # Each rank's last forward updated its own BatchNorm statistics: evaluate, and save, rank 0's.
        for buffer in model.module.buffers():  # ADDED FOR DISTRIBUTED
            dist.broadcast(buffer, 0)  # ADDED FOR DISTRIBUTED
        test_loss, accuracy = evaluate(model.module, test_x, test_y)  # ADDED FOR DISTRIBUTED: the module
        scheduler.step()
        if rank == 0:  # ADDED FOR DISTRIBUTED
            print(f"epoch {epoch}: test loss {test_loss:.4f}, accuracy {100 * accuracy:.2f} %", flush=True)
        rngs = [None] * world_size  # ADDED FOR DISTRIBUTED: every rank's random state, for rank 0 to save
        dist.all_gather_object(rngs, rng_state(device))  # ADDED FOR DISTRIBUTED
        if rank == 0 and epoch == args.epochs:  # ADDED FOR DISTRIBUTED: before the checkpoint that says finished
            torch.save(model.module.state_dict(), args.save)  # ADDED FOR DISTRIBUTED: the plain model's, no "module."
        if rank == 0:  # ADDED FOR DISTRIBUTED
            saved = {"model": model.module.state_dict(), "rng": rngs, "epoch": epoch}  # ADDED FOR DISTRIBUTED
            saved |= {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
            saved["settings"] = settings(args)
            torch.save(saved, f"{args.checkpoint}.tmp")
            os.replace(f"{args.checkpoint}.tmp", args.checkpoint)  # whole or not at all, if killed while saving

    if args.log_losses and losses:  # the steps of this start
        losses = torch.stack(losses).double()
        dist.all_reduce(losses)  # ADDED FOR DISTRIBUTED: the mean over the ranks
        losses /= world_size  # ADDED FOR DISTRIBUTED
        if rank == 0:  # ADDED FOR DISTRIBUTED
            args.log_losses.write_text("".join(f"{loss!r}\n" for loss in losses.tolist()))
    dist.barrier()  # ADDED FOR DISTRIBUTED: leave together: gloo may abort a rank whose peer left early
    dist.destroy_process_group()  # ADDED FOR DISTRIBUTED


def spawned(local_rank: int, args: argparse.Namespace) -> None:  # ADDED FOR DISTRIBUTED: a rank mp.spawn started
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(local_rank)  # ADDED FOR DISTRIBUTED: the rest it inherits
    train(args)  # ADDED FOR DISTRIBUTED


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help=f"a folder with the four IDX files (default: {DEBIAN})")
    parser.add_argument("--dataset", choices=["mnist", "fashion-mnist"], default="fashion-mnist")
    parser.add_argument("--model", choices=MODELS, default="convnet", help="fastnet: with BatchNorm")
    parser.add_argument("--loader", action="store_true", help="batches from a DataLoader, not resident tensors")
    parser.add_argument("--epochs", type=int, default=14)
    parser.add_argument("--batch-size", type=int, default=64, help="global: over all ranks")  # ADDED FOR DISTRIBUTED
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7, help="learning rate factor per epoch")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--nproc", type=int, help="ranks without torchrun (GPUs, or 2)")  # ADDED FOR DISTRIBUTED
    parser.add_argument("--ddp", choices=["torch", "ours"], default="torch")  # ADDED FOR DISTRIBUTED: ours: ddp.py
    parser.add_argument("--checkpoint", type=Path, default=Path("checkpoint.pt"), help="written every epoch")
    parser.add_argument("--save", type=Path, default=Path("mnist_cnn.pt"), help="the trained weights")
    parser.add_argument("--log-losses", type=Path, help="write each step's training loss here, one a line")
    args = parser.parse_args()
    for option in ("epochs", "batch_size", "lr", "nproc"):
        if (value := getattr(args, option)) is not None and not 0 < value < math.inf:  # nan fails it too
            parser.error(f"--{option.replace('_', '-')} {value} must be a positive number")
    for option in ("checkpoint", "save", "log_losses"):  # now, not when the first epoch ends
        if (path := getattr(args, option)) is not None and not path.absolute().parent.is_dir():
            parser.error(f"--{option.replace('_', '-')} {path}: the folder {path.parent} does not exist")
    args.data = args.data or DEBIAN
    try:
        images, _ = load_data(args.data, args.dataset, "train")  # a missing file: one line, not one a rank
        load_data(args.data, args.dataset, "test")
    except (OSError, ValueError) as error:
        parser.error(f"--data {args.data}: {error}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if "LOCAL_RANK" in os.environ:  # ADDED FOR DISTRIBUTED: torchrun started this process
        args.nproc = int(os.environ["WORLD_SIZE"])  # ADDED FOR DISTRIBUTED
    args.nproc = args.nproc or (torch.cuda.device_count() or 1 if args.device == "cuda" else 2)  # ADDED FOR DISTRIBUTED
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", args.nproc))  # ADDED FOR DISTRIBUTED
    gpus = torch.cuda.device_count()  # ADDED FOR DISTRIBUTED
    if args.device == "cuda" and local_ranks > gpus:  # ADDED FOR DISTRIBUTED: one GPU a rank, or a traceback later
        hint = f"start at most {gpus} (--nproc, torchrun --nproc_per_node) or use --device cpu"  # ADDED FOR DISTRIBUTED
        sys.exit(f"error: {local_ranks} ranks on this machine, {gpus} GPU(s); {hint}")  # ADDED FOR DISTRIBUTED
    if args.batch_size > len(images):  # else epochs without a single step
        parser.error(f"--batch-size {args.batch_size} is more than the {len(images)} training images")
    if args.batch_size % args.nproc:  # ADDED FOR DISTRIBUTED
        parser.error(f"--batch-size {args.batch_size} is not divisible by {args.nproc} ranks")  # ADDED FOR DISTRIBUTED
    return args


def launch(args: argparse.Namespace) -> None:  # ADDED FOR DISTRIBUTED: what torchrun does, on one machine
    """Start the ranks, wait: the first to fail ends the rest; a SIGINT stops them all."""  # ADDED FOR DISTRIBUTED
    # A port the OS picks, not a fixed one a second job finds taken (pytorch#11324).
    with socket.socket() as s:  # ADDED FOR DISTRIBUTED
        s.bind(("127.0.0.1", 0))  # ADDED FOR DISTRIBUTED
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))  # ADDED FOR DISTRIBUTED
    os.environ.update(WORLD_SIZE=str(args.nproc), LOCAL_WORLD_SIZE=str(args.nproc))  # ADDED FOR DISTRIBUTED
    ranks = mp.spawn(spawned, (args,), nprocs=args.nproc, join=False)  # ADDED FOR DISTRIBUTED: spawned(rank, args)

    def interrupt(signum: int, frame: object) -> None:  # ADDED FOR DISTRIBUTED: Ctrl-C, or a SIGINT to this process
        for process in ranks.processes:  # ADDED FOR DISTRIBUTED: a terminal signals them too; kill(1) does not
            if process.exitcode is None:  # ADDED FOR DISTRIBUTED: not reaped yet, so the pid is still this one
                os.kill(process.pid, signal.SIGINT)  # ADDED FOR DISTRIBUTED
        for process in ranks.processes:  # ADDED FOR DISTRIBUTED: all gone before join() looks, none to terminate
            process.join()  # ADDED FOR DISTRIBUTED

    signal.signal(signal.SIGINT, interrupt)  # ADDED FOR DISTRIBUTED
    try:  # ADDED FOR DISTRIBUTED
        while not ranks.join():  # ADDED FOR DISTRIBUTED
            pass  # ADDED FOR DISTRIBUTED
    except mp.ProcessExitedException as error:  # ADDED FOR DISTRIBUTED: it printed why, or was killed
        if error.signal_name == "SIGINT":  # ADDED FOR DISTRIBUTED
            leave("interrupted: every rank stopped; the checkpoint keeps its last epoch", 130)  # ADDED FOR DISTRIBUTED
        sys.exit(f"error: {error}")  # ADDED FOR DISTRIBUTED


def main() -> None:
    args = parse_args()
    check_checkpoint(args)
    if "LOCAL_RANK" in os.environ:  # ADDED FOR DISTRIBUTED: torchrun set RANK, WORLD_SIZE and the address
        train(args)  # ADDED FOR DISTRIBUTED
    else:  # ADDED FOR DISTRIBUTED
        launch(args)  # ADDED FOR DISTRIBUTED


if __name__ == "__main__":  # ADDED FOR DISTRIBUTED: the ranks spawn starts import this file, skipping this
    try:
        main()
    except KeyboardInterrupt:  # before the ranks started: they stop themselves (train's first line)
        leave("interrupted", 130)
