"""Puts the tables that bench and compare wrote into the docs, verbatim, so the two cannot drift.

    python -m mnist_dist.tools.docs_numbers --bench outputs/bench/<time> --compare outputs/compare/<date>/<time>
    python -m mnist_dist.tools.docs_numbers --tta outputs/bench/<time>    # bench --time-to-accuracy's tta.md
    python -m mnist_dist.tools.docs_numbers --sweep outputs/bench/<time>  # bench --bucket-sweep's sweep.md
    python -m mnist_dist.tools.docs_numbers --ablation outputs/bench/<time>  # bench --ablation's ablation.md

A page (README.md or any docs/*.md) marks a block with ``<!-- begin bench.md -->`` ... ``<!-- end bench.md -->``
(and the same for compare.md, tta.md, sweep.md and ablation.md); everything between the two markers is
replaced by that file, wherever the markers are, and the run's chart (bench.png, compare.png, tta.png,
sweep.png; ablation.md has none) is copied to docs/ (tta.png as docs/time-to-accuracy.png, sweep.png as
docs/bucket-sweep.png).
Measure on an idle machine: compare warns when it was not.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from mnist_dist.operations import files

ROOT = Path(__file__).resolve().parents[2]  # the repository: README.md and docs/
# A chart's name in docs/ where it is not the run's.
DOCS_CHARTS = {"sweep": "bucket-sweep.png", "tta": "time-to-accuracy.png"}


def embed(text: str, name: str, block: str) -> str:
    """``text`` with what lies between ``name``'s begin and end markers replaced by ``block``; ValueError
    if ``text`` has no such block."""
    pattern = re.compile(rf"(<!-- begin {re.escape(name)} -->\n).*?(<!-- end {re.escape(name)} -->)", re.S)
    if not pattern.search(text):
        raise ValueError(f"no '<!-- begin {name} -->' ... '<!-- end {name} -->' block")
    return pattern.sub(lambda match: match.group(1) + block.rstrip("\n") + "\n" + match.group(2), text, count=1)


def pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", type=Path, help="a directory bench wrote (bench.md, bench.png)")
    parser.add_argument("--compare", type=Path, help="a directory compare wrote (compare.md, compare.png)")
    parser.add_argument("--tta", type=Path, help="a directory bench --time-to-accuracy wrote (tta.md)")
    parser.add_argument("--sweep", type=Path, help="a directory bench --bucket-sweep wrote (sweep.md, sweep.png)")
    parser.add_argument("--ablation", type=Path, help="a directory bench --ablation wrote (ablation.md)")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (README.md, docs/)")
    args = parser.parse_args(argv)
    texts = {page: page.read_text() for page in pages(args.root) if page.exists()}
    for name in ("bench", "compare", "tta", "sweep", "ablation"):
        directory = getattr(args, name)
        if directory is None:
            continue
        table = directory / f"{name}.md"
        if not table.exists():
            sys.exit(f"error: {table} does not exist; pass the directory {name} wrote")
        marked = [page for page, text in texts.items() if f"<!-- begin {name}.md -->" in text]
        if not marked:
            sys.exit(f"error: no page under {args.root} has a '<!-- begin {name}.md -->' block")
        for page in marked:
            texts[page] = embed(texts[page], f"{name}.md", table.read_text())
        chart = directory / f"{name}.png"
        if chart.exists():
            files.write(args.root / "docs" / DOCS_CHARTS.get(name, f"{name}.png"), chart.read_bytes())
    for page, text in texts.items():
        if page.read_text() != text:
            files.write_text(page, text)
            print(f"updated {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
