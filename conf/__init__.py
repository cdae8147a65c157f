# The schema and the modes' structured configs, registered with Hydra for every way of composing.
import mnist_dist.config  # noqa: F401
