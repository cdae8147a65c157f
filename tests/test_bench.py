"""The benchmark's arithmetic (medians, paired ratios, targets), on made-up numbers and a tiny run."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import HANG_S, assert_machine_fields

from mnist_dist.tools.bench import CASES, choose, markdown, report, skips
from mnist_dist.tools.run import paired_ratio


def run(speed, comm=0.0, counters=None):
    return {
        "images_per_s": speed,
        "peak_rss_mib": [100.0, 120.0],
        "model_state_mib": [9.5, 9.0],
        "step_time_ms": {"data": 0.0, "forward_backward": 9.0, "comm_wait": comm, "optimizer": 1.0},
        "ddp_backward_ms": counters,
    }


def counters(compute, comm, overlap):
    return {"backward_compute": compute, "backward_comm": comm, "backward_overlap": overlap}


def test_ratios_are_medians_of_paired_rounds():
    # Round 2 ran on a slower machine for both: the paired ratio stays 2, the ratio of medians would not.
    assert paired_ratio([200.0, 100.0, 210.0], [100.0, 50.0, 100.0]) == {"median": 2.0, "min": 2.0, "max": 2.1, "n": 3}


def test_report_medians_targets_and_exposed_communication():
    samples = {
        "single": [run(1200.0), run(1000.0), run(1100.0)],
        "classic": [run(1000.0), run(1000.0), run(1000.0)],
        "ddp": [run(900.0, 1.0, counters(8.0, 3.0, 2.0)), run(950.0, 0.5, counters(7.0, 2.5, 2.0))],
        "torch_ddp": [run(1000.0, 0.0, counters(7.5, 4.0, 3.5)), run(1000.0, 0.0, counters(7.5, 4.0, 3.5))],
    }
    result = report(samples)
    assert result["cases"]["single"] == {
        "median": 1100.0,
        "min": 1000.0,
        "max": 1200.0,
        "n": 3,
        "peak_rss_mib": 120.0,
        "model_state_mib": 9.5,
        "ddp_backward_ms": None,
    }
    rows = {row["name"]: row for row in result["comparisons"]}
    assert set(rows) == {"single / classic", "ddp / torch_ddp", "ddp: exposed communication"}
    assert rows["single / classic"]["median"] == pytest.approx(1.1) and rows["single / classic"]["met"] is False
    assert rows["ddp / torch_ddp"]["median"] == pytest.approx(0.925) and not rows["ddp / torch_ddp"]["met"]
    share = rows["ddp: exposed communication"]
    assert share["median"] == pytest.approx((1 / 11 + 0.5 / 10.5) / 2) and share["max"] == pytest.approx(1 / 11)
    assert share["met"] is False  # 6.9 % > 5 %
    assert result["cases"]["ddp"]["ddp_backward_ms"] == counters(7.5, 2.75, 2.0)  # medians over the runs
    info = {"cpu": "AMD EPYC", "cpu_flags": [], "cpu_capability": "AVX2", "cores": 2, "torch_threads": 2}
    info.update(memory_gib=23.5, torch="2.14.1")
    table = markdown(result, {"device": "cpu", "batch": 64, "steps": 10, "repeats": 3, "gpus": 2}, info)
    assert table.startswith(
        "machine: AMD EPYC (no avx512_bf16/amx_bf16/amx_tile; torch AVX2 kernels), 2 cores, 2 torch"
    )
    assert "| single | 1,100 | 1,000 – 1,200 | 120 | 9.5 |" in table  # model state: the fullest rank's
    assert "| single / classic | 1.10 | 1.00 – 1.20 | ≥ 1.15 | **no** |" in table
    assert "| ddp: exposed communication | 6.9% | 4.8% – 9.1% | ≤ 5% | **no** |" in table
    # both DDPs on the counters torch DDP keeps, side by side
    assert "| ddp | 7.5 | 2.8 | 2.0 | 0.8 |" in table and "| torch_ddp | 7.5 | 4.0 | 3.5 | 0.5 |" in table


EMULATED = "bf16 is emulated"


@pytest.mark.parametrize(
    "device, flags, skipped",
    [
        ("cpu", [], True),  # the 2-core EPYC where single_bf16 ran at 79 images/s
        ("cpu", ["amx_tile"], True),  # tiles without their bf16 multiply
        ("cpu", ["avx512_bf16"], False),
        ("cpu", ["amx_bf16", "amx_tile"], False),
        ("cuda", [], False),  # the GPU computes, not this CPU
    ],
)
def test_bf16_is_skipped_only_on_a_cpu_that_emulates_it(device, flags, skipped):
    assert ("single_bf16" in skips(device, flags)) is skipped
    assert set(skips(device, flags)) <= {"single_bf16"}
    chosen, why = choose(None, device, flags)
    assert ("single_bf16" in chosen) is not skipped and set(chosen) | set(why) == set(CASES)
    assert choose("single_bf16,single", device, flags) == (["single_bf16", "single"], {})  # named: it runs


def test_a_skipped_case_is_noted_and_its_comparisons_say_why():
    samples = {"single": [run(1200.0)], "single_ckpt100": [run(1100.0)]}
    result = report(samples, skips("cpu", []))
    rows = {row["name"]: row for row in result["comparisons"]}
    assert rows["single_bf16 / single"]["kind"] == "skipped" and EMULATED in rows["single_bf16 / single"]["why"]
    assert rows["single_ckpt100 / single"]["median"] == pytest.approx(1100 / 1200)
    info = {"cpu": "AMD EPYC", "cpu_flags": [], "cpu_capability": "AVX2", "cores": 2, "torch_threads": 2}
    info.update(memory_gib=23.5, torch="2.14.1")
    table = markdown(result, {"device": "cpu", "batch": 64, "steps": 10, "repeats": 1, "gpus": 2}, info)
    why = skips("cpu", [])["single_bf16"]
    assert f"\n\nskipped single_bf16: {why}\n\n| case |" in table
    assert f"| single_bf16 / single | skipped: {why} | | | |" in table
    assert "single_bf16 |" not in table.split("| comparison |")[0]  # no row for what did not run


@pytest.mark.slow
def test_a_tiny_run_reports_what_it_measured(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mnist_dist.tools.bench",
            "--cases",
            "single,ceiling",
            "--repeats",
            "1",  # each case is a fresh process (~10 s); medians: test_ratios_are_medians_of_paired_rounds
            "--steps",
            "6",
            "--warmup",
            "2",
            "--batch",
            "16",
            "--out",
            str(tmp_path),
        ],
        env={k: v for k, v in _temp_in(tmp_path).items() if k != "OMP_NUM_THREADS"},  # conftest sets it under xdist
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert _work_left(tmp_path) == []
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert_machine_fields(saved["machine"])
    assert [run["torch_threads"] for run in saved["samples"]["single"]] == [os.cpu_count()]
    (single,), (ceiling,) = ([run["images_per_s"] for run in saved["samples"][case]] for case in ("single", "ceiling"))
    assert saved["cases"]["single"]["median"] == single > 0
    (ratio,) = saved["comparisons"]
    assert ratio["name"] == "single / ceiling" and ratio["median"] == pytest.approx(single / ceiling)
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "bench.md").read_text() in result.stdout


def test_the_in_process_baselines_run_under_the_trainers_kernel_policy(tmp_path, monkeypatch):
    # `classic` and `ceiling` skipped setup_process: on a GPU, `single / ceiling` compared the trainer's
    # fp32 convolutions with TF32 ones (torch 2.14's default) and non-deterministic cuDNN autotuning.
    import torch

    from mnist_dist.config import Config
    from mnist_dist.tools import baselines

    torch.backends.cudnn.conv.fp32_precision = "tf32"  # torch's default for convolutions on a GPU
    torch.use_deterministic_algorithms(False)
    seen = []
    real_step = baselines.train_step

    def step(*args, **kwargs):
        seen.append((torch.backends.cudnn.conv.fp32_precision, torch.are_deterministic_algorithms_enabled()))
        return real_step(*args, **kwargs)

    monkeypatch.setattr(baselines, "train_step", step)
    baselines.measure_here("ceiling", tmp_path, batch=4, steps=1, warmup=0, device=torch.device("cpu"))
    assert Config.tf32 is False and Config.deterministic is True  # the trainer's defaults
    assert seen == [("ieee", True)]


# --- issue 38: a bad count is one line, and no run leaves its work directory ------------------------------

BENCH = [sys.executable, "-m", "mnist_dist.tools.bench", "--repeats", "1", "--batch", "16", "--warmup", "1"]


@pytest.mark.parametrize(
    "flag, value, least",
    [("--steps", "-1", 1), ("--steps", "0", 1), ("--steps", "abc", 1), ("--repeats", "0", 1), ("--warmup", "-1", 0)],
)
def test_a_count_that_cannot_be_is_one_line_naming_the_flag(tmp_path, flag, value, least):
    # before: --steps -1 ran and failed with a CalledProcessError traceback, 0 meant the default, abc printed the usage
    command = [*BENCH, "--cases", "ceiling", "--steps", "2", flag, value, "--out", str(tmp_path / "out")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=HANG_S, env=_temp_in(tmp_path))
    assert (result.returncode, result.stderr) == (
        1,
        f"bench: argument {flag}: {value} must be a whole number, at least {least} (--help lists the options)\n",
    )
    assert _work_left(tmp_path) == [] and not (tmp_path / "out").exists()


def _temp_in(tmp_path) -> dict:
    """The environment with its temp folder in ``tmp_path``/tmp, where the bench's work directory goes."""
    (tmp_path / "tmp").mkdir()
    return {**os.environ, "TMPDIR": str(tmp_path / "tmp")}


def _work_left(tmp_path) -> list:
    """The bench's work directories left in the temp folder ``_temp_in`` made (torch may keep its caches there)."""
    return list((tmp_path / "tmp").glob("mnist_dist_bench_*"))


def test_a_failed_bench_leaves_no_work_directory(tmp_path):
    # before: every bench run left its generated data and run directories (~20 MB) in the temp folder
    command = [*BENCH, "--cases", "ddp", "--gpus", "3", "--steps", "2", "--out", str(tmp_path / "out")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=HANG_S, env=_temp_in(tmp_path))
    assert result.returncode == 1 and result.stderr.startswith(
        "bench: ddp failed: exit 1: error: batch_size=16 (global) is not divisible by 3 ranks"
    ), result.stderr
    assert _work_left(tmp_path) == [] and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_an_interrupted_bench_leaves_no_work_directory(tmp_path):
    env = _temp_in(tmp_path)
    command = [*BENCH, "--cases", "single", "--steps", "2000", "--out", str(tmp_path / "out")]
    bench = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + HANG_S  # until the trainer runs (its run directory exists): no time bound
        while not list((tmp_path / "tmp").glob("*/runs/*")) and bench.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        bench.send_signal(signal.SIGTERM)
        stderr = bench.communicate(timeout=HANG_S)[1]
    finally:
        bench.kill()
    assert (bench.returncode, stderr.splitlines()[-1:]) == (143, ["interrupted; no report written"])
    assert _work_left(tmp_path) == []
