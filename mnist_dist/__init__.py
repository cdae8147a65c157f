"""mnist_dist: reproducible MNIST training in every data-parallel mode PyTorch offers."""
