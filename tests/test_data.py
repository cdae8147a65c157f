"""Tests for mnist_dist.data and mnist_dist.operations.fetch: tiny IDX files written here, served from local dirs and
loopback HTTP."""

import functools
import gzip
import hashlib
import http.server
import logging
import os
import socket
import struct
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torchvision

from mnist_dist import data
from mnist_dist.operations import fetch
from mnist_dist.operations.errors import DataError

NAMES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
DEBIAN = Path("/usr/share/datasets/fashion-mnist")


def images_idx(n: int, seed: int = 0, magic: int = 0x803) -> bytes:
    return struct.pack(">IIII", magic, n, 28, 28) + bytes((i * 31 + seed) % 256 for i in range(n * 784))


def labels_idx(n: int, magic: int = 0x801, last: int | None = None) -> bytes:
    labels = bytearray(i % 10 for i in range(n))
    if last is not None:
        labels[-1] = last
    return struct.pack(">II", magic, n) + labels


def idx_set(n_train: int = 20, n_test: int = 10) -> dict[str, bytes]:
    """Decompressed content of a valid four-file set, keyed by file name."""
    contents = [images_idx(n_train, 1), labels_idx(n_train), images_idx(n_test, 2), labels_idx(n_test)]
    return dict(zip(NAMES, contents))


def write_set(folder: Path, files: dict[str, bytes], gz: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        if gz:
            (folder / f"{name}.gz").write_bytes(gzip.compress(content))
        else:
            (folder / name).write_bytes(content)
    return folder


def assert_raw_holds(raw: Path, files: dict[str, bytes], extra: set[str] = frozenset()) -> None:
    """Exactly the four files (plus `extra`) with this content: no temp files left behind."""
    assert {p.name for p in raw.iterdir()} == set(files) | extra
    for name, content in files.items():
        assert (raw / name).read_bytes() == content, name


def fetched_from(caplog) -> dict[str, str]:
    """File name -> source, from the info lines prepare logs per fetched file."""
    out = {}
    for r in caplog.records:
        if r.levelno == logging.INFO and r.name == "mnist_dist.data":
            _, file, source = r.args
            out[file] = source
    return out


@pytest.fixture
def serve():
    """serve(dir, delay) -> base URL of a loopback HTTP server for that dir; all stopped at teardown."""
    servers = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        delay = 0.0

        def do_GET(self):
            time.sleep(self.delay)
            super().do_GET()

        def log_message(self, *args):
            pass

    class Server(http.server.ThreadingHTTPServer):
        def handle_error(self, request, client_address):
            pass  # a client that gave up mid-file (a test of timeouts): not worth a traceback in the output

    def start(folder: Path, delay: float = 0.0) -> str:
        handler = type("Slow", (Handler,), {"delay": delay})
        handler = functools.partial(handler, directory=str(folder))
        server = Server(("127.0.0.1", 0), handler)
        thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
        thread.start()
        servers.append((server, thread))
        return f"http://127.0.0.1:{server.server_address[1]}/"

    yield start
    for server, thread in servers:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture(autouse=True)
def info_logs(caplog):
    caplog.set_level(logging.INFO, logger="mnist_dist.data")
    caplog.set_level(logging.INFO, logger="mnist_dist.operations.fetch")  # a download's progress lines


# --- validation -------------------------------------------------------------------------------


def test_valid_set_in_raw_needs_no_mirrors(tmp_path):
    files = idx_set()
    write_set(tmp_path / "MNIST" / "raw", files, gz=False)
    raw = data.prepare("mnist", tmp_path, mirrors=[])  # no mirrors: nothing could have been fetched
    assert raw == tmp_path / "MNIST" / "raw"
    assert_raw_holds(raw, files)


@pytest.mark.parametrize(
    "name, content, problem",
    [
        ("train-images-idx3-ubyte", images_idx(20)[:-100], "15596 bytes, expected 15696 for 20 items (truncated?)"),
        ("train-images-idx3-ubyte", images_idx(20)[:10], "10 bytes, too short for an IDX header"),
        ("t10k-labels-idx1-ubyte", labels_idx(10, magic=0x803), "magic 0x00000803, expected 0x00000801"),
        ("t10k-labels-idx1-ubyte", labels_idx(10, last=10), "label 10 out of range 0..9"),
        (
            "t10k-images-idx3-ubyte",
            images_idx(10)[:8] + struct.pack(">II", 32, 32) + images_idx(10)[16:],
            "images are 32x32, expected 28x28",
        ),
    ],
)
def test_invalid_file_of_the_user_is_named_and_kept(tmp_path, name, content, problem):
    files = {**idx_set(), name: content}
    raw = write_set(tmp_path / "MNIST" / "raw", files, gz=False)
    mirror = write_set(tmp_path / "mirror", idx_set())
    for mirrors in ([], [str(mirror)]):  # a mirror is no reason to delete the user's copy either
        with pytest.raises(DataError) as e:
            data.prepare("mnist", tmp_path, mirrors)
        assert str(e.value) == (
            f"{raw / name} is invalid ({problem}); mnist_dist did not write it, so it is left alone: fix it, "
            "or move it away to have it fetched again"
        )
        assert_raw_holds(raw, files)


def test_invalid_file_that_prepare_wrote_is_fetched_again(tmp_path, caplog):
    files = idx_set()
    mirror = write_set(tmp_path / "mirror", files)
    raw = data.prepare("mnist", tmp_path, [str(mirror)])
    with open(raw / "train-labels-idx1-ubyte", "r+b") as f:  # damaged in place: still the file prepare wrote
        f.write(b"junk")
    caplog.clear()
    data.prepare("mnist", tmp_path, [str(mirror)])
    assert_raw_holds(raw, files)
    assert fetched_from(caplog) == {"train-labels-idx1-ubyte": str(mirror)}
    assert any(f"{raw / 'train-labels-idx1-ubyte'} is invalid" in r.getMessage() for r in caplog.records)


def test_a_read_only_root_with_valid_files_works(tmp_path):
    files = idx_set()
    raw = write_set(tmp_path / "MNIST" / "raw", files, gz=False)
    # Root writes through file permissions: a read-only bind mount is read-only for everyone.
    if subprocess.run(["mount", "--bind", "-o", "ro", str(tmp_path), str(tmp_path)], capture_output=True).returncode:
        pytest.skip("cannot mount a read-only directory here (needs root)")
    try:
        with pytest.raises(OSError):
            (tmp_path / "probe").touch()
        assert data.prepare("mnist", tmp_path, mirrors=[]) == raw
    finally:
        subprocess.run(["umount", str(tmp_path)], check=True)
    assert_raw_holds(raw, files)


def test_a_symlink_loop_in_raw_is_named(tmp_path):
    raw = write_set(tmp_path / "MNIST" / "raw", idx_set(), gz=False)
    (raw / "train-images-idx3-ubyte").unlink()
    (raw / "train-images-idx3-ubyte").symlink_to("train-images-idx3-ubyte")
    with pytest.raises(DataError) as e:
        data.prepare("mnist", tmp_path, mirrors=[])
    assert str(e.value) == (
        f"{raw}/train-images-idx3-ubyte is invalid (OSError: Too many levels of symbolic links); mnist_dist did "
        "not write it, so it is left alone: fix it, or move it away to have it fetched again"
    )
    assert (raw / "train-images-idx3-ubyte").is_symlink()


def test_decompression_stops_at_the_largest_valid_size(tmp_path):
    bomb = gzip.compress(bytes(60_008 + 1), compresslevel=9)  # a labels file one byte over the limit
    mirror = write_set(tmp_path / "mirror", idx_set())
    (mirror / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(bytes(10_008 + 1)))
    (mirror / "train-labels-idx1-ubyte.gz").write_bytes(bomb)
    with pytest.raises(DataError) as e:
        data.prepare("mnist", tmp_path / "root", [str(mirror)])
    assert f"tried {mirror} (larger than 60008 bytes, the largest valid size; not an MNIST file)" in str(e.value)


def test_a_download_stops_at_the_largest_valid_size(tmp_path, serve):
    site = write_set(tmp_path / "site", idx_set())
    (site / "train-labels-idx1-ubyte.gz").write_bytes(bytes(60_008 + (1 << 20) + 1))
    url = serve(site)
    with pytest.raises(DataError) as e:
        data.prepare("mnist", tmp_path / "root", [url])
    assert f"tried {url} ({60_008 + (1 << 20) + 1} bytes announced, more than {60_008 + (1 << 20)}, the largest" in str(
        e.value
    )


def test_mismatched_counts(tmp_path):
    write_set(tmp_path / "MNIST" / "raw", {**idx_set(), "train-labels-idx1-ubyte": labels_idx(19)}, gz=False)
    with pytest.raises(
        DataError, match="train-images-idx3-ubyte holds 20 images but train-labels-idx1-ubyte holds 19 labels"
    ):
        data.prepare("mnist", tmp_path, mirrors=[])


def test_nonstandard_counts_warn_once_per_split(tmp_path, caplog):
    write_set(tmp_path / "MNIST" / "raw", idx_set(), gz=False)
    data.prepare("mnist", tmp_path, mirrors=[])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "mnist train split has 20 examples, not the standard 60000 (a subset?)",
        "mnist t10k split has 10 examples, not the standard 10000 (a subset?)",
    ]


# --- local sources ----------------------------------------------------------------------------


@pytest.mark.parametrize("as_url", [False, True], ids=["dir", "file-url"])
def test_prepare_from_local_dir(tmp_path, caplog, as_url):
    files = idx_set()
    mirror = write_set(tmp_path / "mirror", files)
    source = mirror.as_uri() if as_url else str(mirror)
    raw = data.prepare("fashion_mnist", tmp_path / "root", [str(tmp_path / "absent"), source])
    assert raw == tmp_path / "root" / "FashionMNIST" / "raw"
    assert_raw_holds(raw, files)
    assert fetched_from(caplog) == dict.fromkeys(NAMES, source)

    caplog.clear()  # a second run finds everything in place and fetches nothing
    assert data.prepare("fashion_mnist", tmp_path / "root", [source]) == raw
    assert fetched_from(caplog) == {}
    assert_raw_holds(raw, files)


def test_prepare_from_local_dir_of_decompressed_files(tmp_path):
    files = idx_set()
    mirror = write_set(tmp_path / "mirror", files, gz=False)
    assert_raw_holds(data.prepare("mnist", tmp_path, [str(mirror)]), files)


def test_prepare_from_gz_in_raw(tmp_path, caplog):
    files = idx_set()
    raw = write_set(tmp_path / "MNIST" / "raw", files)
    assert data.prepare("mnist", tmp_path, mirrors=[]) == raw
    assert_raw_holds(raw, files, extra={f"{n}.gz" for n in NAMES})
    assert fetched_from(caplog) == dict.fromkeys(NAMES, str(raw))


def test_bad_gz_in_raw_is_kept_and_mirror_used(tmp_path, caplog):
    files = idx_set()
    raw = write_set(tmp_path / "MNIST" / "raw", {"t10k-images-idx3-ubyte": images_idx(10)[:-1]})
    mirror = write_set(tmp_path / "mirror", files)
    data.prepare("mnist", tmp_path, [str(mirror)])
    assert_raw_holds(raw, files, extra={"t10k-images-idx3-ubyte.gz"})  # the user's, left alone
    assert fetched_from(caplog) == dict.fromkeys(NAMES, str(mirror))


# --- HTTP -------------------------------------------------------------------------------------


def test_prepare_over_http(tmp_path, serve, caplog):
    files = idx_set()
    url = serve(write_set(tmp_path / "site", files)).rstrip("/")  # no trailing slash: joined anyway
    raw = data.prepare("mnist", tmp_path / "root", [url])
    assert_raw_holds(raw, files)
    assert fetched_from(caplog) == dict.fromkeys(NAMES, url)


CORRUPTIONS = {
    "truncated-gz": lambda: gzip.compress(images_idx(20, 1))[:-200],
    "truncated-idx": lambda: gzip.compress(images_idx(20, 1)[:-1]),
}


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_corrupt_mirror_is_skipped(tmp_path, serve, caplog, corrupt):
    files = idx_set()
    bad_site = write_set(tmp_path / "bad", files)
    (bad_site / "train-images-idx3-ubyte.gz").write_bytes(corrupt())
    bad, good = serve(bad_site), serve(write_set(tmp_path / "good", files))
    raw = data.prepare("mnist", tmp_path / "root", [bad, good])
    assert_raw_holds(raw, files)
    assert fetched_from(caplog) == {**dict.fromkeys(NAMES, bad), "train-images-idx3-ubyte": good}


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_only_mirror_corrupt(tmp_path, serve, corrupt):
    site = write_set(tmp_path / "bad", idx_set())
    (site / "train-images-idx3-ubyte.gz").write_bytes(corrupt())
    url = serve(site)
    with pytest.raises(DataError, match=f"could not get train-images-idx3-ubyte.gz for mnist: tried {url} "):
        data.prepare("mnist", tmp_path / "root", [url])
    raw = tmp_path / "root" / "MNIST" / "raw"
    assert list(raw.iterdir()) == []  # neither the bad file nor a temp file is left


def test_official_mirror_md5_is_enforced(tmp_path, serve, caplog, monkeypatch):
    files = idx_set()
    official = serve(write_set(tmp_path / "official", files))
    other = serve(tmp_path / "official")  # same bytes, not official: content validation suffices
    monkeypatch.setattr(torchvision.datasets.FashionMNIST, "mirrors", [official])

    with pytest.raises(DataError, match=f"tried {official} \\(md5 mismatch, expected 8d4fb7e6"):
        data.prepare("fashion_mnist", tmp_path / "a", [official])
    assert_raw_holds(data.prepare("fashion_mnist", tmp_path / "b", [official, other]), files)
    assert fetched_from(caplog) == dict.fromkeys(NAMES, other)

    # and the same official mirror is accepted once the md5s match
    md5s = [(f"{n}.gz", hashlib.md5((tmp_path / "official" / f"{n}.gz").read_bytes()).hexdigest()) for n in NAMES]
    monkeypatch.setattr(torchvision.datasets.FashionMNIST, "resources", md5s)
    assert_raw_holds(data.prepare("fashion_mnist", tmp_path / "c", [official]), files)


def test_offline_error_is_one_helpful_line(tmp_path):
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url, missing = f"http://127.0.0.1:{port}/", str(tmp_path / "nowhere")
    with pytest.raises(DataError) as e:
        data.prepare("fashion_mnist", tmp_path, [url, missing])
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"could not get train-images-idx3-ubyte.gz for fashion_mnist: tried {url} (URLError: ")
    assert f", {missing} (missing). Put the four IDX files in {tmp_path / 'FashionMNIST' / 'raw'}" in msg
    assert "data.mirrors=[/usr/share/datasets/fashion-mnist]" in msg


# --- loading ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]
        ),
    ],
)
def test_load_split_and_to_device(tmp_path, device):
    files = idx_set()
    raw = data.prepare("mnist", tmp_path, [str(write_set(tmp_path / "mirror", files))])
    images, labels = data.load_split(raw, train=False)
    assert images.shape == (10, 28, 28) and images.dtype == torch.uint8
    assert labels.tolist() == list(range(10)) and labels.dtype == torch.int64
    assert images.flatten().tolist() == list(files["t10k-images-idx3-ubyte"][16:])
    assert data.load_split(raw, train=True)[0].shape == (20, 28, 28)

    x, y = data.to_device_tensors(images, labels, mean=0.5, std=0.25, device=device)
    assert x.shape == (10, 1, 28, 28) and x.dtype == torch.float32 and x.device.type == device
    assert y.dtype == torch.int64 and y.device.type == device and y.tolist() == labels.tolist()
    expected = (images.unsqueeze(1).double() / 255 - 0.5) / 0.25
    torch.testing.assert_close(x.cpu().double(), expected, rtol=0, atol=1e-6)
    assert images.dtype == torch.uint8  # the caller's tensor is untouched


@pytest.mark.skipif(not DEBIAN.is_dir(), reason="Debian's dataset-fashion-mnist is not installed")
def test_real_fashion_mnist_from_debian(tmp_path, caplog):
    raw = data.prepare("fashion_mnist", tmp_path, [str(DEBIAN)])  # md5s differ from upstream: content counts
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    for train, n in ((True, 60_000), (False, 10_000)):
        images, labels = data.load_split(raw, train)
        assert images.shape == (n, 28, 28)
        assert labels.unique().tolist() == list(range(10))


def test_concurrent_prepares_fetch_once(tmp_path, serve, caplog):
    files = idx_set()
    mirror = serve(write_set(tmp_path / "mirror", files), delay=0.05)  # slow, so unlocked runs would overlap
    with ThreadPoolExecutor(2) as pool:
        raws = list(pool.map(lambda _: data.prepare("mnist", tmp_path / "root", [mirror]), range(2)))
    assert raws == [tmp_path / "root" / "MNIST" / "raw"] * 2
    assert_raw_holds(raws[0], files)
    fetches = [r for r in caplog.records if r.levelno == logging.INFO and r.name == "mnist_dist.data"]
    assert len(fetches) == 4  # the lock made the second prepare find the files ready


# --- names ------------------------------------------------------------------------------------


def test_dataset_names_and_official_mirrors():
    assert data.dataset_class("mnist") is torchvision.datasets.MNIST
    assert data.dataset_class("fashion_mnist") is torchvision.datasets.FashionMNIST
    assert data.official_mirrors("mnist") == ["https://ossci-datasets.s3.amazonaws.com/mnist/"]
    assert data.official_mirrors("fashion_mnist") == [
        "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/"
    ]
    with pytest.raises(DataError, match="unknown dataset 'cifar'; valid names: mnist, fashion_mnist"):
        data.dataset_class("cifar")


def test_offline_mnist_names_the_fashion_mnist_package_route(tmp_path):
    with pytest.raises(DataError) as error:
        data.prepare("mnist", tmp_path / "root", [])
    assert str(error.value).endswith(
        "; or train offline on Fashion-MNIST: apt-get install dataset-fashion-mnist, then "
        "data=fashion_mnist 'data.mirrors=[/usr/share/datasets/fashion-mnist]'"
    )


# --- a shared root (issue 27): planted links, the umask, slow mirrors, an empty split ---------


def plant(link: Path, victim: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    victim.write_bytes(b"another user's file")
    link.symlink_to(victim)


@pytest.mark.parametrize("planted", [".train-images-idx3-ubyte.part", ".t10k-labels-idx1-ubyte.part"])
def test_a_link_planted_at_a_temp_name_is_not_followed(tmp_path, planted):
    files = idx_set()
    raw, victim = tmp_path / "root" / "MNIST" / "raw", tmp_path / "victim"
    plant(raw / planted, victim)
    data.prepare("mnist", tmp_path / "root", [str(write_set(tmp_path / "mirror", files))])
    assert victim.read_bytes() == b"another user's file"
    assert not any((raw / name).is_symlink() for name in NAMES)
    assert {name: (raw / name).read_bytes() for name in NAMES} == files


def test_a_link_planted_at_the_download_name_is_not_followed(tmp_path, serve):
    files = idx_set()
    raw, victim = tmp_path / "root" / "MNIST" / "raw", tmp_path / "victim"
    plant(raw / ".download-train-labels-idx1-ubyte.gz", victim)
    data.prepare("mnist", tmp_path / "root", [serve(write_set(tmp_path / "site", files))])
    assert victim.read_bytes() == b"another user's file"
    assert {name: (raw / name).read_bytes() for name in NAMES} == files


def test_a_link_planted_at_the_record_is_not_followed(tmp_path):
    files = idx_set()
    root, victim = tmp_path / "root", tmp_path / "victim"
    plant(root / "MNIST" / ".fetched.json", victim)
    raw = data.prepare("mnist", root, [str(write_set(tmp_path / "mirror", files))])
    assert victim.read_bytes() == b"another user's file"
    assert not (root / "MNIST" / ".fetched.json").is_symlink()
    assert fetch.fetched_here(raw / "train-images-idx3-ubyte")  # the record is prepare's own again


def test_files_prepare_writes_follow_the_umask(tmp_path, serve):
    previous = os.umask(0o027)
    try:
        raw = data.prepare("mnist", tmp_path / "root", [serve(write_set(tmp_path / "site", idx_set()))])
    finally:
        os.umask(previous)
    written = [raw / name for name in NAMES] + [raw.parent / ".fetched.json"]
    assert {path.name: oct(path.stat().st_mode & 0o777) for path in written} == {path.name: "0o640" for path in written}


@pytest.fixture
def trickle():
    """trickle(size) -> a loopback URL whose server announces ``size`` bytes and sends one every 50 ms
    (bounded: at most ``size`` bytes, and it stops when the client hangs up)."""
    servers = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(self.server.size))
            self.end_headers()
            try:
                for _ in range(self.server.size):
                    self.wfile.write(b"\0")
                    self.wfile.flush()
                    time.sleep(0.05)
            except OSError:  # the client gave up: what the test wants
                pass

        def log_message(self, *args):
            pass

    def start(size: int) -> str:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.size, server.daemon_threads = size, True
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_a_trickling_mirror_is_given_up_with_progress_shown(tmp_path, trickle, caplog, monkeypatch):
    monkeypatch.setattr(fetch, "_DEADLINE_S", 1.5)
    monkeypatch.setattr(fetch, "_PROGRESS_S", 0.5)
    url = trickle(1200)  # a minute at 50 ms a byte: far past the deadline
    with pytest.raises(DataError) as error:
        data.prepare("mnist", tmp_path / "root", [url])
    assert f"tried {url} (too slow: " in str(error.value)
    assert "bytes of 1200 in 1.5 s, the most one file may take)" in str(error.value)
    progress = [r.getMessage() for r in caplog.records if "train-images-idx3-ubyte.gz: " in r.getMessage()]
    assert progress and all(" of 1200 bytes from " in line for line in progress), progress
    assert [p.name for p in (tmp_path / "root" / "MNIST" / "raw").iterdir()] == []


@pytest.mark.parametrize("prefix", ["train", "t10k"])
def test_an_empty_split_is_one_line(tmp_path, prefix):
    files = {**idx_set(), f"{prefix}-images-idx3-ubyte": images_idx(0), f"{prefix}-labels-idx1-ubyte": labels_idx(0)}
    raw = write_set(tmp_path / "MNIST" / "raw", files, gz=False)
    with pytest.raises(DataError) as error:
        data.prepare("mnist", tmp_path, mirrors=[])
    assert str(error.value) == (
        f"{raw}/{prefix}-images-idx3-ubyte and {prefix}-labels-idx1-ubyte hold no examples: put the full "
        "files there, or delete both to fetch them again"
    )
