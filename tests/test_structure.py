"""The architecture as tested properties: the library stands alone, and a process imports only what its mode
needs."""

import ast
import subprocess
import sys
from pathlib import Path

import mnist_dist
from mnist_dist.tools import write_idx


def test_the_parallel_library_imports_nothing_of_the_app():
    code = "import sys, mnist_dist.parallel.fsdp; print(sorted(m for m in sys.modules if m.startswith('mnist_dist')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    imported = eval(result.stdout)
    assert "mnist_dist.parallel.fsdp" in imported and "mnist_dist.parallel.ddp" in imported
    assert [m for m in imported if m != "mnist_dist" and not m.startswith("mnist_dist.parallel")] == []


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


def test_the_package_names_nothing_private_of_torch():
    """No ``torch._x``, ``from torch._x import``, or ``._x`` read off a name imported from torch (the project's
    rule: private API changes without notice)."""
    found = []
    for path in Path(mnist_dist.__file__).parent.rglob("*.py"):
        tree, from_torch = ast.parse(path.read_text()), set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                module = getattr(node, "module", None) or ""
                for alias in node.names:
                    full = f"{module}.{alias.name}" if module else alias.name
                    if full.split(".")[0] == "torch":
                        from_torch.add((alias.asname or alias.name).split(".")[0])
                        found += [f"{path.name}: import {full}" for part in full.split(".") if _private(part)]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in from_torch:
                    found.append(f"{path.name}:{node.lineno}: {root.id}...{node.attr}")
    assert found == [], found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")
