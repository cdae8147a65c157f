"""Small, learnable MNIST-format data: class k is a bright square at spot k on a noisy background.

For tests, the GPU check script and dry runs: anything that must train without downloading.
"""

from __future__ import annotations

import struct
from pathlib import Path

import torch

from mnist_dist.operations import files


def write_idx(raw: Path, n_train: int = 640, n_test: int = 200, seed: int = 0) -> Path:
    """Writes the four decompressed IDX files of a tiny data set into ``raw``; returns ``raw``."""
    raw.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = torch.arange(n) % 10
        labels = labels[torch.randperm(n, generator=generator)]
        images = torch.randint(0, 96, (n, 28, 28), generator=generator, dtype=torch.uint8)
        for i, label in enumerate(labels.tolist()):
            row, col = divmod(label, 4)
            images[i, 2 + 8 * row : 8 + 8 * row, 2 + 7 * col : 7 + 7 * col] = 255
        image_bytes, label_bytes = images.numpy().tobytes(), labels.to(torch.uint8).numpy().tobytes()
        files.write(raw / f"{prefix}-images-idx3-ubyte", struct.pack(">IIII", 0x803, n, 28, 28) + image_bytes)
        files.write(raw / f"{prefix}-labels-idx1-ubyte", struct.pack(">II", 0x801, n) + label_bytes)
    return raw
