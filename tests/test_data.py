"""Tests for mnist_dist.data: tiny IDX files written here and served over loopback HTTP, and Debian's real
Fashion-MNIST where it is installed."""

import functools
import gzip
import hashlib
import http.server
import logging
import socket
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torchvision
from helpers import FASHION

from mnist_dist import data
from mnist_dist.operations.errors import DataError

NAMES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
needs_fashion = pytest.mark.skipif(not FASHION.is_dir(), reason="apt-get install dataset-fashion-mnist")


def images_idx(n: int, seed: int = 0) -> bytes:
    return struct.pack(">IIII", 0x803, n, 28, 28) + bytes((i * 31 + seed) % 256 for i in range(n * 784))


def labels_idx(n: int) -> bytes:
    return struct.pack(">II", 0x801, n) + bytes(i % 10 for i in range(n))


def idx_set(n_train: int = 20, n_test: int = 10) -> dict[str, bytes]:
    """Decompressed content of a valid four-file set, keyed by file name."""
    contents = [images_idx(n_train, 1), labels_idx(n_train), images_idx(n_test, 2), labels_idx(n_test)]
    return dict(zip(NAMES, contents))


def write_set(folder: Path, files: dict[str, bytes], gz: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        if gz:
            (folder / f"{name}.gz").write_bytes(gzip.compress(content, mtime=0))  # same bytes, same md5
        else:
            (folder / name).write_bytes(content)
    return folder


def idx_files(raw: Path) -> list[str]:
    return sorted(p.name for p in raw.glob("*-ubyte")) if raw.is_dir() else []


@pytest.fixture
def serve(monkeypatch):
    """serve(dir) -> URL of a loopback HTTP server for dir, whose .gz files torchvision takes as MNIST's upstream."""
    servers = []

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    def start(folder: Path) -> str:
        md5s = [(f"{n}.gz", hashlib.md5((folder / f"{n}.gz").read_bytes()).hexdigest()) for n in NAMES]
        monkeypatch.setattr(torchvision.datasets.MNIST, "resources", md5s)
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder)))
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


# --- files already in place -------------------------------------------------------------------


def test_files_in_raw_are_used_as_they_are_and_nothing_is_written(tmp_path):
    files = idx_set()
    raw = write_set(tmp_path / "MNIST" / "raw", files, gz=False)
    assert data.prepare("mnist", tmp_path, mirrors=[]) == raw  # no mirrors: nothing could have been fetched
    assert {name: (raw / name).read_bytes() for name in NAMES} == files
    # nothing written, not even a lock: a read-only root (a system's data folder) serves as it is
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(["MNIST", "raw", *NAMES])


# --- local folders: accepted by the md5s of the decompressed files ------------------------------


@pytest.mark.slow  # full-size data
@needs_fashion
def test_debians_fashion_mnist_is_taken_by_its_decompressed_md5s(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="mnist_dist.data")
    # Debian's .gz files are recompressed: not torchvision's md5s
    raw = data.prepare("fashion_mnist", tmp_path, [str(tmp_path / "absent"), str(FASHION)])
    assert raw == tmp_path / "FashionMNIST" / "raw"
    assert f"fashion_mnist: got the IDX files from {FASHION}" in caplog.messages
    for train, n in ((True, 60_000), (False, 10_000)):
        images, labels = data.load_split(raw, train)
        assert images.shape == (n, 28, 28)
        assert labels.unique().tolist() == list(range(10))
    assert (raw / NAMES[1]).read_bytes() == gzip.decompress((FASHION / f"{NAMES[1]}.gz").read_bytes())


def test_a_folder_of_other_files_is_refused(tmp_path):
    mirror = write_set(tmp_path / "mirror", idx_set())
    with pytest.raises(DataError, match=r"its train-images-idx3-ubyte is not mnist's \(md5 [0-9a-f]{32}\)"):
        data.prepare("mnist", tmp_path / "root", [str(mirror)])
    assert idx_files(tmp_path / "root" / "MNIST" / "raw") == []


# --- URLs: torchvision's download and md5 --------------------------------------------------------


def test_a_url_mirror_goes_through_torchvision_and_its_md5(tmp_path, serve, caplog):
    caplog.set_level(logging.INFO, logger="mnist_dist.data")
    files = idx_set()
    bad = serve(write_set(tmp_path / "bad", {**files, "t10k-labels-idx1-ubyte": labels_idx(11)}))
    good = serve(write_set(tmp_path / "good", files)).rstrip("/")  # its md5s are the upstream ones; no slash
    raw = data.prepare("mnist", tmp_path / "root", [bad, good])
    assert {name: (raw / name).read_bytes() for name in NAMES} == files
    assert caplog.messages[-1] == f"mnist: got the IDX files from {good}"  # bad: refused by torchvision's md5


def test_no_mirrors_offline_writes_nothing_and_names_the_fashion_mnist_route(tmp_path):
    with pytest.raises(DataError) as error:
        data.prepare("mnist", tmp_path / "root", [])
    assert "data=fashion_mnist 'data.mirrors=[/usr/share/datasets/fashion-mnist]'" in str(error.value)
    assert not (tmp_path / "root").exists()
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url, missing = f"http://127.0.0.1:{port}/", str(tmp_path / "nowhere")
    with pytest.raises(DataError) as error:
        data.prepare("fashion_mnist", tmp_path, [url, missing])
    message = str(error.value)
    assert "\n" not in message and url in message and missing in message  # each place it tried
    assert str(tmp_path / "FashionMNIST" / "raw") in message  # where to put the files
    assert idx_files(tmp_path / "FashionMNIST" / "raw") == []


# --- loading ----------------------------------------------------------------------------------


def test_concurrent_prepares_fetch_once(tmp_path, serve, caplog):
    caplog.set_level(logging.INFO, logger="mnist_dist.data")
    mirror = serve(write_set(tmp_path / "mirror", idx_set()))
    with ThreadPoolExecutor(2) as pool:
        raws = list(pool.map(lambda _: data.prepare("mnist", tmp_path / "root", [mirror]), range(2)))
    assert raws == [tmp_path / "root" / "MNIST" / "raw"] * 2
    assert caplog.messages.count(f"mnist: got the IDX files from {mirror}") == 1  # the other found them ready


def test_load_split_and_to_device(tmp_path):
    files = idx_set()
    raw = write_set(tmp_path / "raw", files, gz=False)
    images, labels = data.load_split(raw, train=False)
    assert images.shape == (10, 28, 28) and images.dtype == torch.uint8
    assert labels.tolist() == list(range(10)) and labels.dtype == torch.int64
    assert images.flatten().tolist() == list(files["t10k-images-idx3-ubyte"][16:])
    assert data.load_split(raw, train=True)[0].shape == (20, 28, 28)

    x, y = data.to_device_tensors(images, labels, mean=0.5, std=0.25, device="cpu")
    assert x.shape == (10, 1, 28, 28) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and y.tolist() == labels.tolist()
    expected = (images.unsqueeze(1).double() / 255 - 0.5) / 0.25
    torch.testing.assert_close(x.cpu().double(), expected, rtol=0, atol=1e-6)
    assert images.dtype == torch.uint8  # the caller's tensor is untouched


@pytest.mark.slow  # full-size data
@needs_fashion
def test_the_command_with_mnist_on_the_fashion_mnist_folder_ends_in_one_line(tmp_path, cli_in_process):
    code = cli_in_process(
        "data=mnist", f"data.root={tmp_path}/data", f"data.mirrors=[{FASHION}]", f"hydra.run.dir={tmp_path}/run"
    )
    assert "fashion_mnist's, not mnist's" in code and "\n" not in code
    assert idx_files(tmp_path / "data" / "MNIST" / "raw") == [] and not (tmp_path / "run").exists()
