import logging
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mnist_dist.tools import write_idx

# Spawned ranks unpickle test functions by module name, and workers import test models by
# _target_: keep tests/ importable as a plain folder, in this process and in subprocesses.
TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))

# pytest-xdist runs one worker per core, and each worker's trainings (in-process or a fresh single process)
# would take torch's default of a thread per core: N workers' threads on N cores, where each parallel region
# waits for its slowest, descheduled thread. A worker and the processes it starts share its cores instead;
# spawned ranks set their own (topology.setup_process), and `-n 0` keeps torch's default.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from helpers import compose_config  # noqa: E402  (needs tests/ on the path)


@pytest.fixture(scope="session", autouse=True)
def forkserver_with_what_every_rank_imports():
    """The forkserver that every rank and command this test process starts (run_ranks, in-process launches,
    helpers.command) forks from, started now with what each would otherwise import again, seconds of CPU apiece:
    torch._dynamo (torch's optimizers import it at their first step), torch's state-dict API (at the first
    checkpoint), the app with its command line, and helpers. A private
    name is the tests' to use, not the package's. Started as mnist_dist.parallel.spawn starts it, Ctrl-C blocked;
    spawn's own preload list then goes unused."""
    preload = ["torch", "torch._dynamo", "torch.distributed.checkpoint.state_dict", "mnist_dist.__main__", "helpers"]
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    multiprocessing.resource_tracker.ensure_running()
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


@pytest.fixture(autouse=True)
def restore_torch_flags():
    """The trainer sets process-wide flags (deterministic kernels, cuDNN, threads); an in-process run
    must not change what the next test sees."""
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.get_num_threads(),
    )
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul  # the TF32 policy, legacy flags first
    tf32 = (cudnn.allow_tf32, matmul.allow_tf32, cudnn.conv.fp32_precision, matmul.fp32_precision)
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]
    torch.set_num_threads(saved[4])
    cudnn.allow_tf32, matmul.allow_tf32 = tf32[:2]
    cudnn.conv.fp32_precision, matmul.fp32_precision = tf32[2:]


@pytest.fixture(autouse=True)
def restore_logging():
    """Hydra's job logging, run in-process, adds handlers to loggers (a file in that run's directory): the next
    test must not log into a directory that is gone."""
    loggers = [logging.getLogger(), logging.getLogger("mnist_dist")]
    saved = [(logger, logger.handlers[:], logger.level, logger.propagate) for logger in loggers]
    yield
    for logger, handlers, level, propagate in saved:
        for handler in set(logger.handlers) - set(handlers):
            handler.close()
        logger.handlers[:], logger.level, logger.propagate = handlers, level, propagate


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    """A data.root holding tiny learnable data as data=mnist (640 train, 200 test images)."""
    root = tmp_path_factory.mktemp("data")
    write_idx(root / "MNIST" / "raw")
    return root


@pytest.fixture
def make_config(tiny_root):
    """make_config("mode=ddp", ...) -> compose_config on the tiny data."""
    return lambda *overrides: compose_config(tiny_root, *overrides)


@pytest.fixture
def one_rank(tmp_path):
    """A process group of this process alone: code that needs one (fully_shard, SyncBatchNorm) runs
    in-process, in a second, instead of in spawned ranks."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def cli_in_process(monkeypatch):
    """``python -m mnist_dist <argv>``'s main() in this process (no torch import to pay): returns what it
    exits with. Its signal handlers are the command's: put back afterwards."""
    from mnist_dist import __main__ as command
    from mnist_dist.operations.errors import STOP_SIGNALS

    handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}

    def run(*argv: str):
        monkeypatch.setattr(sys, "argv", ["mnist_dist", *argv])
        with pytest.raises(SystemExit) as exit_:
            command.main()
        return exit_.value.code

    yield run
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
