"""One file from one source (an http(s) URL, a file:// URL or a folder) into the data root, for `prepare`.

The root may be shared and the network slow or hostile, so a fetch is bounded in bytes and in time,
keeps https as https, never writes through a link planted in the root, and leaves nothing under the
final name unless the caller's validation passed. A record beside raw/ says which files it wrote, the
only ones `prepare` may replace.
"""

import gzip
import hashlib
import json
import logging
import os
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlparse
from urllib.request import url2pathname

from mnist_dist.operations import files
from mnist_dist.operations.errors import DataError

log = logging.getLogger(__name__)

_FETCHED = ".fetched.json"  # beside raw/: the files prepare wrote (by inode); only those it may replace
_RECORD_LIMIT = 1 << 16  # bytes of the record read at most: four names and inodes need a hundred
_TIMEOUT_S = 60  # per network read
# A whole download: a mirror that trickles is given up for the next one. MNIST's largest .gz is 9.9 MB,
# so this asks for 17 kB/s on average.
_DEADLINE_S = 600
_PROGRESS_S = 5  # seconds between the progress lines of a download


@contextmanager
def fetch_file(source: str, gz_name: str, md5: str | None, dest: Path, limit: int) -> Iterator[Path]:
    """Yield a temp path beside ``dest`` holding ``gz_name`` from ``source``, decompressed, refused past
    ``limit`` bytes. It replaces ``dest``, which is then recorded as fetched, only if the body (the
    caller's validation) succeeds. ``md5``: official mirrors only (other copies are recompressed)."""
    with _local_path(source, gz_name, md5, dest.parent, limit) as src, files.atomic(dest) as out:
        opener = gzip.open if src.suffix == ".gz" else open
        with opener(src, "rb") as fin:
            for chunk in _at_most(lambda: fin.read(1 << 20), limit):
                out.file.write(chunk)
        out.file.flush()
        yield out.path
    root = dest.parent.parent
    files.write_text(root / _FETCHED, json.dumps({**_fetched_record(root), dest.name: dest.stat().st_ino}))


def fetched_here(dest: Path) -> bool:
    """Whether ``dest`` is the very file a fetch wrote (the same inode), so that it may be replaced."""
    try:
        return _fetched_record(dest.parent.parent).get(dest.name) == dest.stat().st_ino
    except OSError:
        return False


def _at_most(read: Callable[[], bytes], limit: int) -> Iterator[bytes]:
    """What ``read()`` returns until it returns nothing, stopping with a DataError past ``limit`` bytes in
    all: a small .gz can expand without bound, and a server can send more than it announced."""
    total = 0
    while chunk := read():
        total += len(chunk)
        if total > limit:
            raise DataError(f"larger than {limit} bytes, the largest valid size; not an MNIST file")
        yield chunk


def _fetched_record(root: Path) -> dict:
    """What prepare wrote under ``root`` (a link planted in place of the record counts as no record)."""
    try:
        with os.fdopen(files.open_regular(root / _FETCHED, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
            fetched = json.loads(f.read(_RECORD_LIMIT))
    except (OSError, ValueError):
        return {}
    return fetched if isinstance(fetched, dict) else {}


@contextmanager
def _local_path(source: str, gz_name: str, md5: str | None, raw: Path, limit: int) -> Iterator[Path]:
    """Yield a local path to gz_name (or, from a local dir, its decompressed twin) at `source`."""
    if source.startswith(("http://", "https://")):
        download = files.create_new(raw, f"download-{gz_name}", ".gz")  # a scratch file, never renamed into place
        try:
            # A .gz is never much larger than the ``limit`` bytes it decompresses to.
            with download.file as out:
                _download(f"{source.rstrip('/')}/{gz_name}", out, limit + (1 << 20))
            if md5 and hashlib.md5(download.path.read_bytes()).hexdigest() != md5:
                raise DataError(f"md5 mismatch, expected {md5}: corrupt download")
            yield download.path
        finally:
            download.path.unlink(missing_ok=True)
        return
    local = url2pathname(urlparse(source).path) if source.startswith("file://") else source
    folder = Path(local).expanduser()
    for candidate in (folder / gz_name, folder / gz_name.removesuffix(".gz")):
        if candidate.is_file():
            yield candidate
            return
    raise DataError("missing")


class _NoDowngrade(urllib.request.HTTPRedirectHandler):
    """Follows redirects, but not from https to plain http (nor to file:// and the like)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urlparse(newurl).scheme != "https" and (req.full_url.startswith("https:") or not newurl.startswith("http:")):
            raise DataError(f"refused a redirect from {req.full_url} to {newurl}")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _download(url: str, out: BinaryIO, limit: int) -> None:
    """``url`` into ``out``, refusing more than ``limit`` bytes (announced or received) and more than
    ``_DEADLINE_S`` seconds; a progress line every ``_PROGRESS_S`` seconds."""
    opener = urllib.request.build_opener(_NoDowngrade)
    with opener.open(url, timeout=_TIMEOUT_S) as response:
        announced = int(response.headers.get("Content-Length") or 0)
        if announced > limit:
            raise DataError(f"{announced} bytes announced, more than {limit}, the largest valid size")
        of = f" of {announced}" if announced else ""
        started = shown = time.monotonic()
        received = 0
        # read1: whatever has arrived, so that a trickle is noticed; read(n) would wait for all n bytes.
        for chunk in _at_most(lambda: response.read1(1 << 16), limit):
            received += len(chunk)
            out.write(chunk)
            now = time.monotonic()
            if now - started > _DEADLINE_S:
                raise DataError(f"too slow: {received} bytes{of} in {_DEADLINE_S:g} s, the most one file may take")
            if now - shown >= _PROGRESS_S:
                rate = received / (now - started) / 1000
                log.info("%s: %d%s bytes from %s (%.1f kB/s)", url.rsplit("/", 1)[-1], received, of, url, rate)
                shown = now
