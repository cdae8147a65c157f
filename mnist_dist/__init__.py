"""mnist_dist: reproducible MNIST training in every data-parallel mode PyTorch offers."""

import os
import sys

# cuBLAS reads CUBLAS_WORKSPACE_CONFIG once, when a process first uses it, and needs a fixed workspace for
# deterministic kernels: importing this package is the first thing every process of a job does (the CLI,
# spawned workers, torchrun's, the tools), so it is set here rather than when a run starts, which may follow
# CUDA work in the same process (compare, check, tests). Set only if the environment does not choose one.
CUBLAS_SET_LATE = False  # CUDA had started in this process before the variable was set
if "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
    _torch = sys.modules.get("torch")  # imported already by whoever imports this package; never imported here
    CUBLAS_SET_LATE = _torch is not None and _torch.cuda.is_initialized()
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
