"""Puts the numbers that bench and compare wrote into README.md, verbatim, so the two cannot drift.

    python -m mnist_dist.readme_numbers --bench outputs/bench/<time> --compare outputs/compare/<date>/<time>
    python -m mnist_dist.readme_numbers --tta outputs/bench/<time>    # bench --time-to-accuracy's tta.md

README.md marks each block with ``<!-- begin bench.md -->`` ... ``<!-- end bench.md -->`` (and the same
for compare.md); everything between the two markers is replaced by that file, and the run's chart
(bench.png, compare.png; tta.md has none) is copied to docs/. Measure on an idle machine: compare warns when it was not.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def embed(readme: str, name: str, block: str) -> str:
    """``readme`` with the text between ``name``'s begin and end markers replaced by ``block``."""
    pattern = re.compile(rf"(<!-- begin {re.escape(name)} -->\n).*?(<!-- end {re.escape(name)} -->)", re.S)
    if not pattern.search(readme):
        raise ValueError(f"README.md has no '<!-- begin {name} -->' ... '<!-- end {name} -->' block")
    return pattern.sub(lambda match: match.group(1) + block.rstrip("\n") + "\n" + match.group(2), readme, count=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", type=Path, help="a directory bench wrote (bench.md, bench.png)")
    parser.add_argument("--compare", type=Path, help="a directory compare wrote (compare.md, compare.png)")
    parser.add_argument("--tta", type=Path, help="a directory bench --time-to-accuracy wrote (tta.md)")
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args(argv)
    text = args.readme.read_text()
    for name, directory in (("bench", args.bench), ("compare", args.compare), ("tta", args.tta)):
        if directory is None:
            continue
        if not (directory / f"{name}.md").exists():
            sys.exit(f"error: {directory / f'{name}.md'} does not exist; pass the directory {name} wrote")
        try:
            text = embed(text, f"{name}.md", (directory / f"{name}.md").read_text())
        except ValueError as error:
            sys.exit(f"error: {error}")
        if (directory / f"{name}.png").exists():
            shutil.copyfile(directory / f"{name}.png", args.readme.parent / "docs" / f"{name}.png")
    args.readme.write_text(text)
    print(f"updated {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
