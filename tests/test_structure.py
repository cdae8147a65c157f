"""The architecture as tested properties: the parallel library stands alone (the file people copy needing only
torch: tests/test_examples.py), and the package uses only torch's public API."""

import ast
import subprocess
import sys
from pathlib import Path

import mnist_dist


def test_the_parallel_library_imports_nothing_of_the_app():
    code = "import sys, mnist_dist.parallel.fsdp; print(sorted(m for m in sys.modules if m.startswith('mnist_dist')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    imported = eval(result.stdout)
    assert "mnist_dist.parallel.fsdp" in imported and "mnist_dist.parallel.ddp" in imported
    assert [m for m in imported if m != "mnist_dist" and not m.startswith("mnist_dist.parallel")] == []


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
