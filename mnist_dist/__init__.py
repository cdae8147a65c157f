"""mnist_dist: reproducible MNIST training in every data-parallel mode PyTorch offers."""

import os

# cuBLAS reads CUBLAS_WORKSPACE_CONFIG once, when a process first uses it, and needs a fixed workspace for
# deterministic kernels: importing this package is the first thing every process of a job does (the CLI,
# spawned workers, torchrun's, the tools), so it is set here. Set only if the environment does not choose one.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
