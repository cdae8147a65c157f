"""The GPU check on a CPU: its rows with the trainings faked, the bitwise row on runs that differ, a probe that hangs
or crashes (each probe's row, its bug put back: test_gpu_probes.py)."""

import os
import signal
import sys

import pytest
import torch
from helpers import alive, wait_for

from mnist_dist.tools import gpu_check
from mnist_dist.tools.gpu_check import Row


@pytest.fixture
def faked(monkeypatch, tmp_path):
    """The trainings answered by run directory, no probe; returns the runs started and the first losses to change."""
    started, first_losses = [], {}

    def train(args, run_dir, *overrides):
        started.append(run_dir.name)
        run_dir.mkdir(parents=True)
        (run_dir / "results.json").write_text("{}")
        return {"train_images_per_s": 100.0, "time_to_target_s": 2.0, "steps_to_target": 9}, ""

    monkeypatch.setattr(gpu_check, "train", train)
    monkeypatch.setattr(gpu_check, "losses", lambda run_dir: [first_losses.get(run_dir.name, 2.3)] + [2.3] * 19)
    monkeypatch.setattr(gpu_check, "bitwise", lambda run_dir, curve, single: ("identical", True))
    monkeypatch.setattr("mnist_dist.tools.bench.accuracy_curve", lambda run_dir: {1.0: 0.905, 2.0: 0.911})
    monkeypatch.setattr(gpu_check.tempfile, "mkdtemp", lambda prefix: str(tmp_path / "work"))
    return started, first_losses


def run(monkeypatch, capsys, tmp_path, *argv):
    out = tmp_path / "gpu_check.md"
    code = gpu_check.main(["--out", str(out), "--fashion", str(tmp_path / "none"), *argv])
    printed = capsys.readouterr().out
    assert out.read_text() == printed  # the file holds what was printed
    return code, printed, [line.split(" | ")[0][2:] for line in printed.splitlines() if line.startswith("| ")][1:]


def test_quick_on_a_cpu_is_the_modes_at_one_gpu_and_time_to_accuracy(faked, monkeypatch, capsys, tmp_path):
    seen, train = [], gpu_check.train  # the out file when each run starts: a check killed then keeps its rows

    def reading(args, run_dir, *overrides):
        seen.append(args.out.read_text())
        return train(args, run_dir, *overrides)

    monkeypatch.setattr(gpu_check, "train", reading)
    code, out, rows = run(monkeypatch, capsys, tmp_path, "--device", "cpu", "--quick")
    assert "| single gpus=1, generated data |" in seen[1] and "| ddp gpus=1" not in seen[1]
    assert code == 0 and "all rows passed" in out, out
    assert faked[0] == ["single_1", "ddp_1", "torch_ddp_1", "fsdp_1", "split_1", "fast"]  # no probe, no variant
    assert "holds no Fashion-MNIST" in out and "what needs CUDA is skipped" in out
    assert rows[:2] == ["single gpus=1, generated data", "ddp gpus=1, generated data"]
    assert rows[-2:] == ["recipe=fast to 90.0%, generated data", "recipe=fast to 91.0%, generated data"]


@pytest.mark.parametrize("compiler", ["/usr/bin/cc", None])
def test_quick_on_cuda_adds_the_probes_and_the_variants_of_single(faked, monkeypatch, capsys, tmp_path, compiler):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "a GPU")
    monkeypatch.setattr(gpu_check, "probe_rows", lambda args, work: iter([Row("a probe", "", "", True)]))
    monkeypatch.setattr(gpu_check.shutil, "which", lambda name: compiler)
    faked[1]["single_amp"] = 2.3 * 1.05  # bf16's first loss 5 % off single's: outside its rounding
    code, out, rows = run(monkeypatch, capsys, tmp_path, "--quick")
    assert code == 1 and rows[0] == "a probe"
    compiled = ["single_compile"] if compiler else []  # without a C compiler: skipped, and said
    assert faked[0][5:] == ["single_amp", *compiled, "single_channels_last", "fast"]
    assert ("no C compiler" in out) is (compiler is None)
    failed = [line for line in out.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and failed[0].startswith("FAILED single amp=bf16 gpus=1: first loss 5.0e-02")


def test_the_full_check_adds_every_mode_on_every_gpu(faked, monkeypatch, capsys, tmp_path):
    code, out, _ = run(monkeypatch, capsys, tmp_path, "--device", "cpu")
    assert code == 0, out
    assert faked[0][5:8] == ["single_2", "dp_2", "dp_block_2"] and "ddp_2" in faked[0]


def test_a_run_at_one_gpu_that_is_not_singles_fails_the_bitwise_row(monkeypatch, tmp_path):
    curves = {"single": [2.3, 2.2], "ddp": [2.3, 2.2], "other": [2.3, 2.25]}
    monkeypatch.setattr(gpu_check, "losses", lambda run_dir: curves[run_dir.name])
    weights = {"single": torch.ones(3), "ddp": torch.ones(3), "other": torch.ones(3) * 2}
    for name, tensor in weights.items():
        (tmp_path / name).mkdir()
        torch.save({"w": tensor}, tmp_path / name / "model.pt")
    figure, ok = gpu_check.bitwise(tmp_path / "ddp", curves["ddp"], tmp_path / "single")
    assert ok and "loss curve identical" in figure
    figure, ok = gpu_check.bitwise(tmp_path / "other", curves["other"], tmp_path / "single")
    assert not ok and "differs from step 2" in figure and "model.pt differs" in figure


@pytest.mark.parametrize("missing", ["hydra-core", "mnist_dist"])  # no CUDA device: test_offline.py, a real run
def test_what_the_check_cannot_run_without_is_one_line_and_no_report(monkeypatch, capsys, tmp_path, missing):
    if missing == "hydra-core":  # a GPU machine's own torch stack, without Hydra
        monkeypatch.setitem(sys.modules, "hydra", None)
    else:  # the clone on the path, not installed: its Hydra configs are not there

        def not_installed(name):
            raise gpu_check.importlib.metadata.PackageNotFoundError(name)

        monkeypatch.setattr(gpu_check.importlib.metadata, "version", not_installed)
    assert gpu_check.main(["--device", "cpu", "--quick", "--out", str(tmp_path / "out")]) == 1
    (line,) = capsys.readouterr().out.splitlines()
    assert missing in line and "--find-links offline/wheels" in line
    assert not (tmp_path / "out").exists()


def test_a_probe_that_hangs_or_crashes_is_a_failed_row_and_the_check_goes_on(monkeypatch, tmp_path):
    pid_file = tmp_path / "pid"
    hangs = (  # and its own child hangs with it: the whole session is killed
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid)); time.sleep(600)"
    )
    scripts = {"dp": hangs, "dp_functional": "raise RuntimeError('CUDA error: out of memory')"}
    scripts["nccl"] = 'print(\'{"name": "a row", "proves": "", "figure": "", "ok": true}\')'
    run = gpu_check.bounded  # the probe named in the command (--probe NAME) runs its script instead
    monkeypatch.setattr(
        gpu_check, "bounded", lambda command, timeout: run([sys.executable, "-c", scripts[command[4]]], timeout)
    )
    args = type("Args", (), {"device": "cuda", "timeout": 1.5})
    rows = list(gpu_check.probe_rows(args, tmp_path))
    assert [(row.name, row.ok) for row in rows] == [
        ("probe dp", False),
        ("probe dp_functional", False),
        ("a row", True),
    ]
    assert "timed out" in rows[0].figure and "CUDA error: out of memory" in rows[1].figure
    pid = int(pid_file.read_text())
    if not wait_for(lambda: not alive(pid), deadline_s=5):  # SIGKILL is delivered, not waited for
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the hung probe's own child outlived it")
