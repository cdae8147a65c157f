"""A worker function whose module, imported by a forkserver, never finishes importing: for a test that interrupts
a job while its forkserver is still importing (as it imports torch, for seconds, in every CPU job's start).

The launcher imports it first, then sets ``MNIST_DIST_BLOCK_IMPORT`` to a file name: the forkserver, started after,
touches that file and blocks."""

import os
import threading
from pathlib import Path

if os.environ.get("MNIST_DIST_BLOCK_IMPORT"):
    Path(os.environ["MNIST_DIST_BLOCK_IMPORT"]).touch()
    threading.Event().wait()


def idle(rank: int, world_size: int) -> None:
    pass
