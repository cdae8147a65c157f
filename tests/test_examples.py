"""The examples run as users run them (ddp_regression's worker under the launcher it uses), with a checked result.
examples/mnist_ddp.py, copied alone into an empty folder (with ddp.py, as docs/CONVERTING.md says) and run where
mnist_dist cannot be imported, computes what the app's mode=ddp computes; stopped and started again, it ends with
the uninterrupted run's weights."""

import ast
import contextlib
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import alive, children, compose_config, scalars

from mnist_dist.launch import launch
from mnist_dist.model import ConvNet, FastNet
from mnist_dist.parallel import spawn
from mnist_dist.tools import write_idx

ROOT = Path(__file__).parent.parent
MNIST_DDP = ROOT / "examples" / "mnist_ddp.py"
OUR_DDP = ROOT / "examples" / "ddp.py"  # a link to mnist_dist/parallel/ddp.py: one home
STEPS_PER_EPOCH = 4  # 256 images, global batch 64
EPOCHS = 3  # a stop after the first or second epoch leaves one to resume, at the rate StepLR lowered
EPOCH_LINE = r"epoch (\d+): test loss ([\d.]+), accuracy ([\d.]+) %"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]  # a free port
SPAWN = [sys.executable]  # its own launcher: --nproc 2 is the default on CPU
EXAMPLE_FILES = {"log-losses": "losses.txt", "save": "model.pt", "checkpoint": "checkpoint.pt"}


def _regression_rank(rank: int, world_size: int, printed: str) -> None:
    """examples/ddp_regression.py's worker, as its launcher runs it, what it prints going to a file."""
    import ddp_regression  # examples/ is on the path

    with open(Path(printed, f"{rank}.txt"), "w") as out, contextlib.redirect_stdout(out):
        ddp_regression.worker(rank, world_size)


@pytest.mark.slow
def test_ddp_regression_learns_on_two_cpu_ranks(tmp_path, monkeypatch):
    # Its worker under its launcher's spawn, forked from the tests' server (it raises if it did not learn)
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    spawn(_regression_rank, 2, str(tmp_path), start_method="forkserver")
    pattern = r"test MSE ([\d.]+) \(target variance ([\d.]+)\), replicas identical: True\n"
    mse, variance = map(float, re.fullmatch(pattern, (tmp_path / "0.txt").read_text()).groups())
    assert 0.4 < variance < 0.6 and mse < variance / 10
    assert (tmp_path / "1.txt").read_text() == ""  # one rank reports


@pytest.fixture(scope="module")
def small_root(tmp_path_factory) -> Path:
    """A data.root of 256 training and 50 test images: most of a run here is starting its processes."""
    root = tmp_path_factory.mktemp("small")
    write_idx(root / "MNIST" / "raw", n_train=256, n_test=50)
    return root


@pytest.fixture(scope="module")
def no_app(tmp_path_factory) -> dict[str, str]:
    """An environment in which ``import mnist_dist`` fails: a package of that name, ahead of site-packages
    (where this checkout is installed), that raises."""
    blocker = tmp_path_factory.mktemp("blocker") / "mnist_dist"
    blocker.mkdir()
    (blocker / "__init__.py").write_text('raise ImportError("mnist_dist is blocked")\n')
    env = {**os.environ, "PYTHONPATH": str(blocker.parent)}
    # Run away from the checkout, whose mnist_dist/ -c's cwd would put first on the path.
    check = subprocess.run(
        [sys.executable, "-c", "import mnist_dist"], cwd=blocker.parent, env=env, capture_output=True, text=True
    )
    assert "mnist_dist is blocked" in check.stderr, check.stderr
    return env


def example_args(script: Path, data: Path, out: Path, *extra: str, epochs: int = EPOCHS) -> list[str]:
    """The example's arguments on the tiny data, everything it writes going to ``out``."""
    out.mkdir(exist_ok=True)
    args = [str(script), "--data", str(data / "MNIST" / "raw"), "--dataset", "mnist", "--epochs", str(epochs)]
    return args + [f"--{name}={out / file}" for name, file in EXAMPLE_FILES.items()] + list(extra)


def run_example(launcher: list[str], args: list[str], env: dict) -> dict:
    """One run of the example (in its own folder); what it wrote and printed."""
    script = Path(args[0])
    out = Path(next(a for a in args if a.startswith("--save=")).removeprefix("--save=")).parent
    result = subprocess.run([*launcher, *args], cwd=script.parent, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    losses = [float(line) for line in (out / "losses.txt").read_text().splitlines()]
    epochs = [tuple(map(float, m.groups())) for m in re.finditer(EPOCH_LINE, result.stdout)]
    return {"losses": losses, "epochs": epochs, "stdout": result.stdout, "weights": torch.load(out / "model.pt")}


@pytest.mark.slow
def test_mnist_ddp_alone_stopped_and_started_again_computes_the_apps_ddp_run(small_root, no_app, tmp_path):
    # The uninterrupted run: the app's mode=ddp, bit for bit what the example computes (the same kernels,
    # batches and sums), every step logged.
    (tmp_path / "app").mkdir()
    launch(
        compose_config(small_root, "mode=ddp", "gpus=2", "device=cpu", f"epochs={EPOCHS}", "log_every=1"),
        tmp_path / "app",
    )
    app, app_weights = scalars(tmp_path / "app"), torch.load(tmp_path / "app" / "model.pt")
    assert len(app["train/loss_global"]) == EPOCHS * STEPS_PER_EPOCH
    # First our DDP (--ddp ours) under the file's own launcher, stopped by a SIGINT to the launcher alone (a
    # terminal's Ctrl-C reaches the ranks too: the same stop) once it has saved its first epoch.
    (tmp_path / "alone").mkdir()
    for file in (MNIST_DDP, OUR_DDP):  # the link followed, as cp does
        shutil.copyfile(file, tmp_path / "alone" / file.name)
    alone = tmp_path / "alone" / MNIST_DDP.name
    args = example_args(alone, small_root, tmp_path / "out", "--ddp", "ours")
    checkpoint = tmp_path / "out" / "checkpoint.pt"
    launcher = subprocess.Popen(
        [*SPAWN, *args], cwd=alone.parent, env=no_app, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    ranks = []
    try:
        while not checkpoint.exists() and launcher.poll() is None:  # the ranks train
            time.sleep(0.01)
        ranks = children(launcher.pid, "spawn_main")  # its ranks
        os.kill(launcher.pid, signal.SIGINT)
        stdout, stderr = launcher.communicate(timeout=120)
        survivors = [pid for pid in ranks if alive(pid)]
    finally:
        for pid in [launcher.pid, *ranks]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert len(ranks) == 2 and survivors == []
    assert launcher.returncode == 130 and len(stderr.splitlines()) == 1 and "interrupted" in stderr, stderr
    epoch = torch.load(checkpoint)["epoch"]  # the last whole epoch's, whole
    assert 1 <= epoch < EPOCHS
    # Then the docs' command, as torchrun --max-restarts would start it again: torch's DDP, the two files alone.
    assert (
        "cp examples/mnist_ddp.py examples/ddp.py ~/mine/ && cd ~/mine\ntorchrun --nproc_per_node=2 mnist_ddp.py"
        in (ROOT / "docs" / "CONVERTING.md").read_text()
    )
    resumed = run_example(TORCHRUN, args[: args.index("--ddp")], no_app)
    assert resumed["stdout"].startswith(f"resuming after epoch {epoch} of {EPOCHS} from ")
    assert resumed["stdout"].count("\n") == 1 + EPOCHS - epoch  # and a line an epoch, rank 0's
    saved = [tuple(map(float, m.groups())) for m in re.finditer(EPOCH_LINE, stdout)][:epoch]  # then stopped
    epochs = saved + resumed["epochs"]
    assert [e for e, *_ in epochs] == list(range(1, EPOCHS + 1))
    for (_, loss, accuracy), app_loss, app_accuracy in zip(epochs, app["test/loss"], app["test/accuracy"], strict=True):
        assert abs(loss - app_loss) < 1e-4 and abs(accuracy - 100 * app_accuracy) < 1e-2  # as printed
    steps = app["train/loss_global"][epoch * STEPS_PER_EPOCH :]
    assert max(abs(a - b) for a, b in zip(resumed["losses"], steps, strict=True)) < 1e-5  # TensorBoard: float32
    ConvNet().load_state_dict(resumed["weights"])  # strict: the app's names, no "module."
    assert all(torch.equal(resumed["weights"][k], app_weights[k]) for k in app_weights)


YOUR_DATA = '''def load_data(folder, dataset, split):
    """Not MNIST: noise in which the label is the row that is bright."""
    generator = torch.Generator().manual_seed(int(split == "train"))
    labels = torch.randint(10, (256 if split == "train" else 100,), generator=generator)
    images = torch.randn(len(labels), 1, 28, 28, generator=generator)
    images[torch.arange(len(labels)), 0, 2 * labels] += 3
    return images, labels
'''


@pytest.mark.slow
def test_mnist_ddp_trains_its_rewritten_data_function_batchnorm_and_a_sampler_and_reports_what_it_saves(
    no_app, tmp_path
):
    # Three properties, one run: the one function marked YOUR DATA rewritten (a --data folder that does not
    # exist), --loader's batches (a DistributedSampler's share each), and FastNet, whose ranks' BatchNorm
    # statistics differ, evaluated and saved as rank 0's.
    (tmp_path / "alone").mkdir()
    script = tmp_path / "alone" / MNIST_DDP.name
    lines = MNIST_DDP.read_text().splitlines(keepends=True)
    (marked,) = [
        node
        for node in ast.parse(MNIST_DDP.read_text()).body
        if isinstance(node, ast.FunctionDef) and "YOUR DATA" in lines[node.lineno - 2]
    ]
    script.write_text("".join(lines[: marked.lineno - 1]) + YOUR_DATA + "".join(lines[marked.end_lineno :]))
    args = example_args(script, tmp_path / "nowhere", tmp_path / "out", "--loader", "--model", "fastnet", epochs=2)
    run = run_example(TORCHRUN, args, no_app)
    assert len(run["losses"]) == 2 * STEPS_PER_EPOCH and len(run["epochs"]) == 2  # 128 images a rank: 4 batches of 32
    assert run["losses"][-1] < run["losses"][0] / 4 and run["epochs"][-1][2] > 90
    model = FastNet()
    model.load_state_dict(run["weights"])  # strict: the app's FastNet, buffers included
    namespace = {"torch": torch}
    exec(YOUR_DATA, namespace)
    x, y = namespace["load_data"](None, "mnist", "test")
    with torch.no_grad():
        logits = model.eval()(x)
    _, loss, accuracy = run["epochs"][-1]
    assert f"{100 * (logits.argmax(1) == y).double().mean().item():.2f}" == f"{accuracy:.2f}"
    assert abs(F.cross_entropy(logits, y).item() - loss) <= 0.5e-4 + 1e-6  # the 4 decimals it prints


def load_example():
    spec = importlib.util.spec_from_file_location("mnist_ddp_example", MNIST_DDP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mnist_ddp_refuses_a_checkpoint_of_other_settings_and_stops_at_a_finished_one(
    tiny_root, tmp_path, monkeypatch, capsys
):
    # Checked in the launching process, before any rank starts: here, in-process.
    example = load_example()
    args = example_args(MNIST_DDP, tiny_root, tmp_path)
    monkeypatch.setattr(sys, "argv", args)
    settings = example.settings(example.parse_args())
    checkpoint = tmp_path / "checkpoint.pt"
    cases = [  # (checkpoint, extra arguments): exit code, the key its one line names
        ({"settings": settings, "epoch": 1}, ["--lr", "0.5"], 1, "--lr"),  # what trains
        ({"settings": settings, "epoch": 1}, ["--nproc", "1"], 1, "--nproc"),  # the world
        ({"epoch": 1}, [], 1, "records no settings"),  # another script's
        ({"settings": settings, "epoch": EPOCHS}, [], 0, "finished"),
        (b"hi\n", [], 1, "is not a checkpoint"),  # a file from elsewhere
        (b"PK\x03\x04", [], 1, "is not a checkpoint"),  # a zip torch.save cut short
    ]
    for state, extra, code, key in cases:
        checkpoint.write_bytes(state) if isinstance(state, bytes) else torch.save(state, checkpoint)
        saved = checkpoint.read_bytes()
        monkeypatch.setattr(sys, "argv", args + extra)
        with pytest.raises(SystemExit) as exit_:
            example.main()
        printed = capsys.readouterr()
        (line,) = (printed.err if code else printed.out).splitlines()
        assert exit_.value.code == code and key in line, line
        assert checkpoint.read_bytes() == saved and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


POSITIVE = "must be a positive number"


@pytest.mark.parametrize("option, value, phrase", [
    ("--epochs", "0", POSITIVE), ("--batch-size", "0", POSITIVE), ("--lr", "-1", POSITIVE), ("--lr", "nan", POSITIVE),
    ("--nproc", "0", POSITIVE), ("--nproc", "-1", POSITIVE), ("--batch-size", "100000", "training images"),
    ("--checkpoint", "missing/c.pt", "does not exist"), ("--save", "missing/m.pt", "does not exist"),
    ("--log-losses", "missing/l.txt", "does not exist"),
])  # fmt: skip
def test_mnist_ddp_refuses_bad_arguments_in_one_line(option, value, phrase, tiny_root, tmp_path, monkeypatch, capsys):
    # Refused as the arguments are read: not by a traceback in each rank, after an epoch, or by an exit 0 with no step.
    monkeypatch.setattr(sys, "argv", example_args(MNIST_DDP, tiny_root, tmp_path, option, value))
    with pytest.raises(SystemExit) as exit_:
        load_example().parse_args()
    line = capsys.readouterr().err.splitlines()[-1]
    assert exit_.value.code == 2 and option in line and phrase in line, line
    assert list(tmp_path.iterdir()) == []


def test_mnist_ddp_with_more_ranks_than_gpus_says_so_in_one_line(tiny_root, monkeypatch, capsys):
    example = load_example()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with one GPU, faked
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    argv = ["mnist_ddp.py", "--data", str(tiny_root / "MNIST" / "raw"), "--device", "cuda"]
    for name, value in {"RANK": 1, "LOCAL_RANK": 1, "WORLD_SIZE": 2, "LOCAL_WORLD_SIZE": 2}.items():
        monkeypatch.setenv(name, str(value))  # as torchrun --nproc_per_node=2 sets them in both ranks
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_:
        example.parse_args()
    assert "2 ranks on this machine, 1 GPU(s)" in exit_.value.code and "\n" not in exit_.value.code
    assert capsys.readouterr().err == ""  # nothing else: the message is the whole of it


def imported(path: Path) -> set[str]:
    """The top-level modules ``path`` imports (a relative import counts as "." )."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." if node.level else (node.module or "").split(".")[0])
    return names - set(sys.stdlib_module_names)


def test_the_files_people_copy_import_only_the_standard_library_and_torch():
    assert imported(MNIST_DDP) == {"torch", "ddp"}  # ddp: our DDP's file, only for --ddp ours
    assert imported(OUR_DDP) == {"torch"}
    assert OUR_DDP.is_symlink() and os.readlink(OUR_DDP) == "../mnist_dist/parallel/ddp.py"  # one home
