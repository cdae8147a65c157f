"""Every performance number names its machine: the fields are there, non-empty, and in results.json."""

import json
import os

from helpers import assert_machine_fields

from mnist_dist.launch import launch
from mnist_dist.operations import machine


def test_summary_line_names_cpu_flags_threads_and_torch():
    info = dict(cpu="AMD EPYC", cpu_flags=["avx512_bf16"], cpu_capability="AVX512", cores=2, torch_threads=2)
    info |= dict(torch="2.14.1", gpus=0)
    line = machine.summary_line(info)
    assert line.startswith("machine: AMD EPYC (avx512_bf16; torch AVX512 kernels), 2 cores, 2 torch threads")
    info.update(cpu_flags=[], gpus=2, gpu="NVIDIA H200", cuda="12.8")
    line = machine.summary_line(info)
    assert "(no avx512_bf16/amx_bf16/amx_tile;" in line and line.endswith("torch 2.14.1, 2 x NVIDIA H200 (CUDA 12.8)")


def test_results_json_records_the_machine_and_a_busy_machine_is_one_warning(make_config, tmp_path, monkeypatch):
    busy = 4.0 * (os.cpu_count() or 1)  # as compare says: more work than cores, so images/s is unreliable
    monkeypatch.setattr(os, "getloadavg", lambda: (busy, busy, busy))
    launch(make_config("epochs=1", "model._target_=failing_model.NarrowConvNet"), tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    assert_machine_fields(results["machine"])
    logged = (tmp_path / "rank_0.log").read_text()
    assert logged.count("load average") == 1 and "images/s is unreliable" in logged
    assert machine.load_warning(0.5, cores=2) is None  # an idle machine: no warning


def test_describe_names_the_gpu_only_where_cuda_is_initialised(monkeypatch):
    # A CPU rank on a GPU host (device=cpu, or gloo ranks) must not create a CUDA context to name the GPU:
    # torch.cuda.get_device_name() initialises CUDA in every process that calls it.
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
