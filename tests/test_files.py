"""Issue 38: one atomic-write primitive for every file written whole (mnist_dist/operations/files.py), and files that
are opened without following a link or waiting on a FIFO. Each test failed on commit ee05943."""

import os
import re
import stat
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import pytest
from helpers import HANG_S

import mnist_dist
from mnist_dist import data
from mnist_dist.operations import files
from mnist_dist.operations.errors import DataError

PACKAGE = Path(mnist_dist.__file__).parent
# What writes a whole file by itself instead of through files.atomic: pathlib's writers, open() for
# writing, a temp name made by hand, a rename into place, matplotlib or torch given a path.
SECOND_MECHANISM = re.compile(
    r"(?<!files)\.write_(text|bytes)\(|open\([^)]*['\"][wx]b?['\"]|O_EXCL|os\.replace\(|savefig\((path|args)|"
    r"copyfile\(|export_chrome_trace\(str\(run_dir"
)


def test_every_file_written_whole_goes_through_the_one_primitive():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "files.py":
            continue
        for line in path.read_text().splitlines():
            code = line.split("#")[0]
            if SECOND_MECHANISM.search(code):
                found.append(f"{path.relative_to(PACKAGE)}: {line.strip()}")
    # checkpoint.save shifts the older checkpoints within the run directory (no new bytes): the one exception
    renames = {"operations/checkpoint.py: os.replace(source, dest)"}
    assert [f for f in found if f.split("  #")[0] not in renames] == []


def test_a_fetched_file_reaches_the_disk_before_its_rename(tmp_path, tiny_root, monkeypatch):
    events = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(fd):
        events.append(("fsync", "dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file"))
        fsync(fd)

    def recorded_replace(src, dst):
        events.append(("replace", Path(dst).name))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    data.prepare("mnist", tmp_path / "root", [str(tiny_root / "MNIST" / "raw")])
    renamed = [i for i, event in enumerate(events) if event == ("replace", "train-images-idx3-ubyte")]
    assert renamed, events
    at = renamed[0]
    assert events[at - 1] == ("fsync", "file") and events[at + 1] == ("fsync", "dir"), events
    record = [i for i, event in enumerate(events) if event == ("replace", ".fetched.json")]
    assert record and events[record[0] - 1] == ("fsync", "file"), events


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "results.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), files.atomic(target) as out:
        out.file.write(b"half")
        raise RuntimeError("killed")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def _fifo(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


def _returns_within(fn, deadline_s: float = 120):
    """What ``fn()`` returns or raises, run in a thread; a hang fails the test instead of stopping it."""
    outcome = {}

    def run():
        try:
            outcome["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - reported to the test
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(deadline_s)
    assert not thread.is_alive(), "hung"
    return outcome


def test_a_fifo_at_an_idx_name_is_one_line_not_a_hang(tmp_path, tiny_root):
    raw = tmp_path / "root" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", "train-images-idx3-ubyte"):
        (raw / name).write_bytes((tiny_root / "MNIST" / "raw" / name).read_bytes())
    _fifo(raw / "train-labels-idx1-ubyte")
    outcome = _returns_within(lambda: data.prepare("mnist", tmp_path / "root", []))
    assert isinstance(outcome.get("error"), DataError), outcome
    assert "train-labels-idx1-ubyte is invalid" in str(outcome["error"])
    assert "not a regular file" in str(outcome["error"])


def test_a_fifo_at_the_fetch_record_is_no_record_not_a_hang(tmp_path, tiny_root):
    _fifo(tmp_path / "root" / "MNIST" / ".fetched.json")
    outcome = _returns_within(lambda: data.prepare("mnist", tmp_path / "root", [str(tiny_root / "MNIST" / "raw")]))
    assert "error" not in outcome, outcome
    assert (tmp_path / "root" / "MNIST" / ".fetched.json").is_file()  # replaced by the real record


def test_a_labels_file_is_checked_by_its_header_before_it_is_read(tmp_path, tiny_root):
    raw = tmp_path / "root" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for source in (tiny_root / "MNIST" / "raw").iterdir():
        (raw / source.name).write_bytes(source.read_bytes())
    with open(raw / "train-labels-idx1-ubyte", "r+b") as f:  # sparse, 256 MiB: its header says 640 labels
        f.truncate(1 << 28)
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match=r"268435456 bytes, expected 648 for 640 items"):
            data.prepare("mnist", tmp_path / "root", [])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 24, f"{peak} bytes allocated: the file was read before its size was checked"


@pytest.mark.parametrize("mode", ["single", "ddp"])
def test_a_fifo_at_the_rank_log_is_one_line_not_a_hang(tmp_path, tiny_root, mode):
    run = tmp_path / "run"
    _fifo(run / "rank_0.log")
    command = [sys.executable, "-m", "mnist_dist", f"mode={mode}", f"data.root={tiny_root}", "data.mirrors=[]"]
    command += [
        "batch_size=32",
        "epochs=1",
        f"hydra.run.dir={run}",
        *(["gpus=2", "device=cpu"] if mode == "ddp" else []),
    ]
    launch = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        stderr = launch.communicate(timeout=HANG_S)[1]  # a hang fails here instead of stopping the suite
    finally:
        launch.kill()
    refused = "not a regular file (a FIFO? a device?), which mnist_dist neither reads nor writes; remove it"
    expected = {  # the worker cannot open its log: the line names no log to read
        "single": f"error: cannot write {run}/rank_0.log: {refused}",
        "ddp": f"error: rank 0 failed: OSError: [Errno 22] {refused}: '{run}/rank_0.log'",
    }
    assert (launch.returncode, stderr.splitlines()[-1]) == (1, expected[mode]), stderr
    assert "Traceback" not in stderr and stat.S_ISFIFO(os.lstat(run / "rank_0.log").st_mode)
