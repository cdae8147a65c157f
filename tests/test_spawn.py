"""mnist_dist.parallel.spawn's forkserver: workers start with torch imported, yet see the caller as it is."""

import json
import os
import sys
from pathlib import Path

from mnist_dist.parallel import spawn


def _report(rank: int, world_size: int, out: str) -> None:
    seen = {
        "preloaded": "torch._dynamo" in sys.modules,  # before this function imported anything
        "probe": os.environ.get("MNIST_DIST_PROBE"),
        "cwd": os.getcwd(),
        "rank": os.environ["RANK"],
    }
    Path(out, f"{rank}.json").write_text(json.dumps(seen))


def reports(out: Path) -> list[dict]:
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(2)]


def test_forkserver_workers_start_with_torch_imported_and_see_the_callers_environment(tmp_path, monkeypatch):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    monkeypatch.setenv("MNIST_DIST_PROBE", "first")
    spawn(_report, 2, str(first), start_method="forkserver")
    # The server may have started above with the first environment; later workers still get the caller's.
    monkeypatch.setenv("MNIST_DIST_PROBE", "second")
    monkeypatch.chdir(second)
    spawn(_report, 2, str(second), start_method="forkserver")
    assert [r["preloaded"] for r in reports(first) + reports(second)] == [True] * 4
    assert [r["probe"] for r in reports(first)] == ["first"] * 2
    assert [r["probe"] for r in reports(second)] == ["second"] * 2
    assert [r["cwd"] for r in reports(second)] == [str(second)] * 2
    assert [r["rank"] for r in reports(second)] == ["0", "1"]
