"""Tools around the trainer, apart from the training path: what measures, compares and checks it.

- ``check``: pre-flight check of a model in every mode (``python -m mnist_dist.tools.check``);
- ``bench``: throughput per mode and time to accuracy, interleaved (``python -m mnist_dist.tools.bench``);
- ``compare``: several modes on the same seed and batches, do they agree (``python -m mnist_dist.tools.compare``);
- ``gpu_check``: everything that needs a GPU, in one run on a GPU machine (``gpu_probes``, ``gpu_wrappers``:
  its rows that wrap models directly, in its process and on ranks; ``gpu_runs``: those that run the trainer);
- ``docs_numbers``, ``plot_trace``, ``tensorboard_screenshot.sh``: regenerate the numbers and pictures in docs/;
- ``synthetic``: small generated MNIST-format data for tests and benchmarks; ``run``: one training process.
"""
