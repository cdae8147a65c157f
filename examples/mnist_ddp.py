"""Data-parallel MNIST / Fashion-MNIST training, the whole trainer in one file to copy.

    torchrun --nproc_per_node=2 examples/mnist_ddp.py            # torchrun starts the ranks
    python examples/mnist_ddp.py --nproc 2                       # or mnist_dist.parallel.spawn does
    python examples/mnist_ddp.py --data DIR --dataset mnist      # a folder of the four IDX files (.gz or not)

pytorch/examples mnist (its convnet and recipe: Adadelta lr 1.0, StepLR x 0.7 per epoch, batch 64, seed 1)
as one process per device: gloo on CPU, NCCL on CUDA (one GPU per rank). It computes what the app's
``python -m mnist_dist mode=ddp gpus=2`` computes, step for step (tests/test_examples.py checks it on
CPU): the same initial weights, the same global batches (one seeded permutation per epoch, rank r taking
the r-th part of each batch), per-rank dropout masks, exact sharded evaluation. The whole data set sits
on the device as one tensor. Rank 0 prints one line per epoch and saves the plain model's weights
(``--save``), which load into ``mnist_dist.model.ConvNet``. The default data is Debian's Fashion-MNIST
(apt-get install dataset-fashion-mnist): nothing is downloaded.

Every line that a one-process version would not have, or would write otherwise, ends in
``# ADDED FOR DISTRIBUTED``: ``grep -n "ADDED FOR DISTRIBUTED" examples/mnist_ddp.py`` lists them. Of
mnist_dist it imports only ``mnist_dist.parallel`` (our ``DistributedDataParallel``, the ``spawn``
launcher and ``init_process_group``, which under ``spawn`` keeps the job's keys to itself), files to copy.
To train with torch's DDP instead, change the one line

    model = parallel.DistributedDataParallel(model)  # ADDED FOR DISTRIBUTED

into ``model = torch.nn.parallel.DistributedDataParallel(model)  # ADDED FOR DISTRIBUTED``: the same
numbers come out (tests/test_examples.py checks it).
"""

from __future__ import annotations

import argparse
import gzip
import os
import struct
import sys
from pathlib import Path

import torch
import torch.distributed as dist  # ADDED FOR DISTRIBUTED
import torch.nn.functional as F
from torch import nn

from mnist_dist import parallel  # ADDED FOR DISTRIBUTED: our DDP, launcher and process group set-up

NORMALIZE = {"mnist": (0.1307, 0.3081), "fashion-mnist": (0.2860, 0.3530)}  # mean, std of the training images
FILES = [f"{split}-{kind}-ubyte" for split in ("train", "t10k") for kind in ("images-idx3", "labels-idx1")]
DEBIAN = Path("/usr/share/datasets/fashion-mnist")  # apt-get install dataset-fashion-mnist


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


def idx_path(folder: Path, name: str) -> Path:
    """The IDX file ``name`` in ``folder``, decompressed or gzipped."""
    for path in (folder / name, folder / f"{name}.gz"):
        if path.is_file():
            return path
    raise FileNotFoundError(f"{folder} holds neither {name} nor {name}.gz")


def read_idx(path: Path) -> torch.Tensor:
    """An IDX file as a uint8 tensor of the shape its header gives."""
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
        data = f.read()
    ndim = data[3]  # bytes 0-3: zero, zero, the item type (uint8), the number of dimensions
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    return torch.frombuffer(bytearray(data[4 + 4 * ndim :]), dtype=torch.uint8).view(shape)


def load(folder: Path, split: str, dataset: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A split on ``device``: images float32 [N, 1, 28, 28] normalised, labels int64 [N]."""
    mean, std = NORMALIZE[dataset]
    images = read_idx(idx_path(folder, f"{split}-images-idx3-ubyte"))
    labels = read_idx(idx_path(folder, f"{split}-labels-idx1-ubyte"))
    # uint8 to the device, then convert there: a quarter of the bytes to copy.
    return images.to(device).unsqueeze(1).float().div(255).sub_(mean).div_(std), labels.to(device, torch.int64)


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, world_size: int) -> tuple[float, float]:
    """Loss and accuracy over the whole test set."""
    model.eval()
    # Each rank scores a contiguous share and the sums are added: every image counts once, no padding.
    share = slice(len(x) * rank // world_size, len(x) * (rank + 1) // world_size)  # ADDED FOR DISTRIBUTED
    totals = torch.zeros(2, dtype=torch.float64, device=x.device)  # loss sum, correct
    for start in range(share.start, share.stop, 1000):
        stop = min(start + 1000, share.stop)
        logits = model(x[start:stop])
        totals[0] += F.cross_entropy(logits, y[start:stop], reduction="sum")
        totals[1] += (logits.argmax(1) == y[start:stop]).sum()
    dist.all_reduce(totals)  # ADDED FOR DISTRIBUTED
    loss, correct = totals.tolist()
    return loss / len(x), correct / len(x)


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    local_rank = int(os.environ.get("LOCAL_RANK", rank))  # ADDED FOR DISTRIBUTED: spawn's ranks are local
    device = torch.device(f"cuda:{local_rank}" if args.device == "cuda" else "cpu")  # ADDED FOR DISTRIBUTED
    if device.type == "cuda":  # ADDED FOR DISTRIBUTED
        torch.cuda.set_device(device)  # ADDED FOR DISTRIBUTED
        parallel.init_process_group("nccl", device_id=device)  # ADDED FOR DISTRIBUTED: address, rank, size from env
    else:  # ADDED FOR DISTRIBUTED: the processes on a machine share its cores, rather than each taking all
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))  # ADDED FOR DISTRIBUTED
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))  # ADDED FOR DISTRIBUTED
        parallel.init_process_group("gloo")  # ADDED FOR DISTRIBUTED: under spawn, in the job's own store
    train_x, train_y = load(args.data, "train", args.dataset, device)
    test_x, test_y = load(args.data, "t10k", args.dataset, device)
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    model = ConvNet().to(device)
    model = parallel.DistributedDataParallel(model)  # ADDED FOR DISTRIBUTED
    torch.manual_seed(args.seed + rank)  # ADDED FOR DISTRIBUTED: each rank its own dropout masks
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=args.gamma)

    # --batch-size is the global batch, so the training does not depend on the number of ranks.
    per_rank = args.batch_size // world_size  # ADDED FOR DISTRIBUTED
    losses = []  # each step's loss, kept on the device: no synchronisation per step
    for epoch in range(1, args.epochs + 1):
        model.train()
        # One permutation per epoch, a function of the seed and the epoch: the same on every rank.
        generator = torch.Generator().manual_seed(args.seed * 100_003 + epoch)
        order = torch.randperm(len(train_x), generator=generator).to(device)
        for start in range(0, len(order) - args.batch_size + 1, args.batch_size):  # the last partial batch dropped
            indices = order[start + rank * per_rank : start + (rank + 1) * per_rank]  # ADDED FOR DISTRIBUTED
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(train_x[indices]), train_y[indices])
            loss.backward()  # the gradients are averaged over the ranks when it returns
            optimizer.step()
            losses.append(loss.detach())
            if len(losses) == args.max_steps:
                break
        test_loss, accuracy = evaluate(model.module, test_x, test_y, rank, world_size)  # ADDED FOR DISTRIBUTED
        scheduler.step()
        if rank == 0:  # ADDED FOR DISTRIBUTED
            print(f"epoch {epoch}: test loss {test_loss:.4f}, accuracy {100 * accuracy:.2f} %", flush=True)
        if len(losses) == args.max_steps:
            break

    if args.log_losses:
        losses = torch.stack(losses).double()
        dist.all_reduce(losses)  # ADDED FOR DISTRIBUTED: the mean over the ranks
        losses /= world_size  # ADDED FOR DISTRIBUTED
        if rank == 0:  # ADDED FOR DISTRIBUTED
            args.log_losses.write_text("".join(f"{loss!r}\n" for loss in losses.tolist()))
    if rank == 0:  # ADDED FOR DISTRIBUTED
        torch.save(model.module.state_dict(), args.save)  # ADDED FOR DISTRIBUTED: the plain model's, no "module."
    dist.barrier()  # ADDED FOR DISTRIBUTED: leave together: gloo may abort a rank whose peer left early
    dist.destroy_process_group()  # ADDED FOR DISTRIBUTED


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help=f"a folder with the four IDX files (default: {DEBIAN})")
    parser.add_argument("--dataset", choices=NORMALIZE, default="fashion-mnist", help="sets the normalisation")
    parser.add_argument("--epochs", type=int, default=14)
    parser.add_argument("--max-steps", type=int, help="stop after this many optimizer steps")
    parser.add_argument("--batch-size", type=int, default=64, help="global: over all ranks")
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7, help="learning rate factor per epoch")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--nproc", type=int, help="ranks without torchrun (GPUs, or 2)")  # ADDED FOR DISTRIBUTED
    parser.add_argument("--save", type=Path, default=Path("mnist_cnn.pt"), help="the trained weights")
    parser.add_argument("--log-losses", type=Path, help="write each step's training loss here, one a line")
    args = parser.parse_args()
    args.data = args.data or DEBIAN
    try:
        [idx_path(args.data, name) for name in FILES]  # here, once, rather than in every rank
    except FileNotFoundError as error:
        parser.error(f"{error}; --data is a folder with {', '.join(FILES)} (.gz or not)")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if "LOCAL_RANK" in os.environ:  # ADDED FOR DISTRIBUTED: torchrun started this process
        args.nproc = int(os.environ["WORLD_SIZE"])  # ADDED FOR DISTRIBUTED
    args.nproc = args.nproc or (torch.cuda.device_count() if args.device == "cuda" else 2)  # ADDED FOR DISTRIBUTED
    if args.batch_size % args.nproc:  # ADDED FOR DISTRIBUTED
        parser.error(f"--batch-size {args.batch_size} is not divisible by {args.nproc} ranks")  # ADDED FOR DISTRIBUTED
    return args


if __name__ == "__main__":  # spawn's ranks import this file without running this
    args = parse_args()
    if "LOCAL_RANK" in os.environ:  # ADDED FOR DISTRIBUTED: torchrun set RANK, WORLD_SIZE and the address
        worker(int(os.environ["RANK"]), args.nproc, args)  # ADDED FOR DISTRIBUTED
    else:  # ADDED FOR DISTRIBUTED
        try:  # ADDED FOR DISTRIBUTED
            parallel.spawn(worker, args.nproc, args)  # ADDED FOR DISTRIBUTED: sets the same variables, then worker()
        except parallel.WorkerFailed as error:  # ADDED FOR DISTRIBUTED
            sys.exit(f"error: {error}")  # ADDED FOR DISTRIBUTED
