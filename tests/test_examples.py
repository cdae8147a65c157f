"""The examples run as users run them: exit 0, a checked result. examples/mnist_ddp.py, copied alone into an
empty folder and run where mnist_dist cannot be imported, computes what the app's mode=ddp computes, under
torchrun and under its own launcher, with torch's DDP and with ours (ddp.py copied beside it)."""

import ast
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tokenize
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import compose_config, scalars

from mnist_dist.data import load_split, to_device_tensors
from mnist_dist.launch import launch
from mnist_dist.model import ConvNet, FastNet

ROOT = Path(__file__).parent.parent
MNIST_DDP = ROOT / "examples" / "mnist_ddp.py"
OUR_DDP = ROOT / "examples" / "ddp.py"  # a link to mnist_dist/parallel/ddp.py: one home
MARK = "# ADDED FOR DISTRIBUTED"
STEPS = 20  # two epochs of the tiny data (640 images, global batch 64): StepLR lowers the rate once
EPOCHS = 3  # the reference runs: a kill after the first epoch leaves two to resume
EPOCH_LINE = r"epoch (\d+): test loss ([\d.]+), accuracy ([\d.]+) %"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]  # a free port
SPAWN = [sys.executable]  # its own launcher: --nproc 2 is the default on CPU


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
    pattern = r"test MSE ([\d.]+) \(target variance ([\d.]+)\), replicas identical: True\n"
    mse, variance = map(float, re.search(pattern, result.stdout).groups())
    assert 0.4 < variance < 0.6 and mse < variance / 10
    assert result.stdout.endswith("ok\n")


@pytest.fixture(scope="module")
def app(tiny_root, tmp_path_factory) -> dict[str, list[float]]:
    """The app's scalars of mode=ddp on two CPU ranks, every step logged (launched here: a fresh process
    would only add its imports)."""
    run_dir = tmp_path_factory.mktemp("app")
    cfg = compose_config(tiny_root, "mode=ddp", "gpus=2", "device=cpu", f"epochs={STEPS // 10}", "log_every=1")
    launch(cfg, run_dir)
    return scalars(run_dir)


@pytest.fixture(scope="module")
def no_app(tmp_path_factory) -> dict[str, str]:
    """An environment in which ``import mnist_dist`` fails: a package of that name, ahead of site-packages
    (where this checkout is installed), that raises."""
    blocker = tmp_path_factory.mktemp("blocker") / "mnist_dist"
    blocker.mkdir()
    (blocker / "__init__.py").write_text(
        'raise ImportError("mnist_dist is blocked: the copied files must not need it")\n'
    )
    env = {**os.environ, "PYTHONPATH": str(blocker.parent)}
    # Run away from the checkout, whose mnist_dist/ a script's folder (or -c's cwd) would put on the path.
    check = subprocess.run(
        [sys.executable, "-c", "import torch, mnist_dist"], cwd=blocker, env=env, capture_output=True, text=True
    )
    assert check.returncode == 1 and "ImportError: mnist_dist is blocked" in check.stderr, check.stderr
    return env


def alone(folder: Path, *files: Path) -> Path:
    """``files`` copied (links followed, as ``cp`` does) into the new empty ``folder``; the first one's copy."""
    folder.mkdir()
    for file in files:
        shutil.copyfile(file, folder / file.name)
    return folder / files[0].name


def example_args(script: Path, tiny_root: Path, out: Path, *extra: str, epochs: int = EPOCHS) -> list[str]:
    """The example's arguments on the tiny data, everything it writes going to ``out``."""
    out.mkdir(exist_ok=True)
    args = [str(script), "--data", str(tiny_root / "MNIST" / "raw"), "--dataset", "mnist", "--epochs", str(epochs)]
    return args + [f"--{name}={out / file}" for name, file in EXAMPLE_FILES.items()] + list(extra)


EXAMPLE_FILES = {"log-losses": "losses.txt", "save": "model.pt", "checkpoint": "checkpoint.pt"}


def run_example(launcher: list[str], args: list[str], env: dict | None = None) -> dict:
    """One run of the example (in its own folder); what it wrote and printed."""
    script = Path(args[0])
    out = Path(next(a for a in args if a.startswith("--save=")).removeprefix("--save=")).parent
    result = subprocess.run([*launcher, *args], cwd=script.parent, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    losses = [float(line) for line in (out / "losses.txt").read_text().splitlines()]
    epochs = [tuple(map(float, m.groups())) for m in re.finditer(EPOCH_LINE, result.stdout)]
    weights = torch.load(out / "model.pt")
    return {"losses": losses, "epochs": epochs, "stdout": result.stdout, "weights": weights, "out": out}


@pytest.fixture(scope="module")
def torch_ddp(tiny_root, no_app, tmp_path_factory) -> dict[str, dict]:
    """examples/mnist_ddp.py alone in an empty folder, no mnist_dist: under its own launcher and torchrun."""
    tmp = tmp_path_factory.mktemp("alone")
    runs = {}
    for name, launcher in {"spawn": SPAWN, "torchrun": TORCHRUN}.items():
        script = alone(tmp / name, MNIST_DDP)
        runs[name] = run_example(launcher, example_args(script, tiny_root, tmp / f"{name}_out"), no_app)
    return runs


def assert_the_apps_run(run: dict, app: dict) -> None:
    """``run``'s first STEPS losses and two epochs are the app's (TensorBoard keeps float32)."""
    assert len(app["train/loss_global"]) == STEPS and len(run["losses"]) >= STEPS
    assert max(abs(a - b) for a, b in zip(run["losses"], app["train/loss_global"])) < 1e-5
    for (epoch, loss, accuracy), app_loss, app_accuracy in zip(run["epochs"], app["test/loss"], app["test/accuracy"]):
        assert abs(loss - app_loss) < 1e-4 and abs(accuracy - 100 * app_accuracy) < 1e-2, epoch


@pytest.mark.slow
def test_mnist_ddp_alone_computes_the_apps_ddp_run_under_either_launcher(torch_ddp, app):
    spawned, torchrun = torch_ddp["spawn"], torch_ddp["torchrun"]
    assert len(spawned["losses"]) == EPOCHS * STEPS // 2
    assert spawned["losses"] == torchrun["losses"]  # the same processes, however started
    assert spawned["epochs"] == torchrun["epochs"] and len(spawned["epochs"]) == EPOCHS
    assert_the_apps_run(spawned, app)
    assert spawned["losses"][STEPS - 1] < spawned["losses"][0] / 4
    assert spawned["stdout"].count("\n") == EPOCHS  # one line per epoch, from rank 0 only


# Our DDP beside the example, the two files copied alone (no mnist_dist to import), under torchrun: the command
# the docs give. examples/ddp.py is a link to the package's file: one home.
@pytest.mark.slow
def test_mnist_ddp_with_our_ddp_copied_beside_it_alone_computes_the_apps_run(tiny_root, no_app, app, tmp_path):
    assert OUR_DDP.is_symlink() and os.readlink(OUR_DDP) == "../mnist_dist/parallel/ddp.py"
    script = alone(tmp_path / "alone", MNIST_DDP, OUR_DDP)
    run = run_example(TORCHRUN, example_args(script, tiny_root, tmp_path / "out", "--ddp", "ours", epochs=2), no_app)
    assert_the_apps_run(run, app)


@pytest.mark.slow
def test_mnist_ddp_saves_weights_that_load_into_the_apps_convnet(torch_ddp):
    weights = torch_ddp["spawn"]["weights"]
    ConvNet().load_state_dict(weights)  # strict: the same names, no "module."
    assert all(torch.equal(weights[k], torch_ddp["torchrun"]["weights"][k]) for k in weights)


@pytest.mark.slow
def test_mnist_ddp_trains_batchnorm_through_a_sampler_and_reports_the_accuracy_of_what_it_saves(
    tiny_root, no_app, tmp_path
):
    # One run, two properties: --loader's batches (a DistributedSampler's share each), and FastNet, whose ranks'
    # BatchNorm statistics differ, evaluated and saved as rank 0's.
    script = alone(tmp_path / "alone", MNIST_DDP)
    args = example_args(script, tiny_root, tmp_path / "out", "--loader", "--model", "fastnet", epochs=2)
    run = run_example(TORCHRUN, args, no_app)
    assert len(run["losses"]) == STEPS and len(run["epochs"]) == 2  # 320 images a rank: 10 batches of 32
    assert run["losses"][-1] < run["losses"][0] / 4 and run["epochs"][-1][2] > 90
    model = FastNet()
    model.load_state_dict(run["weights"])  # strict: the app's FastNet, buffers included
    x, y = to_device_tensors(*load_split(tiny_root / "MNIST" / "raw", train=False), 0.1307, 0.3081, "cpu")
    with torch.no_grad():
        logits = model.eval()(x)
    _, loss, accuracy = run["epochs"][-1]
    assert f"{100 * (logits.argmax(1) == y).double().mean().item():.2f}" == f"{accuracy:.2f}"
    assert abs(F.cross_entropy(logits, y).item() - loss) <= 0.5e-4 + 1e-6  # the 4 decimals it prints


@pytest.mark.slow
def test_mnist_ddp_killed_after_an_epoch_resumes_to_the_uninterrupted_weights(torch_ddp, tiny_root, no_app, tmp_path):
    script = alone(tmp_path / "alone", MNIST_DDP)
    args = example_args(script, tiny_root, tmp_path / "out")
    checkpoint = tmp_path / "out" / "checkpoint.pt"
    # Killed as a machine failure kills it (every rank at once, SIGKILL), once the first checkpoint is there.
    first = subprocess.Popen([*SPAWN, *args], cwd=script.parent, env=no_app, start_new_session=True)
    while not checkpoint.exists() and first.poll() is None:
        time.sleep(0.01)
    os.killpg(first.pid, signal.SIGKILL)
    assert first.wait(timeout=60) == -signal.SIGKILL  # killed before it finished
    epoch = torch.load(checkpoint)["epoch"]
    assert 1 <= epoch < EPOCHS
    resumed = run_example(SPAWN, args, no_app)
    assert resumed["stdout"].startswith(f"resuming after epoch {epoch} of {EPOCHS} from ")
    assert [e for e, *_ in resumed["epochs"]] == list(range(epoch + 1, EPOCHS + 1))
    assert resumed["losses"] == torch_ddp["spawn"]["losses"][epoch * STEPS // 2 :]
    reference = torch_ddp["spawn"]["weights"]
    assert all(torch.equal(resumed["weights"][k], reference[k]) for k in reference)


def rerun_beside(checkpoint: Path, tiny_root: Path, tmp_path: Path, *extra: str, env: dict):
    """The example run alone with ``extra`` arguments beside a copy of ``checkpoint``."""
    script = alone(tmp_path / "alone", MNIST_DDP)
    args = example_args(script, tiny_root, tmp_path / "out", *extra)
    shutil.copyfile(checkpoint, tmp_path / "out" / "checkpoint.pt")
    return subprocess.run([*SPAWN, *args], cwd=script.parent, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("setting", [("--lr", "0.5"), ("--nproc", "1")])  # what trains, and the world
def test_mnist_ddp_refuses_in_one_line_a_checkpoint_of_other_settings(setting, torch_ddp, tiny_root, no_app, tmp_path):
    finished = torch_ddp["spawn"]["out"] / "checkpoint.pt"
    result = rerun_beside(finished, tiny_root, tmp_path, *setting, env=no_app)
    assert result.returncode == 1 and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and setting[0] in result.stderr, result.stderr
    assert (tmp_path / "out" / "checkpoint.pt").read_bytes() == finished.read_bytes()  # kept as it was
    assert not (tmp_path / "out" / "model.pt").exists()


@pytest.mark.slow
def test_mnist_ddp_refuses_in_one_line_a_checkpoint_that_records_no_settings(torch_ddp, tiny_root, no_app, tmp_path):
    state = torch.load(torch_ddp["spawn"]["out"] / "checkpoint.pt")
    state.pop("settings", None)  # as an older example or another script wrote it
    torch.save(state, tmp_path / "foreign.pt")
    result = rerun_beside(tmp_path / "foreign.pt", tiny_root, tmp_path, env=no_app)
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1 and "settings" in result.stderr


@pytest.mark.slow
def test_mnist_ddp_beside_its_finished_checkpoint_says_so_and_trains_nothing(torch_ddp, tiny_root, no_app, tmp_path):
    result = rerun_beside(torch_ddp["spawn"]["out"] / "checkpoint.pt", tiny_root, tmp_path, env=no_app)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 1 and "finished" in result.stdout
    assert not (tmp_path / "out" / "model.pt").exists() and not (tmp_path / "out" / "losses.txt").exists()


def ranks_of(launcher: int) -> list[int]:
    """The processes ``launcher`` spawned as ranks (its children running multiprocessing's spawn_main)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            command = (stat.parent / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):  # it exited meanwhile
            continue
        if parent == launcher and b"spawn_main" in command:
            pids.append(int(stat.parent.name))
    return pids


def running(pid: int) -> bool:
    """Whether ``pid`` is a process that still runs (not gone, not a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("to", ["launcher", "group"])  # a SIGINT to the launcher alone; Ctrl-C in a terminal
def test_mnist_ddp_interrupted_stops_every_rank_and_says_so_in_one_line(to, tiny_root, no_app, tmp_path):
    script = alone(tmp_path / "alone", MNIST_DDP)
    checkpoint = tmp_path / "out" / "checkpoint.pt"
    command = [*SPAWN, *example_args(script, tiny_root, tmp_path / "out", epochs=10_000)]
    launcher = subprocess.Popen(
        command,
        cwd=script.parent,
        env=no_app,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal gives a job
    )
    ranks = []
    try:
        while not checkpoint.exists() and launcher.poll() is None:  # the ranks train
            time.sleep(0.05)
        ranks = ranks_of(launcher.pid)
        assert len(ranks) == 2
        (os.kill if to == "launcher" else os.killpg)(launcher.pid, signal.SIGINT)
        _, stderr = launcher.communicate(timeout=120)
        survivors = [pid for pid in ranks if running(pid)]
    finally:
        for pid in [launcher.pid, *ranks]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
    assert survivors == []
    assert launcher.returncode == 130 and len(stderr.splitlines()) == 1 and "interrupted" in stderr, stderr
    assert torch.load(checkpoint)["epoch"] >= 1  # the last whole epoch's, whole


YOUR_DATA = '''def load_data(folder, dataset, split):
    """Not MNIST: noise in which the label is the row that is bright."""
    generator = torch.Generator().manual_seed(int(split == "train"))
    labels = torch.randint(10, (640 if split == "train" else 200,), generator=generator)
    images = torch.randn(len(labels), 1, 28, 28, generator=generator)
    images[torch.arange(len(labels)), 0, 2 * labels] += 3
    return images, labels
'''


@pytest.mark.slow
def test_mnist_ddp_trains_on_other_data_when_its_one_marked_data_function_is_rewritten(no_app, tmp_path):
    script = alone(tmp_path / "alone", MNIST_DDP)
    lines = script.read_text().splitlines(keepends=True)
    marked = [
        node
        for node in ast.parse(script.read_text()).body
        if isinstance(node, ast.FunctionDef) and "YOUR DATA" in lines[node.lineno - 2]
    ]
    assert len(marked) == 1, "one function, marked YOUR DATA on the line above it"
    start, end = marked[0].lineno - 1, marked[0].end_lineno
    script.write_text("".join(lines[:start]) + YOUR_DATA + "".join(lines[end:]))
    out = tmp_path / "out"
    args = example_args(script, tmp_path / "nowhere", out, epochs=2)  # a --data folder that does not exist
    run = run_example(SPAWN, args, no_app)
    assert len(run["losses"]) == 20 and run["epochs"][-1][2] > 90


def code_lines(path: Path) -> dict[int, str]:
    """Each line's code without its comment; docstrings left out."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef) and ast.get_docstring(node) is not None:
            docstrings.update(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    lines: dict[int, str] = {}
    with path.open() as f:
        for token in tokenize.generate_tokens(f.readline):
            if token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE) and token.start[0] not in docstrings:
                lines[token.start[0]] = lines.get(token.start[0], "") + " " + token.string
    return lines


# What only a distributed script says: ranks, world size, torch.distributed, the launchers, the wrappers.
DISTRIBUTED = re.compile(
    r"rank|RANK|world_size|WORLD_SIZE|\bdist\b|torchrun|spawn|nproc|\bmp\b|multiprocessing|MASTER_|Distributed|"
    r"free_port|socket|\.module\b|\bddp\b"
)


def test_mnist_ddp_marks_every_line_that_mentions_distribution():
    text = MNIST_DDP.read_text().splitlines()
    unmarked = [
        f"{n}: {text[n - 1]}"
        for n, code in code_lines(MNIST_DDP).items()
        if DISTRIBUTED.search(code) and MARK not in text[n - 1]
    ]
    assert not unmarked, "\n".join(unmarked)
    marked = sum(MARK in line for line in text)
    assert f"lists them, {marked} lines" in ast.get_docstring(ast.parse(MNIST_DDP.read_text())).replace("\n", " ")


def imported(path: Path) -> set[str]:
    """The top-level modules ``path`` imports (a relative import counts as "." )."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." if node.level else (node.module or "").split(".")[0])
    return names - set(sys.stdlib_module_names)


def test_mnist_ddp_imports_only_the_standard_library_and_torch():
    assert imported(MNIST_DDP) == {"torch", "ddp"}  # ddp: our DDP's file, only for --ddp ours


def test_our_ddp_is_one_file_that_imports_only_torch():
    assert imported(OUR_DDP) == {"torch"}


def load_example():
    spec = importlib.util.spec_from_file_location("mnist_ddp_example", MNIST_DDP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("launched_by", ["torchrun", "itself"])
def test_mnist_ddp_with_more_ranks_than_gpus_says_so_in_one_line(launched_by, tiny_root, monkeypatch, capsys):
    example = load_example()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with one GPU, faked
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    argv = ["mnist_ddp.py", "--data", str(tiny_root / "MNIST" / "raw"), "--device", "cuda"]
    if launched_by == "torchrun":  # torchrun --nproc_per_node=2 sets these in both ranks
        for name, value in {"RANK": 1, "LOCAL_RANK": 1, "WORLD_SIZE": 2, "LOCAL_WORLD_SIZE": 2}.items():
            monkeypatch.setenv(name, str(value))
    else:
        argv += ["--nproc", "2"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit:
        example.parse_args()
    assert exit.value.code == (
        "error: 2 ranks on this machine, 1 GPU(s); start at most 1 (--nproc, torchrun --nproc_per_node) "
        "or use --device cpu"
    )
    assert capsys.readouterr().err == ""  # nothing else: the message is the whole of it


def test_slurm_sbatch_says_when_the_ranks_stop_as_preemption_does():
    # mnist_dist/operations/preemption.py: a vote after every step, read one step later.
    comment = " ".join(line.lstrip("# ") for line in (ROOT / "examples" / "slurm.sbatch").read_text().splitlines())
    assert "log_every" not in comment and "vote after every step" in comment
    # a failed task ends the others at once; without it they wait in a collective until dist.timeout_s
    assert "srun --kill-on-bad-exit=1 python -m mnist_dist" in comment


def test_the_docs_copy_the_files_the_tests_run():
    # the command the tests run: both files into an empty folder
    text = (ROOT / "docs" / "CONVERTING.md").read_text()
    assert (
        "cp examples/mnist_ddp.py examples/ddp.py ~/mine/ && cd ~/mine\ntorchrun --nproc_per_node=2 mnist_ddp.py"
        in text
    )
