"""The architecture as a tested property: the parallel library stands alone (the file people copy needing only
torch: tests/test_examples.py)."""

import subprocess
import sys


def test_the_parallel_library_imports_nothing_of_the_app():
    code = "import sys, mnist_dist.parallel.fsdp; print(sorted(m for m in sys.modules if m.startswith('mnist_dist')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    imported = eval(result.stdout)
    assert "mnist_dist.parallel.fsdp" in imported and "mnist_dist.parallel.ddp" in imported
    assert [m for m in imported if m != "mnist_dist" and not m.startswith("mnist_dist.parallel")] == []
