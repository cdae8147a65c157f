"""The architecture as tested properties: the library stands alone, the training path imports no tool nor
what its mode does not need, and a new mode is one YAML and one entry in the mode table."""

import ast
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from helpers import compose_config, validate_here
from torch import nn

import mnist_dist
from mnist_dist.launch import launch
from mnist_dist.modes import MODES, Mode, Processes, register
from mnist_dist.tools import write_idx

PACKAGE = Path(mnist_dist.__file__).parent


def test_the_parallel_library_imports_nothing_of_the_app():
    code = "import sys, mnist_dist.parallel.fsdp; print(sorted(m for m in sys.modules if m.startswith('mnist_dist')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    imported = eval(result.stdout)
    assert "mnist_dist.parallel.fsdp" in imported and "mnist_dist.parallel.ddp" in imported
    assert [m for m in imported if m != "mnist_dist" and not m.startswith("mnist_dist.parallel")] == []


# What `python -m mnist_dist` runs, read in this order. The run's operations (checkpoints and resume, run
# directories, preemption, errors and the console, machine facts, downloads) go to mnist_dist/operations/,
# a tool (a benchmark, a comparison, a check, docs tooling) to mnist_dist/tools/, a wrapper to
# mnist_dist/parallel/.
TRAINING_PATH = {
    *("__init__", "__main__", "config", "modes", "topology", "launch", "train", "step", "model", "data", "metrics"),
}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return names


def test_the_top_level_is_the_training_path_and_imports_no_tool():
    assert {path.stem for path in PACKAGE.glob("*.py")} == TRAINING_PATH
    folders = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists()}
    assert folders == {"operations", "parallel", "tools"}
    for path in [*PACKAGE.glob("*.py"), *PACKAGE.glob("operations/*.py")]:
        assert not [name for name in imported_modules(path) if name.startswith("mnist_dist.tools")], path.name


def test_a_process_imports_only_what_its_mode_needs(tmp_path):
    """Every process of every run pays for its imports: torchvision (it imports torch._dynamo) only to
    fetch data, DTensor (it imports sympy) only in fsdp. Seconds of CPU each, per rank."""
    write_idx(tmp_path / "MNIST" / "raw")
    heavy = ["torchvision", "torch._dynamo", "torch.distributed.tensor", "sympy"]
    code = (
        "import sys, mnist_dist.launch, mnist_dist.train; from mnist_dist import data; "
        f"data.prepare('mnist', {str(tmp_path)!r}, []); "
        f"print([m for m in {heavy!r} if m in sys.modules])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"


@dataclass
class ToyMode:
    name: str = "toy"
    scale: float = 1.0  # a knob of its own: gradients are multiplied by it in backward


CALLS = []


def _wrap_toy(model: nn.Module, mode: ToyMode, device: torch.device, gpus: int) -> nn.Module:
    CALLS.append(mode.scale)
    for parameter in model.parameters():
        parameter.register_hook(lambda grad: grad * mode.scale)
    return model.to(device)


def test_a_new_mode_is_one_yaml_and_one_entry(tiny_root, tmp_path, monkeypatch):
    toy = Mode("toy", ToyMode, _wrap_toy, Processes.ONE)
    monkeypatch.setitem(MODES, "toy", toy)  # out of the table again after the test
    register(toy)
    (tmp_path / "conf" / "mode").mkdir(parents=True)
    (tmp_path / "conf" / "mode" / "toy.yaml").write_text(
        "defaults:\n  - /mode_schema@_here_: toy\n  - _self_\nscale: 2.0\n"
    )
    steps = ("epochs=1", "batch_size=32", "model.dropout=false")
    cfg = compose_config(tiny_root, f"hydra.searchpath=[file://{tmp_path}/conf]", "mode=toy", *steps)
    assert cfg.mode == ToyMode(name="toy", scale=2.0)
    validate_here(cfg)
    for name in ("toy", "single"):
        (tmp_path / name).mkdir()
    launch(cfg, tmp_path / "toy")
    results = json.loads((tmp_path / "toy" / "results.json").read_text())
    assert (results["mode"], results["world_size"]) == ("toy", 1)
    assert CALLS == [2.0]  # the trainer wrapped the model with the entry's function and the YAML's knob
    launch(compose_config(tiny_root, *steps), tmp_path / "single")
    toy, single = (torch.load(tmp_path / name / "model.pt") for name in ("toy", "single"))
    assert not torch.equal(toy["classifier.3.weight"], single["classifier.3.weight"])  # doubled gradients
