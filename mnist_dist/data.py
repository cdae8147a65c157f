"""MNIST / Fashion-MNIST: ``prepare`` gets the files in the launching process; workers read them with ``load_split``,
without torchvision (seconds of import each). A global batch is a slice of one seeded permutation per epoch, rank r
taking the r-th of ``world_size`` equal parts, so the ranks' mean gradient is one process's; no partial batch runs."""

from __future__ import annotations

import gzip
import hashlib
import logging
import os
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from filelock import FileLock

from mnist_dist.operations import files
from mnist_dist.operations.errors import DataError

log = logging.getLogger(__name__)

_DATASETS = {"mnist": "MNIST", "fashion_mnist": "FashionMNIST"}  # config name: torchvision class and folder
# Each decompressed file's md5, MNIST's and Fashion-MNIST's (as _DATASETS; the latter from Debian's files): torchvision
# checks only the upstream .gz archives', and Debian's .gz files are recompressed (other md5s, the same bytes inside).
_RAW_MD5 = {
    "train-images-idx3-ubyte": ("6bbc9ace898e44ae57da46a324031adb", "f4a8712d7a061bf5bd6d2ca38dc4d50a"),
    "train-labels-idx1-ubyte": ("a25bea736e30d166cdddb491f175f624", "9018921c3c673c538a1fc5bad174d6f9"),
    "t10k-images-idx3-ubyte": ("2646ac647ad5339dbf082846283269ea", "8181f5470baa50b63fa0f6fddb340f0a"),
    "t10k-labels-idx1-ubyte": ("27ae3e4e09519cfbb04c329615203637", "15d484375f8d13e6eb1aabb0c3f46965"),
}


def raw_dir(name: str, root: str | os.PathLike) -> Path:
    """Where the decompressed IDX files of ``name`` live under ``root`` (torchvision's layout)."""
    if name not in _DATASETS:
        raise DataError(f"unknown dataset {name!r}; valid names: {', '.join(_DATASETS)}")
    return Path(root).expanduser() / _DATASETS[name] / "raw"


def prepare(name: str, root: str | os.PathLike, mirrors: Sequence[str]) -> Path:
    """``raw_dir(name, root)`` holding the four decompressed IDX files: those there as they are (torchvision's rule),
    else from the .gz files there, then ``mirrors`` in order: a URL through torchvision (its md5s), a folder if all four
    are ``name``'s by md5. Launches sharing ``root`` fetch once (a lock). DataError if none works, nothing written."""
    raw = raw_dir(name, root)
    if _complete(raw):
        return raw
    tried = []
    if sources := [str(raw)] * any(raw.glob("*.gz")) + list(mirrors):
        raw.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(raw.parent / ".prepare.lock"):
            if _complete(raw):  # another launch got them while this one waited
                return raw
            for source in sources:
                try:
                    _fetch(name, source, raw)
                    log.info("%s: got the IDX files from %s", name, source)
                    return raw
                # a file or URL not there (URLError is an OSError), a failed md5 (ours too: RuntimeError), a broken .gz
                except (OSError, RuntimeError, EOFError, zlib.error) as e:
                    tried.append(f"{source} ({' '.join(str(e).split())})")  # one line, whatever e says
    raise DataError(  # offline, Debian's package is the usual way out: Fashion-MNIST, or instead of MNIST
        f"could not get the {name} files: tried {', '.join(tried) or 'nothing (no mirrors)'}. Put the four IDX "
        f"files in {raw} or pass data.mirrors=[<dir or url>]; offline: apt-get install dataset-fashion-mnist, then "
        "data=fashion_mnist 'data.mirrors=[/usr/share/datasets/fashion-mnist]'"
    )


def _complete(raw: Path) -> bool:
    return all((raw / file).is_file() for file in _RAW_MD5)


def _fetch(name: str, source: str, raw: Path) -> None:
    if source.startswith(("http://", "https://")):
        import torchvision.datasets  # in the parent only: it imports torch._dynamo, seconds of CPU

        cls = getattr(torchvision.datasets, _DATASETS[name])
        # A subclass of the same name keeps torchvision's folder; its mirrors are the one being tried.
        mirrored = type(cls.__name__, (cls,), {"mirrors": [source.rstrip("/") + "/"]})
        mirrored(raw.parent.parent, train=True, download=True)
        return
    folder, contents = Path(source).expanduser(), {}
    for file, md5s in _RAW_MD5.items():
        gz = folder / f"{file}.gz"
        contents[file] = gzip.decompress(gz.read_bytes()) if gz.is_file() else (folder / file).read_bytes()
        md5 = hashlib.md5(contents[file]).hexdigest()
        if (owner := dict(zip(md5s, _DATASETS)).get(md5)) != name:
            raise DataError(
                f"its {file} is {owner}'s, not {name}'s" if owner else f"its {file} is not {name}'s (md5 {md5})"
            )
    raw.mkdir(parents=True, exist_ok=True)
    for file, content in contents.items():
        files.write(raw / file, content)


def load_split(raw_dir: str | os.PathLike, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Images uint8 [N, 28, 28] and labels int64 [N] of one split, past their IDX headers; `prepare` checked them."""
    prefix = Path(raw_dir) / ("train" if train else "t10k")
    images = torch.frombuffer(bytearray(Path(f"{prefix}-images-idx3-ubyte").read_bytes()[16:]), dtype=torch.uint8)
    labels = torch.frombuffer(bytearray(Path(f"{prefix}-labels-idx1-ubyte").read_bytes()[8:]), dtype=torch.uint8)
    return images.view(-1, 28, 28), labels.long()


def to_device_tensors(
    images: torch.Tensor, labels: torch.Tensor, mean: float, std: float, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 [N, 1, 28, 28] normalised as (x/255 - mean)/std, and int64 labels, on `device`; the uint8 tensor
    moves first (a quarter of the bytes), and the caller's is never modified."""
    x = images.to(device).unsqueeze(1).float().div(255).sub_(mean).div_(std)
    return x, labels.to(device, torch.int64)


def epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The permutation of epoch ``epoch``: a function of (seed, epoch) alone, identical on every rank."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(num_samples, generator=generator)


def steps_per_epoch(num_samples: int, global_batch: int) -> int:
    return num_samples // global_batch


def rank_batches(order: torch.Tensor, global_batch: int, rank: int, world_size: int) -> Iterator[torch.Tensor]:
    """This rank's indices for each global batch of ``order``, disjoint from every other rank's."""
    per_rank = global_batch // world_size
    for step in range(steps_per_epoch(len(order), global_batch)):
        start = step * global_batch + rank * per_rank
        yield order[start : start + per_rank]


def eval_shard(num_samples: int, rank: int, world_size: int) -> slice:
    """A contiguous share of the test set with no padding, so summed counts cover each sample once
    (DistributedSampler pads by repeating samples, which skews accuracy: pytorch/pytorch#25162)."""
    return slice(num_samples * rank // world_size, num_samples * (rank + 1) // world_size)
