"""The GPU check's own logic with its trainings and probes faked (the probes' rows: test_gpu_probes.py): rows
as they finish, in the out file; a probe that hangs or crashes; the runs at gpus=1 against single; the
pre-flight; and real runs on a CPU (the bitwise row with its bug put back, --quick)."""

import argparse
import datetime
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import HANG_S

from mnist_dist.tools import bench, gpu_check
from mnist_dist.tools.gpu_check import Row
from mnist_dist.tools.synthetic import write_idx

probe_rows = gpu_check.probe_rows  # the fixture fakes it
PROBES = [Row("ddp overlap, 2 gloo ranks on one cpu", "backward hides the all-reduces it overlaps", "0.1 vs 1.0", True)]


@pytest.fixture
def faked(monkeypatch, tmp_path):
    """The trainings answered from each run's directory name; the probes one fixed row. Returns the runs
    started, the first losses to change by run and the runs whose model.pt differs from single's."""
    started, first_losses, other_weights = [], {}, set()

    def train(args, run_dir, *overrides):
        started.append(run_dir.name)
        run_dir.mkdir(parents=True)
        (run_dir / "results.json").write_text("{}")
        speed = {"single_1": 100.0, "ddp_1": 80.0}.get(run_dir.name, 50.0)
        return {"train_images_per_s": speed, "time_to_target_s": 2.0, "steps_to_target": 9}, ""

    monkeypatch.setattr(gpu_check, "train", train)
    monkeypatch.setattr(gpu_check, "losses", lambda run_dir: [first_losses.get(run_dir.name, 2.3)] + [2.3] * 19)
    monkeypatch.setattr(gpu_check, "same_weights", lambda run_dir, single: run_dir.name not in other_weights)
    monkeypatch.setattr(bench, "accuracy_curve", lambda run_dir: {1.0: 0.905, 2.0: 0.911})  # the fast run's
    monkeypatch.setattr(gpu_check, "probe_rows", lambda args, work: iter(PROBES))
    monkeypatch.setattr(gpu_check.tempfile, "mkdtemp", lambda prefix: str(tmp_path / "work"))
    return started, first_losses, other_weights


def run(monkeypatch, capsys, tmp_path, *argv):
    out = tmp_path / "gpu_check.md"
    argv = ["--device", "cpu", "--train-images", "640", "--out", str(out), "--fashion", str(tmp_path / "none"), *argv]
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", *argv])
    code = gpu_check.main()
    printed = capsys.readouterr().out
    assert out.read_text() == printed  # the file holds what was printed, row by row
    return code, printed, [line for line in printed.splitlines() if line.startswith("| ") and "| row |" not in line]


def test_quick_is_the_probes_and_the_modes_at_one_gpu(faked, monkeypatch, capsys, tmp_path):
    started, _, _ = faked
    code, out, rows = run(monkeypatch, capsys, tmp_path, "--quick")
    assert code == 0, out
    assert started == ["single_1", "ddp_1", "torch_ddp_1", "fsdp_1", "split_1", "fast"]  # no variant on a CPU
    header = out.strip().splitlines()[0]
    assert header.startswith("gpu_check --quick on ") and datetime.date.today().isoformat() in header
    assert f"{tmp_path / 'none'} holds no Fashion-MNIST: time to accuracy runs on generated data" in out
    assert "on a CPU, what needs CUDA is skipped: probe dp, probe dp_functional, probe tf32, probe nccl" in out
    where = f"generated data ({tmp_path / 'none'} holds no Fashion-MNIST)"
    assert [row.split(" | ")[0][2:] for row in rows] == [
        "ddp overlap, 2 gloo ranks on one cpu",
        *(f"{mode} gpus=1, generated data" for mode in ("single", "ddp", "torch_ddp", "fsdp", "split")),
        f"recipe=fast to 90.0%, {where}",
        f"recipe=fast to 91.0%, {where}",
    ]
    assert " | 80 images/s, +25.0% time vs single, final loss 2.3000; loss curve identical (20 steps), " in rows[2]
    assert "passes with margin" in rows[6] and " | 2.00 s, 9 steps, 50 images/s | ok |" in rows[7]
    assert out.strip().splitlines()[-2:][0] == "all rows passed"


def test_quick_runs_the_variants_of_single_on_cuda(faked, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "a GPU")
    started, _, _ = faked
    code, out, rows = run(monkeypatch, capsys, tmp_path, "--quick", "--device", "cuda")
    assert code == 0, out
    assert set(started[5:8]) == {"single_amp_bf16", "single_compile", "single_channels_last"}  # at once
    assert started[8:] == ["fast"]
    assert "| single compile gpus=1 | starts from single's first loss | first loss 0.0e+00 from single's" in out


@pytest.mark.parametrize(
    "run_dir, differs, said",
    [
        ("ddp_1", "curve", "loss curve differs from step 1 (20 steps), model.pt identical"),
        ("torch_ddp_1", "weights", "loss curve identical (20 steps), model.pt differs"),
        ("fsdp_1", "curve", "first loss 2.4 against 2.3"),
    ],
)
def test_a_run_at_one_gpu_that_is_not_singles_fails(faked, monkeypatch, capsys, tmp_path, run_dir, differs, said):
    _, first_losses, other_weights = faked
    if differs == "curve":
        first_losses[run_dir] = 2.4
    else:
        other_weights.add(run_dir)
    code, out, _ = run(monkeypatch, capsys, tmp_path, "--quick")
    failed = [line for line in out.splitlines() if line.startswith("FAILED")]
    assert code == 1 and len(failed) == 1 and failed[0].startswith(f"FAILED {run_dir[:-2]} gpus=1")
    assert said in failed[0]


def test_each_row_is_in_the_out_file_when_it_has_finished(faked, monkeypatch, capsys, tmp_path):
    seen, train = [], gpu_check.train

    def reading(args, run_dir, *overrides):
        seen.append(args.out.read_text() if run_dir.name == "ddp_1" else "")
        return train(args, run_dir, *overrides)

    monkeypatch.setattr(gpu_check, "train", reading)
    run(monkeypatch, capsys, tmp_path, "--quick")
    assert "| ddp overlap, 2 gloo ranks on one cpu |" in seen[1] and "| single gpus=1, generated data |" in seen[1]
    assert "| ddp gpus=1" not in seen[1]


def test_the_full_check_adds_every_mode_and_variant_and_fails_what_is_off(faked, monkeypatch, capsys, tmp_path):
    started, first_losses, _ = faked
    first_losses["dp_amp_fp16"] = 2.3 * 1.05
    code, out, rows = run(monkeypatch, capsys, tmp_path, "--modes", "single,dp,ddp")
    assert code == 1
    assert started[:8] == ["single_1", "ddp_1", "torch_ddp_1", "fsdp_1", "split_1", "single_2", "dp_2", "ddp_2"]
    variants = {f"{mode}_{variant.replace('=', '_')}" for mode in ("dp", "ddp") for variant in gpu_check.VARIANTS}
    assert variants - set(started) == {"ddp_compile"}  # refused by the trainer's own rule, so not run
    assert "| dp gpus=2, generated data | the mode trains, and follows single's loss over 20 steps |" in out
    assert (
        "| ddp compile gpus=2 | starts from ddp's first loss | refused as designed: compile=true with mode=ddp: "
        "the compiled backward is one autograd node"
    ) in out
    failed = [line for line in out.splitlines() if line.startswith("FAILED")]
    assert failed == ["FAILED dp amp=fp16 gpus=2: first loss 5.0e-02 from dp's (at most 0.01), last 2.3000"]


def test_preflight_skips_the_compile_rows_without_a_c_compiler(faked, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(gpu_check.shutil, "which", lambda name: None)
    code, out, _ = run(monkeypatch, capsys, tmp_path, "--modes", "ddp")
    assert "no C compiler (cc, gcc, clang): the compile variants are skipped (apt-get install gcc)" in out
    assert "compile" not in " ".join(faked[0]) and code == 0


def test_preflight_stops_where_the_package_is_not_installed(faked, monkeypatch, capsys, tmp_path):
    def missing(name):
        raise gpu_check.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(gpu_check.importlib.metadata, "version", missing)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--device", "cpu", "--quick", "--out", str(tmp_path / "out")])
    assert gpu_check.main() == 1 and faked[0] == []
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 1 and "missing mnist_dist" in out and "pip install -e ." in out


def test_the_check_says_what_is_missing_where_hydra_is(tmp_path):
    # A GPU machine with its own torch may lack Hydra: the check's first line says so, not an ImportError.
    code = (
        "import sys; sys.modules.update(hydra=None, omegaconf=None)\n"
        "from mnist_dist.tools import gpu_check; sys.exit(gpu_check.main())"
    )
    command = [sys.executable, "-c", code, "--device", "cpu", "--quick", "--out", str(tmp_path / "out")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 1, result.stderr
    (line,) = result.stdout.splitlines()
    assert "missing hydra-core, omegaconf" in line and "--no-index --find-links offline/wheels" in line


def test_a_cuda_run_without_a_gpu_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--quick"])
    assert gpu_check.main() == 1
    assert "no CUDA device is visible" in capsys.readouterr().out


# probes in processes of their own: a hang is a timed-out row, a crash a failed one, and the check goes on ---
def gone(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    return not status.exists() or "State:\tZ" in status.read_text()


def test_a_probe_that_hangs_or_crashes_is_a_failed_row_and_the_check_goes_on(faked, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(gpu_check, "probe_rows", probe_rows)
    pid_file = tmp_path / "pid"
    hangs = (  # and its own child hangs with it: the whole session is killed
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], stdout=-3, stderr=-3)\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid)); time.sleep(600)"
    )
    crashes = "raise RuntimeError('CUDA error: out of memory')"
    answers = 'print(\'[{"name": "a row", "proves": "", "figure": "", "ok": true}]\')'
    scripts = {"overlap": hangs, "batchnorm": crashes, "gradients": answers}
    monkeypatch.setattr(gpu_check, "probe_command", lambda args, name, work: [sys.executable, "-c", scripts[name]])
    code, out, rows = run(monkeypatch, capsys, tmp_path, "--quick", "--timeout", "5")
    assert code == 1
    assert rows[0].startswith("| probe overlap |  | timed out after 5 s | **FAILED** |")
    assert rows[1].startswith("| probe batchnorm |  | exit 1: RuntimeError: CUDA error: out of memory | **FAILED** |")
    assert rows[2].startswith("| a row |  |  | ok |") and "| single gpus=1, generated data |" in rows[3]
    pid = int(pid_file.read_text())
    for _ in range(50):  # SIGKILL is delivered, not waited for
        if gone(pid):
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the hung probe's own child outlived it")


# real runs ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_bitwise_row_fails_where_ddp_at_world_size_1_divides_wrongly(tmp_path, monkeypatch):
    # The bug put back in the training processes (forkserver ranks included) through sitecustomize: gradients
    # halved at world size 1. Adadelta nearly undoes a scale, so the loss moves only in its last bits.
    (tmp_path / "sitecustomize.py").write_text(
        "from mnist_dist.parallel.ddp import Bucket\n"
        "send = Bucket.send\n"
        "Bucket.send = lambda self, params, scale: send(self, params, scale / 2)\n"
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    write_idx(tmp_path / "data" / "MNIST" / "raw", n_train=640, n_test=500)
    args = argparse.Namespace(epochs=1, train_images=640, device="cpu", timeout=HANG_S)
    single, ddp = gpu_check.check_modes(args, tmp_path, 1, ["single", "ddp"])
    assert single.ok and not ddp.ok, ddp
    assert "loss curve differs from step 2 (5 steps), model.pt differs" in ddp.figure


@pytest.mark.slow
def test_quick_passes_on_the_cpu(tmp_path):
    # What a GPU machine runs, on the CPU: the rank probes (the in-process ones need CUDA) and the trainer.
    command = [sys.executable, "-m", "mnist_dist.tools.gpu_check", "--device", "cpu", "--quick"]
    command += ["--out", str(tmp_path / "out.md"), "--train-images", "640", "--epochs", "1", "--fashion", str(tmp_path)]
    result = subprocess.run(
        command + ["--targets", "0.3,0.5", "--tta-epochs", "2"], capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout + result.stderr
    names = [line.split(" | ")[0][2:] for line in result.stdout.splitlines() if line.startswith("| ")][1:]
    assert names[:6] == [
        "ddp overlap, 2 gloo ranks on one cpu",
        "BatchNorm evaluation, resnet, 2 gloo ranks on one cpu",
        "ddp gradients, 2 gloo ranks on one cpu",
        "torch_ddp gradients, 2 gloo ranks on one cpu",
        "single gpus=1, generated data",
        "ddp gpus=1, generated data",
    ]
    assert "all rows passed" in result.stdout and (tmp_path / "out.md").read_text() == result.stdout
