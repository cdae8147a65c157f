"""The examples run as users run them: exit 0, a checked result. examples/mnist_ddp.py computes what the
app computes, under torchrun and under our launcher, with our DDP and with torch's."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import scalars

from mnist_dist.model import ConvNet

ROOT = Path(__file__).parent.parent
MNIST_DDP = ROOT / "examples" / "mnist_ddp.py"
# The one line that the docstring of examples/mnist_ddp.py says to change for torch's DDP.
OUR_DDP = "    model = parallel.DistributedDataParallel(model)  # ADDED FOR DISTRIBUTED\n"
TORCH_DDP = "    model = torch.nn.parallel.DistributedDataParallel(model)  # ADDED FOR DISTRIBUTED\n"
STEPS = 20  # two epochs of the tiny data (640 images, global batch 64): StepLR lowers the rate once
EPOCH_LINE = r"epoch (\d+): test loss ([\d.]+), accuracy ([\d.]+) %"


@pytest.mark.slow
def test_ddp_regression_learns_on_two_cpu_ranks(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "ddp_regression.py")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    mse, variance = map(
        float,
        re.search(
            r"test MSE ([\d.]+) \(target variance ([\d.]+)\), replicas identical: "
            r"True\n",
            result.stdout,
        ).groups(),
    )
    assert 0.4 < variance < 0.6 and mse < variance / 10
    assert result.stdout.endswith("ok\n")


@pytest.fixture(scope="module")
def app(tiny_root, tmp_path_factory) -> dict[str, list[float]]:
    """The app's scalars of mode=ddp on two CPU ranks, every step logged."""
    run_dir = tmp_path_factory.mktemp("app") / "run"
    command = [sys.executable, "-m", "mnist_dist", "mode=ddp", "gpus=2", "device=cpu", f"epochs={STEPS // 10}"]
    result = subprocess.run(
        [
            *command,
            f"data.root={tiny_root}",
            "data.mirrors=[]",
            "log_every=1",
            "progress=false",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=run_dir.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return scalars(run_dir)


def run_example(script: Path, launcher: list[str], tiny_root: Path, out: Path) -> dict:
    """``script`` on the tiny data for STEPS steps (of 3 epochs: --max-steps stops it); what it wrote and printed."""
    out.mkdir()
    args = ["--data", str(tiny_root / "MNIST" / "raw"), "--dataset", "mnist", "--epochs", "3"]
    args += ["--max-steps", str(STEPS), "--log-losses", str(out / "losses.txt"), "--save", str(out / "model.pt")]
    result = subprocess.run([*launcher, str(script), *args], cwd=out, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    losses = [float(line) for line in (out / "losses.txt").read_text().splitlines()]
    epochs = [tuple(map(float, m.groups())) for m in re.finditer(EPOCH_LINE, result.stdout)]
    return {"losses": losses, "epochs": epochs, "stdout": result.stdout, "weights": torch.load(out / "model.pt")}


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]  # a free port


@pytest.fixture(scope="module")
def examples(tiny_root, tmp_path_factory) -> dict[str, dict]:
    """examples/mnist_ddp.py under our launcher and under torchrun, and with torch's DDP (the documented
    one-line change) under torchrun."""
    tmp = tmp_path_factory.mktemp("examples")
    text = MNIST_DDP.read_text()
    docstring = ast.get_docstring(ast.parse(text))
    assert OUR_DDP.strip() in docstring and TORCH_DDP.strip() in docstring  # the swap it documents
    assert text.count(OUR_DDP) == 2  # the docstring's and the code's
    (tmp / "torch_ddp.py").write_text(text.replace(OUR_DDP, TORCH_DDP))
    return {
        "spawn": run_example(MNIST_DDP, [sys.executable], tiny_root, tmp / "spawn"),  # --nproc 2, the default on CPU
        "torchrun": run_example(MNIST_DDP, TORCHRUN, tiny_root, tmp / "torchrun"),
        "torch_ddp": run_example(tmp / "torch_ddp.py", TORCHRUN, tiny_root, tmp / "torch_ddp"),
    }


@pytest.mark.slow
def test_mnist_ddp_computes_the_apps_ddp_run_under_either_launcher(examples, app):
    spawned, torchrun = examples["spawn"], examples["torchrun"]
    assert len(spawned["losses"]) == len(app["train/loss_global"]) == STEPS
    assert spawned["losses"] == torchrun["losses"]  # the same processes, however started
    assert spawned["epochs"] == torchrun["epochs"] and len(spawned["epochs"]) == 2  # --max-steps ended epoch 2
    # The mean over the ranks, as the app logs it (TensorBoard keeps float32).
    assert max(abs(a - b) for a, b in zip(spawned["losses"], app["train/loss_global"])) < 1e-5
    assert spawned["losses"][-1] < spawned["losses"][0] / 4
    for (epoch, loss, accuracy), app_loss, app_accuracy in zip(
        spawned["epochs"], app["test/loss"], app["test/accuracy"]
    ):
        assert abs(loss - app_loss) < 1e-4 and abs(accuracy - 100 * app_accuracy) < 1e-2, epoch
    assert spawned["stdout"].count("\n") == 2  # one line per epoch, from rank 0 only


@pytest.mark.slow
def test_mnist_ddp_with_torch_ddp_gives_the_same_numbers(examples):
    ours, torch_ddp = examples["torchrun"], examples["torch_ddp"]
    assert len(torch_ddp["losses"]) == STEPS
    assert max(abs(a - b) for a, b in zip(ours["losses"], torch_ddp["losses"])) < 1e-5


@pytest.mark.slow
def test_mnist_ddp_saves_weights_that_load_into_the_apps_convnet(examples):
    weights = examples["spawn"]["weights"]
    ConvNet().load_state_dict(weights)  # strict: the same names, no "module."
    assert all(torch.equal(weights[k], examples["torchrun"]["weights"][k]) for k in weights)
