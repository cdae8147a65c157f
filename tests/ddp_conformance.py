"""PyTorch's own DDP tests (the installed wheel's distributed_test.py, on CPU with gloo and 2 ranks), each run with
torch's DistributedDataParallel and with ours swapped in for it in each spawned rank. Its own command (docs/ddp.md):

    pytest -n 0 tests/ddp_conformance.py

Most of the file's DDP tests need CUDA; those on CPU that need what ours does not claim are skipped with the reason.
"""

import os
import tempfile

import pytest

os.environ.setdefault("BACKEND", "gloo")  # read when distributed_test is imported
os.environ.setdefault("WORLD_SIZE", "2")

pytest.importorskip("expecttest", reason="torch's test helpers need it: pip install expecttest")
import torch  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402

import mnist_dist.parallel.ddp as ours  # noqa: E402

pytestmark = [pytest.mark.conformance, pytest.mark.slow]

# Each of the file's tests that builds a DDP and passes with torch's on CPU (11 in torch 2.14.1): here or below
IN_SCOPE = [
    "test_DistributedDataParallelCPU",
    "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad",
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_grad_is_view",
    "test_ddp_create_graph",
    "test_grads_same_across_ranks_with_no_sync",
]
OUT_OF_SCOPE = {
    "test_ddp_logging_data_cpu": "reads torch's private reducer (_get_ddp_logging_data)",
    "test_static_graph_api_cpu": "static_graph, which ours refuses",
    "test_accumulate_gradients_no_sync_allreduce_hook": "register_comm_hook, which ours has not",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook": "register_comm_hook, which ours has not",
    "test_ddp_has_finalized": "needs CUDA devices",  # kept as a test: torch's setUp names it
}
Base = distributed_test.DistributedTest._DistTestBase


@pytest.fixture(autouse=True)
def restore_torch_flags():
    """conftest.py's, off here: torch's test case freezes the cuDNN flags that fixture restores."""
    yield


@pytest.fixture(autouse=True)
def store_files_in_tmp_path(tmp_path, monkeypatch):
    """torch's test case leaves its FileStore files in the temp folder: here, pytest's ``tmp_path``."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def _suite(name: str, swap: bool) -> type:
    """A TestCase of torch's that holds only the chosen tests; ``swap``: ours stands in for torch's DDP."""

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):  # in each spawned rank, before the test body
        if swap:
            torch.nn.parallel.DistributedDataParallel = ours.DistributedDataParallel
            distributed_test.DistributedDataParallel = ours.DistributedDataParallel
        distributed_test.TestDistBackend._run.__func__(cls, rank, test_name, file_name, pipe, **kwargs)

    def setUp(self):
        distributed_test.TestDistBackend.setUp(self)
        self._spawn_processes()

    hidden = {attr: None for attr in dir(Base) if attr.startswith("test_")}
    chosen = {attr: getattr(Base, attr) for attr in IN_SCOPE}
    skipped = {attr: pytest.mark.skip(reason=why)(getattr(Base, attr)) for attr, why in OUT_OF_SCOPE.items()}
    body = hidden | chosen | skipped | {"_run": _run, "setUp": setUp, "__module__": __name__, "__qualname__": name}
    return type(name, (distributed_test.TestDistBackend, Base), body)


TestTorchDDP = _suite("TestTorchDDP", swap=False)
TestOurDDP = _suite("TestOurDDP", swap=True)
