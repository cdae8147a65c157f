"""What rank 0 shows and records: its progress (a bar in a terminal, also one that reports no size:
test_late_interrupts), one short line of results, and the machine every performance number names."""

import json
import os

from mnist_dist.launch import launch
from mnist_dist.operations import machine
from mnist_dist.operations.report import summary_line
from mnist_dist.tools import machine_line


def test_a_run_ends_with_one_short_line_of_results_and_records_its_machine(make_config, tmp_path, capsys, monkeypatch):
    busy = 4.0 * (os.cpu_count() or 1)  # more work than cores, so images/s is unreliable
    monkeypatch.setattr(os, "getloadavg", lambda: (busy, busy, busy))
    launch(make_config("epochs=1", "batch_size=32", "model._target_=failing_model.NarrowConvNet"), tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    summary = summary_line(results)
    assert summary.startswith(
        f"test accuracy {100 * results['test_accuracy']:.2f} %, loss {results['test_loss']:.4f}; "
    )
    assert f"{results['steps']} steps in 0:00:" in summary and summary.endswith(" images/s")
    assert len(summary) < 100
    console = capsys.readouterr().err.splitlines()
    assert console[-2].endswith(f" INFO {summary}") and console[-1].endswith(f" INFO run directory: {tmp_path}")
    assert "results: {" not in "\n".join(console)  # the whole dict: results.json, and rank 0's log
    logged = (tmp_path / "rank_0.log").read_text()
    assert "results: {" in logged and logged.count("load average") == 1 and "images/s is unreliable" in logged
    info = results["machine"]  # machine.describe(): every field present and non-empty
    assert [
        f for f in ("cpu", "cpu_capability", "cores", "torch_threads", "torch", "gpus") if info[f] in ("", None)
    ] == []
    assert isinstance(info["cpu_flags"], list) and ("gpu" not in info or info["gpu"] and info["cuda"])
    assert machine.load_warning(0.5, cores=2) is None  # an idle machine: no warning


def test_the_machine_line_names_cpu_flags_threads_and_torch():
    info = dict(cpu="AMD EPYC", cpu_flags=["avx512_bf16"], cpu_capability="AVX512", cores=2, torch_threads=2)
    info |= dict(torch="2.14.1", gpus=0)
    line = machine_line(info)
    assert line.startswith("machine: AMD EPYC (avx512_bf16; torch AVX512 kernels), 2 cores, 2 torch threads")
    info.update(cpu_flags=[], gpus=2, gpu="NVIDIA H200", cuda="12.8")
    line = machine_line(info)
    assert "(no avx512_bf16/amx_bf16/amx_tile;" in line and line.endswith("torch 2.14.1, 2 x NVIDIA H200 (CUDA 12.8)")


def test_describe_names_the_gpu_only_where_cuda_is_initialised(monkeypatch):
    # A CPU rank on a GPU host must not create a CUDA context to name the GPU: get_device_name() initialises it.
    def initialises(*args):
        raise AssertionError("describe() initialised CUDA")

    monkeypatch.setattr(machine.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(machine.torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(machine.torch.cuda, "get_device_name", initialises)
    info = machine.describe()
    assert info["gpus"] == 1 and "gpu" not in info
    monkeypatch.setattr(machine.torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(machine.torch.cuda, "get_device_name", lambda device: "NVIDIA H200 NVL")
    assert machine.describe()["gpu"] == "NVIDIA H200 NVL"
