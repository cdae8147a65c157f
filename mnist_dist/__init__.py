"""mnist_dist: reproducible MNIST training in every data-parallel mode PyTorch offers."""

import os

# cuBLAS reads CUBLAS_WORKSPACE_CONFIG once, when a process first uses it, and needs a fixed workspace for
# deterministic kernels: every process of a job (the CLI, spawned workers, torchrun's, the tools) imports this first.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
