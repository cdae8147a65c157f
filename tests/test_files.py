"""files.atomic, through which checkpoints, results and downloaded data are written: whole or not at all."""

import pytest

from mnist_dist.operations import files


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "results.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), files.atomic(target) as out:
        out.file.write(b"half")
        raise RuntimeError("killed")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]
