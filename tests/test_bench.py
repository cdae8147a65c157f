"""The bench: ratios of paired rounds, skipped cases, time to accuracy's table, one line for a bad count, and no
work directory left however it ends."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import HANG_S, assert_machine_fields

from mnist_dist.tools import bench
from mnist_dist.tools.bench import CASES, choose, markdown, report, skips

INFO = {"cpu": "AMD EPYC", "cpu_flags": [], "cpu_capability": "AVX2", "cores": 2, "torch_threads": 2}
INFO.update(memory_gib=23.5, torch="2.14.1")


def run(speed):
    return {"train_images_per_s": speed, "peak_rss_mib": [100.0, 120.0], "model_state_mib": [9.5, 9.0]}


def test_report_has_medians_and_ratios_of_paired_rounds():
    # Round 2 ran on a slower machine for both: the paired ratio stays 2, the ratio of medians would not.
    samples = {
        "single": [run(1200.0), run(1000.0), run(1100.0)],
        "ddp": [run(400.0), run(200.0), run(420.0)],
        "torch_ddp": [run(200.0), run(100.0), run(200.0)],
    }
    result = report(samples)
    assert result["cases"]["single"] == {
        "median": 1100.0,
        "min": 1000.0,
        "max": 1200.0,
        "n": 3,
        "peak_rss_mib": 120.0,
        "model_state_mib": 9.5,
    }
    (ratio,) = result["comparisons"]
    assert (ratio["name"], ratio["median"], ratio["min"], ratio["max"], ratio["met"]) == (
        "ddp / torch_ddp",
        2.0,
        2.0,
        2.1,
        True,
    )
    table = markdown(result, {"device": "cpu", "batch": 64, "steps": 10, "repeats": 3, "gpus": 2}, INFO)
    assert table.startswith("machine: AMD EPYC (no avx512_bf16/amx_bf16/amx_tile; torch AVX2 kernels), 2 cores")
    assert "| single | 1,100 | 1,000 – 1,200 | 120 | 9.5 |" in table  # model state: the fullest rank's
    assert "| ddp / torch_ddp | 2.00 | 2.00 – 2.10 | ≥ 1.05 | yes |" in table
    result["warning"] = "warning: the load average reached 3.0 on 2 cores"
    assert markdown(result, {"device": "cpu", "batch": 64, "steps": 10, "repeats": 3, "gpus": 2}, INFO).endswith(
        "\nwarning: the load average reached 3.0 on 2 cores\n"
    )


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
    samples = {"single": [run(1200.0)], "fsdp": [run(550.0)], "ddp": [run(1100.0)]}
    result = report(samples, skips("cpu", []))
    rows = {row["name"]: row for row in result["comparisons"]}
    assert EMULATED in rows["single_bf16 / single"]["why"] and "median" not in rows["single_bf16 / single"]
    assert rows["fsdp / ddp"]["median"] == pytest.approx(0.5)
    table = markdown(result, {"device": "cpu", "batch": 64, "steps": 10, "repeats": 1, "gpus": 2}, INFO)
    why = skips("cpu", [])["single_bf16"]
    assert f"\n\nskipped single_bf16: {why}\n\n| case |" in table
    assert f"| single_bf16 / single | skipped: {why} | | | |" in table
    assert "single_bf16 |" not in table.split("| comparison |")[0]  # no row for what did not run


@pytest.mark.slow
def test_a_tiny_run_reports_what_it_measured(tmp_path):
    command = [*BENCH, "--cases", "single", "--steps", "6", "--warmup", "2", "--out", str(tmp_path / "out")]
    env = {k: v for k, v in _temp_in(tmp_path).items() if k != "OMP_NUM_THREADS"}  # conftest sets it under xdist
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert _work_left(tmp_path) == []
    saved = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert_machine_fields(saved["machine"])
    (single,) = saved["samples"]["single"]
    assert saved["cases"]["single"]["median"] == single["train_images_per_s"] > 0
    assert (tmp_path / "out" / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "out" / "bench.md").read_text() in result.stdout


def test_without_matplotlib_the_tables_are_written_and_the_chart_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    said = bench.save_chart(tmp_path / "bench.png", bench.bar_chart({"cases": {}}))
    assert "matplotlib" in said and "[plot]" in said and not (tmp_path / "bench.png").exists()


def tta_run(seconds_91, seconds_92, accuracy):
    return {"seconds_to": [seconds_91, seconds_92], "test_accuracy": accuracy}


def test_time_to_accuracy_table_medians_worst_misses_and_targets():
    samples = {
        "single": [tta_run(30.0, 40.0, 0.921), tta_run(35.0, 50.0, 0.922), tta_run(31.0, 45.0, 0.923)],
        "ddp": [tta_run(36.0, 48.0, 0.92), tta_run(40.0, 55.0, 0.921), tta_run(41.0, 58.5, 0.925)],  # 1.2, 1.1, 1.3
        "torch_ddp": [tta_run(40.0, 50.0, 0.920), tta_run(44.0, None, 0.915), tta_run(38.0, 52.0, 0.921)],
    }
    targets = [0.91, 0.92]
    result = bench.tta_summary(samples, targets)
    single = result["cases"]["single"]["targets"]
    assert (single[0.92]["median_s"], single[0.92]["worst_s"], single[0.91]["median_s"]) == (45.0, 50.0, 31.0)
    assert result["single_met"] and result["ddp_ratio"] == pytest.approx(1.2) and result["ddp_met"]
    missed = result["cases"]["torch_ddp"]["targets"]
    assert missed[0.92]["reached"] == 2 and missed[0.92]["worst_s"] is None and missed[0.91]["worst_s"] == 44.0
    settings = {
        "targets": targets,
        "dataset": "fashion_mnist",
        "device": "cpu",
        "gpus": 2,
        "eval_every": 47,
        "seeds": 3,
    }
    table = bench.tta_markdown(result, settings, INFO)
    assert "recipe=fast to 91.0% and 92.0% test accuracy" in table
    assert "| single | 91.0% | 3/3 | 31.0 | 35.0 |  |" in table
    assert "| single | 92.0% | 3/3 | 45.0 | 50.0 | 92.10% – 92.30% (median 92.20%) |" in table
    assert "| torch_ddp | 92.0% | 2/3 | 51.0 | not reached |" in table
    assert "| single reaches 92.0% within 60 s | worst 50.0 s | yes |" in table
    assert "| ddp within 1.3x single's time | 1.20x (median of per-seed ratios) | yes |" in table


BENCH = [sys.executable, "-m", "mnist_dist.tools.bench", "--repeats", "1", "--batch", "16", "--warmup", "1"]


@pytest.mark.parametrize(
    "flag, value, least",
    [("--steps", "-1", 1), ("--steps", "0", 1), ("--steps", "abc", 1), ("--repeats", "0", 1), ("--warmup", "-1", 0)],
)
def test_a_count_that_cannot_be_is_one_line_naming_the_flag(tmp_path, flag, value, least):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--cases", "single", flag, value, "--out", str(tmp_path / "out")])
    message = exit_.value.code
    assert message.startswith(f"bench: argument {flag}: {value} must be a whole number, at least {least}")
    assert "\n" not in message and not (tmp_path / "out").exists()


def test_a_bad_target_is_one_line():
    with pytest.raises(SystemExit, match="--targets: 0.9,1.5: test accuracies as fractions"):
        bench.main(["--time-to-accuracy", "--targets", "0.9,1.5"])


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


def test_the_tools_and_the_trainer_import_without_matplotlib():
    # matplotlib is the plot extra: only drawing a chart needs it
    blocked = "import sys; sys.modules['matplotlib'] = None; "
    imports = "import mnist_dist.train, mnist_dist.tools.bench, mnist_dist.tools.compare, mnist_dist.tools.check"
    result = subprocess.run([sys.executable, "-c", blocked + imports], capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stderr
