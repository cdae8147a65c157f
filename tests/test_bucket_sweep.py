"""The bucket-size sweep: MB to our DDP's elements, its arithmetic and table on made-up runs, and a tiny run."""

import json
import subprocess
import sys

import pytest
from helpers import HANG_S, assert_machine_fields

from mnist_dist.tools.bucket_sweep import SIZES_MB, chart, markdown, overrides, parse_sizes, report

INFO = {"cpu": "AMD EPYC", "cpu_flags": [], "cpu_capability": "AVX2", "cores": 2, "torch_threads": 1}
INFO.update(memory_gib=23.5, torch="2.14.1", gpus=0)
SETTINGS = {"device": "cpu", "gpus": 2, "batch": 64, "steps": 100, "warmup": 10, "repeats": 2}


def test_a_size_in_mb_is_both_ddps_bucket_cap():
    assert overrides("ddp", 0.25) == ["mode=ddp", "mode.bucket_cap_mb=0.25"]
    assert overrides("torch_ddp", 0.25) == ["mode=torch_ddp", "mode.bucket_cap_mb=0.25"]


def test_sizes_are_parsed_or_refused():
    assert parse_sizes(None) == list(SIZES_MB) == [0.05, 0.25, 1, 4, 25]
    assert parse_sizes("0.25,4") == [0.25, 4.0]
    for wrong in ("0.25,four", "0,4"):
        with pytest.raises(SystemExit, match="--sizes"):
            parse_sizes(wrong)


def sample(size, ddp, round_, speed, compute, comm, overlap):
    counters = {"backward_compute": compute, "backward_comm": comm, "backward_overlap": overlap}
    return {"size_mb": size, "ddp": ddp, "round": round_, "images_per_s": speed, "ddp_backward_ms": counters}


# Two sizes, two rounds each; at batch 64 a step of 640 images/s is 100 ms.
SAMPLES = [
    sample(0.25, "ddp", 0, 640.0, 50.0, 20.0, 10.0),  # exposed 10 ms of 100: 10 %
    sample(0.25, "torch_ddp", 0, 320.0, 60.0, 30.0, 30.0),  # all hidden
    sample(4.0, "ddp", 0, 640.0, 50.0, 10.0, 10.0),
    sample(4.0, "torch_ddp", 0, 640.0, 50.0, 10.0, 2.0),  # exposed 8 ms of 100
    sample(0.25, "ddp", 1, 800.0, 40.0, 16.0, 12.0),  # exposed 4 ms of 80: 5 %
    sample(0.25, "torch_ddp", 1, 400.0, 60.0, 30.0, 26.0),  # exposed 4 ms of 160: 2.5 %
    sample(4.0, "ddp", 1, 480.0, 50.0, 10.0, 10.0),
    sample(4.0, "torch_ddp", 1, 320.0, 50.0, 10.0, 2.0),  # exposed 8 ms of 200: 4 %
]


def test_rows_are_medians_per_size_and_ddp_with_exposed_communication(tmp_path):
    rows = report(SAMPLES, batch=64)
    assert [(row["size_mb"], row["ddp"]) for row in rows] == [
        (0.25, "ddp"),
        (0.25, "torch_ddp"),
        (4.0, "ddp"),
        (4.0, "torch_ddp"),
    ]
    ddp, torch_ddp = rows[0], rows[1]
    assert (ddp["median"], ddp["min"], ddp["max"], ddp["n"]) == (720.0, 640.0, 800.0, 2)
    assert ddp["counters_ms"] == {"backward_compute": 45.0, "backward_comm": 18.0, "backward_overlap": 11.0}
    assert ddp["exposed_ms"] == pytest.approx(7.0) and ddp["exposed_share"] == pytest.approx(0.075)
    assert ddp["vs_torch_ddp"]["median"] == pytest.approx(2.0)  # each round's ddp over the torch_ddp beside it
    assert torch_ddp["exposed_ms"] == pytest.approx(2.0) and torch_ddp["exposed_share"] == pytest.approx(0.0125)
    assert "vs_torch_ddp" not in torch_ddp
    assert rows[2]["vs_torch_ddp"] == {"median": 1.25, "min": 1.0, "max": 1.5, "n": 2}  # 640/640, 480/320
    json.dumps(rows)  # sweep.json holds them

    table = markdown(rows, SETTINGS, INFO, "0.50 0.40 0.30 before, 1.90 1.20 0.60 after")
    assert table.startswith(
        "machine: AMD EPYC (no avx512_bf16/amx_bf16/amx_tile; torch AVX2 kernels), 2 cores, 1 torch threads, "
        "23.5 GiB, torch 2.14.1; load average 0.50 0.40 0.30 before, 1.90 1.20 0.60 after (1, 5, 15 min)\n"
    )
    assert "| 0.25 | ddp | 720 | 640 – 800 | 2.00 (2.00 – 2.00) | 45.0 | 18.0 | 11.0 | 7.0 | 7.5% |" in table
    assert "| 4 | torch_ddp | 480 | 320 – 640 |  | 50.0 | 10.0 | 2.0 | 8.0 | 6.0% |" in table

    chart(rows, tmp_path / "sweep.png", INFO, 2)
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_a_tiny_sweep_runs_both_ddps_and_reports_their_counters(tmp_path):
    command = [sys.executable, "-m", "mnist_dist.tools.bench", "--bucket-sweep", "--sizes", "1", "--repeats", "1"]
    command += ["--steps", "8", "--warmup", "2", "--batch", "16", "--out", str(tmp_path)]  # step 10 is sampled
    result = subprocess.run(command, capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stderr
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert_machine_fields(saved["machine"])
    assert [(s["ddp"], s["size_mb"], s["round"]) for s in saved["samples"]] == [("ddp", 1, 0), ("torch_ddp", 1, 0)]
    for row in saved["rows"]:
        counters = row["counters_ms"]
        assert counters["backward_compute"] > 0 and counters["backward_comm"] > 0, row["ddp"]
        assert 0 <= counters["backward_overlap"] <= counters["backward_comm"], row["ddp"]
        assert row["exposed_share"] >= 0
    assert (tmp_path / "sweep.md").read_text() in result.stdout
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
