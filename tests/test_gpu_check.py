"""The GPU check's own logic with its trainings and probes faked (the probes' rows: test_gpu_probes.py), its
pre-flight, and one real run of --quick on a CPU."""

import datetime
import subprocess
import sys

import pytest
import torch

from mnist_dist.tools import gpu_check, gpu_runs
from mnist_dist.tools.gpu_probes import Row

PROBES = [Row("ddp overlap, 2 gloo ranks on one cpu", "backward hides the all-reduces it overlaps", "0.1 vs 1.0", True)]


@pytest.fixture
def faked(monkeypatch, tmp_path):
    """The trainings answered from each run's directory name; the probes one fixed row. Returns the runs."""
    started, first_losses = [], {}

    def train(run_dir, *overrides):
        started.append(run_dir.name)
        speed = {"single_1": 100.0, "ddp_1": 80.0}.get(run_dir.name, 50.0)
        return {"train_images_per_s": speed, "time_to_target_s": 2.0, "steps_to_target": 9}, ""

    monkeypatch.setattr(gpu_runs, "train", train)
    monkeypatch.setattr(gpu_runs, "losses", lambda run_dir: [first_losses.get(run_dir.name, 2.3)] + [2.3] * 19)
    monkeypatch.setattr(gpu_runs, "accuracy_curve", lambda run_dir: {1.0: 0.915, 2.0: 0.921})  # the fast run's
    monkeypatch.setattr(gpu_check, "probe_rows", lambda args, work: list(PROBES))
    monkeypatch.setattr(gpu_check.tempfile, "mkdtemp", lambda prefix: str(tmp_path / "work"))
    return started, first_losses


def run(monkeypatch, capsys, *argv):
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--device", "cpu", "--train-images", "640", *argv])
    code = gpu_check.main()
    out = capsys.readouterr().out
    return code, out, [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| row")]


def test_quick_is_the_probes_and_the_trainer_at_one_gpu(faked, monkeypatch, capsys, tmp_path):
    started, _ = faked
    code, out, rows = run(monkeypatch, capsys, "--quick", "--fashion", str(tmp_path / "none"))
    assert code == 0, out
    assert started == ["single_1", "ddp_1", "torch_ddp_1", "fast"]  # no mode or variant runs
    header = out.strip().splitlines()[0]
    assert header.startswith("gpu_check --quick on ") and datetime.date.today().isoformat() in header
    assert f"{tmp_path / 'none'} holds no Fashion-MNIST: time to accuracy runs on generated data" in out
    assert [row.split(" | ")[0][2:] for row in rows] == [
        "ddp overlap, 2 gloo ranks on one cpu",
        "single gpus=1, generated data",
        "ddp gpus=1, generated data",
        "torch_ddp gpus=1, generated data",
        f"recipe=fast to 91.0%, generated data ({tmp_path / 'none'} holds no Fashion-MNIST)",
        f"recipe=fast to 92.0%, generated data ({tmp_path / 'none'} holds no Fashion-MNIST)",
    ]
    assert " | 80 images/s, +25.0% time vs single | ok | " in rows[2]
    assert " | 2.00 s, 9 steps, 50 images/s | ok |" in rows[5]
    assert out.strip().endswith("all rows passed")


def test_the_full_check_adds_every_mode_and_variant_and_fails_what_is_off(faked, monkeypatch, capsys, tmp_path):
    started, first_losses = faked
    first_losses["dp_amp_fp16"] = 2.3 * 1.05
    code, out, rows = run(monkeypatch, capsys, "--modes", "single,dp,ddp", "--fashion", str(tmp_path / "none"))
    assert code == 1
    variants = {f"{mode}_{variant.replace('=', '_')}" for mode in ("dp", "ddp") for variant in gpu_runs.VARIANTS}
    assert variants - set(started) == {"ddp_compile"}  # refused by the trainer's own rule, so not run
    assert "| dp, 2 device(s), generated data | the mode trains, and follows single's loss over 20 steps |" in out
    assert (
        "| ddp compile, 2 device(s) | starts from ddp's first loss | refused as designed: compile=true with mode=ddp: "
        "the compiled backward is one autograd node"
    ) in out
    failed = [line for line in out.splitlines() if line.startswith("FAILED")]
    assert failed == ["FAILED dp amp=fp16, 2 device(s): first loss 5.0e-02 from dp's (at most 0.01), last 2.3000"]


def test_preflight_skips_the_compile_rows_without_a_c_compiler(faked, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(gpu_check.shutil, "which", lambda name: None)
    code, out, _ = run(monkeypatch, capsys, "--modes", "ddp", "--fashion", str(tmp_path))
    assert "no C compiler (cc, gcc, clang): the compile variants are skipped (apt-get install gcc)" in out
    assert "compile" not in " ".join(faked[0]) and code == 0


def test_preflight_stops_where_the_package_is_not_installed(faked, monkeypatch, capsys):
    def missing(name):
        raise gpu_check.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(gpu_check.importlib.metadata, "version", missing)
    code, out, rows = run(monkeypatch, capsys, "--quick")
    assert code == 1 and rows == [] and faked[0] == []
    assert out.strip() == "gpu_check: mnist_dist is not installed (its Hydra configs come with it): pip install -e ."


def test_a_cuda_run_without_a_gpu_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--quick"])
    assert gpu_check.main() == 1
    assert "no CUDA device is visible" in capsys.readouterr().out


@pytest.mark.slow
def test_quick_passes_on_the_cpu(tmp_path):
    # What a GPU machine runs, on the CPU: the rank probes (the in-process ones need CUDA) and the trainer.
    command = [sys.executable, "-m", "mnist_dist.tools.gpu_check", "--device", "cpu", "--quick"]
    command += ["--train-images", "640", "--epochs", "1", "--fashion", str(tmp_path), "--targets", "0.3,0.5"]
    result = subprocess.run(command + ["--tta-epochs", "2"], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    names = [line.split(" | ")[0][2:] for line in result.stdout.splitlines() if line.startswith("| ")][1:]
    assert names[:4] == [
        "ddp overlap, 2 gloo ranks on one cpu",
        "BatchNorm evaluation, resnet, 2 gloo ranks on one cpu",
        "ddp gradients, 2 gloo ranks on one cpu",
        "torch_ddp gradients, 2 gloo ranks on one cpu",
    ]
    assert result.stdout.strip().endswith("all rows passed")
