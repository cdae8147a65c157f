"""Offline bundle: what a GPU machine without network needs beside its own torch, in one folder to carry.

    python -m mnist_dist.tools.offline_bundle [DIR]     # where pip works; DIR defaults to offline/

Fills DIR/wheels with wheels for CPython 3.12 on x86_64 Linux (``--python-version``, ``--platform``) of what
the package needs beyond torch, and setuptools for the editable install; DIR/fashion-mnist with Fashion-MNIST.
docs/gpus.md gives the command that installs from DIR and runs the GPU check. Needs only the standard library.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from mnist_dist.operations import files

FASHION_FILES = [f"{s}-{k}-idx{d}-ubyte.gz" for s in ("train", "t10k") for k, d in (("images", 3), ("labels", 1))]
ANTLR = "antlr4-python3-runtime==4.9.3"  # omegaconf 2.3 pins 4.9.*; the index has no wheel of it
# The bounds of pyproject.toml; setuptools builds the editable install (pip's isolated build env)
WANTED = ["hydra-core>=1.3,<1.4", "omegaconf>=2.3,<2.4", "setuptools>=68"]


def pip(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines() or ["(no output)"]
        raise SystemExit(f"offline_bundle: pip {args[0]} failed: {lines[-1]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", nargs="?", type=Path, default=Path("offline"))
    parser.add_argument("--fashion", type=Path, default=Path("/usr/share/datasets/fashion-mnist"))
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    parser.add_argument("--platform", default="manylinux2014_x86_64", help="for PyYAML, the one compiled wheel")
    args = parser.parse_args()
    missing = [name for name in FASHION_FILES if not (args.fashion / name).is_file()]
    if missing:
        raise SystemExit(f"offline_bundle: {args.fashion} lacks {', '.join(missing)} (--fashion names the folder)")
    wheels, fashion = args.dir / "wheels", args.dir / "fashion-mnist"
    wheels.mkdir(parents=True, exist_ok=True)
    fashion.mkdir(exist_ok=True)
    pip("wheel", "-q", "--no-deps", "-w", str(wheels), ANTLR)  # pure Python: py3-none-any, any Python 3
    target = ["--python-version", args.python_version, "--platform", args.platform, "--only-binary=:all:"]
    pip("download", "-q", "-d", str(wheels), "--find-links", str(wheels), *target, ANTLR, *WANTED)
    for name in FASHION_FILES:
        files.write(fashion / name, (args.fashion / name).read_bytes())  # atomic: no file cut short looks whole
    for path in sorted(wheels.iterdir()) + [fashion / name for name in FASHION_FILES]:
        print(f"{path}  {path.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
