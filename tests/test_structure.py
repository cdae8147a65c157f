"""The architecture as tested properties: the library stands alone, and a process imports only what its mode
needs."""

import subprocess
import sys

from mnist_dist.tools.synthetic import write_idx


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
