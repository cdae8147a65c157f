"""Issue 38: one atomic-write primitive for every file written whole (mnist_dist/operations/files.py). Each test
failed on commit ee05943."""

import re
from pathlib import Path

import pytest

import mnist_dist
from mnist_dist.operations import files

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


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "results.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), files.atomic(target) as out:
        out.file.write(b"half")
        raise RuntimeError("killed")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]
