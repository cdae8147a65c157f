"""MNIST / Fashion-MNIST on disk and on the device.

`prepare` runs once in the launching process (docs/data.md): it fetches, decompresses and validates the
four IDX files in torchvision's layout, so workers only call `load_split`, which needs no network and trusts
the files; operations/fetch.py gets one file from one source.

Then which samples each rank sees: a global batch is a slice of one seeded permutation per epoch, and rank r
takes the r-th of its ``world_size`` equal parts, so averaging the ranks' gradients gives exactly the single
process's gradient of that batch. The last incomplete global batch is dropped: every rank takes equal steps.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from filelock import FileLock

from mnist_dist.operations.errors import DataError
from mnist_dist.operations.fetch import fetch_file, fetched_here
from mnist_dist.operations.files import open_regular

log = logging.getLogger(__name__)

_DATASETS = {"mnist": "MNIST", "fashion_mnist": "FashionMNIST"}  # config name: torchvision class
_SPLITS = (("train", 60_000), ("t10k", 10_000))  # file prefix, standard size
# What a failing source may raise: network (URLError and HTTPError are OSErrors), a broken gzip
# stream, torchvision's own checks (RuntimeError), our validation (DataError is a RuntimeError).
_SOURCE_ERRORS = (OSError, EOFError, zlib.error, RuntimeError)


def dataset_class(name: str) -> type:
    """The torchvision class for a config name; it fixes the file names, md5s, mirrors and folder."""
    class_name = _class_name(name)
    # Imported here, in the parent's prepare only: torchvision imports torch._dynamo, seconds of CPU
    # that every worker would pay at start for files it only reads.
    import torchvision.datasets

    return getattr(torchvision.datasets, class_name)


def _class_name(name: str) -> str:
    try:
        return _DATASETS[name]
    except KeyError:
        raise DataError(f"unknown dataset {name!r}; valid names: {', '.join(_DATASETS)}") from None


# https copies of the upstream .gz files (byte for byte, so md5-checked) where torchvision knows only
# plain http: Fashion-MNIST's authors keep them in their repository.
_UPSTREAM_HTTPS = {
    "fashion_mnist": ["https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/"]
}


def official_mirrors(name: str) -> list[str]:
    """The config defaults: torchvision's https mirrors and the authors' https copy. Plain http (such
    as yann.lecun.com) is tried only where the user writes it."""
    https = [m for m in dataset_class(name).mirrors if m.startswith("https://")]
    return https + _UPSTREAM_HTTPS.get(name, [])


def raw_dir(name: str, root: str | os.PathLike) -> Path:
    """Where the decompressed IDX files of ``name`` live under ``root`` (torchvision's layout)."""
    return Path(root) / _class_name(name) / "raw"


def prepare(name: str, root: str | os.PathLike, mirrors: Sequence[str]) -> Path:
    """Make <root>/<Folder>/raw hold the four decompressed, validated IDX files and return that dir.

    Idempotent and cheap once done (headers and label bytes are re-checked, nothing is fetched, no
    file is written: a read-only root works). Otherwise a lock makes a second launch sharing `root`
    wait, then find the files ready. A file prepare did not write is never deleted or replaced.
    """
    raw = raw_dir(name, root)
    counts = _valid_counts(raw)
    if counts is None:
        cls = dataset_class(name)
        raw.mkdir(parents=True, exist_ok=True)
        with FileLock(raw.parent / ".prepare.lock"):
            counts = {gz: _get_file(name, cls, raw, gz, md5, mirrors) for gz, md5 in cls.resources}
    for prefix, standard in _SPLITS:
        n_images = counts[f"{prefix}-images-idx3-ubyte.gz"]
        n_labels = counts[f"{prefix}-labels-idx1-ubyte.gz"]
        if n_images != n_labels:
            raise DataError(
                f"{raw}/{prefix}-images-idx3-ubyte holds {n_images} images but "
                f"{prefix}-labels-idx1-ubyte holds {n_labels} labels: put a matching pair "
                f"there, or delete both to fetch them again"
            )
        if not n_images:
            raise DataError(
                f"{raw}/{prefix}-images-idx3-ubyte and {prefix}-labels-idx1-ubyte hold no examples: put the "
                "full files there, or delete both to fetch them again"
            )
        if n_images != standard:
            log.warning(
                "%s %s split has %d examples, not the standard %d (a subset?)", name, prefix, n_images, standard
            )
    return raw


def _valid_counts(raw: Path) -> dict[str, int] | None:
    """Item counts by .gz name when all four decompressed files are in place and valid, else None."""
    names = [f"{prefix}-{kind}-ubyte.gz" for prefix, _ in _SPLITS for kind in ("images-idx3", "labels-idx1")]
    try:
        return {gz: _check_idx(raw / gz.removesuffix(".gz"), "-images-" in gz) for gz in names}
    except (DataError, OSError):
        return None


def load_split(raw_dir: str | os.PathLike, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Images uint8 [N, 28, 28] and labels int64 [N] of one split; no network, `prepare` validated them."""
    prefix = "train" if train else "t10k"
    raw = Path(raw_dir)
    images = _read_idx(raw / f"{prefix}-images-idx3-ubyte", header_len=16)
    labels = _read_idx(raw / f"{prefix}-labels-idx1-ubyte", header_len=8)
    return images.view(-1, 28, 28), labels.long()


def _read_idx(path: Path, header_len: int) -> torch.Tensor:
    """The uint8 items after the header (torchvision's reader does the same, but importing it costs a
    worker seconds: see dataset_class)."""
    with os.fdopen(open_regular(path), "rb") as f:
        return torch.frombuffer(bytearray(f.read()[header_len:]), dtype=torch.uint8)


def to_device_tensors(
    images: torch.Tensor, labels: torch.Tensor, mean: float, std: float, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 [N, 1, 28, 28] normalised as (x/255 - mean)/std, and int64 labels, on `device`. The uint8
    tensor is moved first (a quarter of the bytes, converted on the device); the first division is out of
    place, so the caller's tensor is never modified."""
    x = images.to(device).unsqueeze(1).float().div(255).sub_(mean).div_(std)
    return x, labels.to(device, torch.int64)


def _get_file(name: str, cls: type, raw: Path, gz_name: str, md5: str, mirrors: Sequence[str]) -> int:
    """Ensure raw/<gz_name minus .gz> is a valid IDX file and return its item count: the decompressed file
    already there, the .gz already there, then each mirror. A bad file prepare did not write is left alone."""
    dest = raw / gz_name.removesuffix(".gz")
    images = "-images-" in gz_name
    tried = []
    if dest.exists() or dest.is_symlink():  # a dangling or looping link is the user's file too
        try:
            return _check_idx(dest, images)
        except (DataError, OSError) as e:
            reason = str(e) if isinstance(e, DataError) else f"{type(e).__name__}: {e.strerror}"
            if not fetched_here(dest):
                raise DataError(
                    f"{dest} is invalid ({reason}); mnist_dist did not write it, so it is left alone: "
                    "fix it, or move it away to have it fetched again"
                ) from None
            log.warning("%s is invalid (%s); fetching it again", dest, reason)
            tried.append(f"{dest} ({reason})")
    official = {m.rstrip("/") for m in [*cls.mirrors, *official_mirrors(name)]}  # serve the md5s torchvision records
    local_gz = [str(raw)] if (raw / gz_name).is_file() else []
    for source in [*local_gz, *mirrors]:
        try:
            checked_md5 = md5 if source.rstrip("/") in official else None
            with fetch_file(source, gz_name, checked_md5, dest, _largest_valid(gz_name)) as tmp:
                count = _check_idx(tmp, images)
            log.info("%s: got %s from %s", name, dest.name, source)
            return count
        except _SOURCE_ERRORS as e:
            reason = str(e) if isinstance(e, DataError) else f"{type(e).__name__}: {e}"
            tried.append(f"{source} ({' '.join(reason.split())})")  # one line, whatever e says
    # Offline, Debian's package is the usual way out, for Fashion-MNIST itself or instead of MNIST.
    debian = (
        " (Debian: apt-get install dataset-fashion-mnist; data.mirrors=[/usr/share/datasets/fashion-mnist])"
        if cls.__name__ == "FashionMNIST"
        else "; or train offline on Fashion-MNIST: apt-get install dataset-fashion-mnist, then "
        "data=fashion_mnist 'data.mirrors=[/usr/share/datasets/fashion-mnist]'"
    )
    raise DataError(
        f"could not get {gz_name} for {name}: tried {', '.join(tried) or 'nothing (no mirrors)'}. "
        f"Put the four IDX files in {raw} or pass data.mirrors=[<dir or url>]{debian}"
    )


def _largest_valid(gz_name: str) -> int:
    """Bytes of the decompressed file at the standard size: no valid file is larger."""
    standard = dict(_SPLITS)[gz_name.split("-")[0]]
    return (16 + standard * 784) if "-images-" in gz_name else (8 + standard)


def _check_idx(path: Path, images: bool) -> int:
    """The item count of an MNIST IDX file, or a DataError saying what is wrong with it (once, in the parent,
    so that workers can trust the files; torchvision's reader only asserts)."""
    header_len, magic_want, dims_want, item = (16, 0x803, [28, 28], 784) if images else (8, 0x801, [], 1)
    with os.fdopen(open_regular(path), "rb") as f:  # a FIFO or a device is refused, never waited on
        header = f.read(header_len)
        if len(header) < header_len:
            raise DataError(f"{len(header)} bytes, too short for an IDX header")
        magic, n, *dims = struct.unpack(f">{header_len // 4}I", header)
        if magic != magic_want:
            raise DataError(f"magic {magic:#010x}, expected {magic_want:#010x}")
        if dims != dims_want:
            raise DataError(f"images are {dims[0]}x{dims[1]}, expected 28x28")
        # The size before any item is read: a sparse file of 40 GB must not be read into memory.
        size, size_want = os.fstat(f.fileno()).st_size, header_len + n * item
        if size != size_want:
            raise DataError(f"{size} bytes, expected {size_want} for {n} items (truncated?)")
        labels = b"" if images else f.read(n)
    if labels and max(labels) > 9:
        raise DataError(f"label {max(labels)} out of range 0..9")
    return n


def split_size(raw_dir: str | os.PathLike, train: bool) -> int:
    """The number of images of one split, from its IDX header (``prepare`` validated the file)."""
    prefix = "train" if train else "t10k"
    with open(Path(raw_dir) / f"{prefix}-images-idx3-ubyte", "rb") as f:
        return struct.unpack(">I", f.read(8)[4:])[0]


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
