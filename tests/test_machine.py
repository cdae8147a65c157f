"""Every performance number names its machine: the fields are there, non-empty, and in results.json."""

import json

from helpers import assert_machine_fields

from mnist_dist import machine
from mnist_dist.launch import launch

CPUINFO = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile avx2
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu
"""


def test_cpu_model_and_bf16_flags_are_read_from_cpuinfo():
    assert machine._cpuinfo(CPUINFO) == (
        "Intel(R) Xeon(R) Platinum 8480+",
        {"fpu", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx2"},
    )


def test_summary_line_names_cpu_flags_threads_and_torch():
    info = {
        "cpu": "AMD EPYC",
        "cpu_flags": ["avx512_bf16"],
        "cpu_capability": "AVX512",
        "cores": 2,
        "torch_threads": 2,
        "memory_gib": 23.5,
        "torch": "2.14.1",
        "gpus": 0,
    }
    assert machine.summary_line(info) == (
        "machine: AMD EPYC (avx512_bf16; torch AVX512 kernels), 2 cores, 2 torch threads, 23.5 GiB, torch 2.14.1"
    )
    info.update(cpu_flags=[], gpus=2, gpu="NVIDIA H200", cuda="12.8", driver="570.1")
    assert machine.summary_line(info).endswith(
        "(no avx512_bf16/amx_bf16/amx_tile; torch AVX512 kernels), 2 cores, 2 torch threads, 23.5 GiB, torch 2.14.1, "
        "2 x NVIDIA H200 (CUDA 12.8, driver 570.1)"
    )


def test_this_machine_is_described():
    assert_machine_fields(machine.describe())


def test_results_json_records_the_machine(make_config, tmp_path):
    launch(make_config("epochs=1"), tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    assert_machine_fields(results["machine"])
