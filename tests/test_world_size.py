"""Any world size, exactly: the global batch fixes the training, so a job gives one process's curve on any
number of ranks in every mode, and a checkpoint written on 2 ranks resumes on 2 bit for bit, and on 3, or on 1
under torchrun, at the exact global sample where it stopped."""

import json
import shutil
import socket

import pytest
import torch
from failing_model import NarrowConvNet
from helpers import HANG_S, command, compose_config, scalars

from mnist_dist.launch import launch
from mnist_dist.operations import checkpoint
from mnist_dist.tools import write_idx

# 48 images per step divide among 1, 2 and 3 ranks; SGD and no dropout: nothing depends on the ranks. Momentum:
# optimizer state to shard (fsdp) and to resume; rounding stays at its own size (see REFERENCE.md). The narrow
# convnet: what is proven does not depend on the model's width, and most of a run would be its arithmetic.
JOB = ("epochs=2", "batch_size=48", "optim=sgd", "optim.lr=0.05", "optim.momentum=0.9", "model.dropout=false")
JOB += ("model._target_=failing_model.NarrowConvNet",)
# 288 images: 6 steps an epoch, saved at 4, 6, 8 and 12; checkpoint.1.pt is step 8, mid-epoch 2
JOB += ("log_every=1", "checkpoint_every_steps=4")
RUNS = {
    "single": (),
    "ddp": ("mode=ddp", "gpus=2"),
    "fsdp": ("mode=fsdp", "gpus=2"),
    "torch_ddp": ("mode=torch_ddp", "gpus=3"),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A data.root with few images: a run's time is mostly its images' forward and backward passes."""
    data = tmp_path_factory.mktemp("data")
    write_idx(data / "MNIST" / "raw", n_train=288, n_test=50)
    return data


def train(root, run_dir, *overrides):
    run_dir.mkdir(parents=True, exist_ok=True)
    launch(compose_config(root, *JOB, *overrides), run_dir, overrides)
    return torch.load(run_dir / "model.pt")


def assert_close_weights(found: dict, expected: dict) -> None:
    assert found.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(found[key], value, rtol=0, atol=1e-5, msg=key)


def shard_mib(ranks: int) -> float:
    """The MiB of one rank's shard of the weights: each tensor's rows split among the ranks, padded to equal parts."""
    state = NarrowConvNet().state_dict().values()
    return sum(-(-len(value) // ranks) * value[0].numel() for value in state) * 4 / 2**20


def losses(run_dir) -> torch.Tensor:
    return torch.tensor(scalars(run_dir)["train/loss_global"])  # the mean over ranks


@pytest.fixture(scope="module")
def runs(root, tmp_path_factory):
    """The job uninterrupted, each mode in its own directory."""
    out = tmp_path_factory.mktemp("world_size")
    for name, overrides in RUNS.items():
        train(root, out / name, *overrides)
    return out


@pytest.mark.slow
def test_the_same_job_gives_one_processs_curve_and_weights_on_several_ranks(runs):
    single, weights = losses(runs / "single"), torch.load(runs / "single" / "model.pt")
    assert len(single) == 12
    torch.manual_seed(1)  # the config's seed: the weights every mode starts from
    start = NarrowConvNet(dropout=False).state_dict()
    assert (weights["classifier.3.weight"] - start["classifier.3.weight"]).abs().max() > 1e-3  # it trained
    for mode in ("ddp", "fsdp", "torch_ddp"):
        torch.testing.assert_close(losses(runs / mode), single, rtol=0, atol=1e-5, msg=mode)
        assert_close_weights(torch.load(runs / mode / "model.pt"), weights)  # fsdp's: full tensors, plain keys
    saved = torch.load(runs / "fsdp" / "checkpoint.pt", weights_only=True)
    assert saved["step"] == 12 and set(saved["optimizer"]["state"]) == set(weights)  # full, by parameter name


@pytest.mark.slow
def test_rank_0_writes_every_ranks_scalars_into_one_tensorboard_run(runs):
    run_dir = runs / "ddp"
    assert {path.parent for path in run_dir.rglob("events.out.tfevents.*")} == {run_dir / "tb"}
    tb, single = scalars(run_dir), scalars(runs / "single")
    assert set(tb) - set(single) == {"rank_1/train/loss", "rank_1/perf/images_per_s"} and set(single) <= set(tb)
    assert tb["rank_0/train/loss"] != tb["rank_1/train/loss"]  # each rank's own share of the batch
    mean = [(a + b) / 2 for a, b in zip(tb["rank_0/train/loss"], tb["rank_1/train/loss"], strict=True)]
    assert tb["train/loss_global"] == pytest.approx(mean, rel=1e-6)  # TensorBoard keeps float32


@pytest.mark.slow
def test_fsdp_holds_a_shard_of_the_state_per_rank(runs):
    mib = {name: json.loads((runs / name / "results.json").read_text())["model_state_mib"] for name in RUNS}
    weights = shard_mib(1)
    assert mib["single"] == [pytest.approx(3 * weights)]  # weights, gradients, momentum
    assert mib["ddp"] == [pytest.approx(3 * weights)] * 2  # each rank all of it
    assert all(3 * weights / 2 <= per_rank <= 3 * shard_mib(2) for per_rank in mib["fsdp"])


@pytest.mark.slow
# ddp on 2 ranks, bit for bit (dropout on, restarted by torchrun and requeued by SLURM): test_launch.py; ddp on
# 1 rank: the torchrun test below
@pytest.mark.parametrize("mode,ranks", [("fsdp", 2), ("fsdp", 3)])
def test_a_mid_epoch_checkpoint_resumes_on_any_number_of_ranks(root, runs, tmp_path, mode, ranks):
    saved = runs / mode / "checkpoint.1.pt"
    state = checkpoint.load(saved)
    assert (state["world_size"], state["epoch"], state["epoch_step"], state["step"]) == (2, 1, 2, 8)
    (tmp_path / "run").mkdir()
    shutil.copyfile(saved, tmp_path / "run" / "checkpoint.pt")
    resumed = train(root, tmp_path / "run", f"mode={mode}", f"gpus={ranks}", "resume=auto")
    whole, part = losses(runs / mode)[8:], losses(tmp_path / "run")  # steps 9 to 12
    if ranks == 2:  # where it was written: bit for bit
        assert torch.equal(part, whole)
        assert all(torch.equal(value, resumed[key]) for key, value in torch.load(runs / mode / "model.pt").items())
    else:
        torch.testing.assert_close(part, whole, rtol=0, atol=1e-5)
        assert_close_weights(resumed, torch.load(runs / mode / "model.pt"))
    if mode == "fsdp":  # a shard of weights, gradients and momentum each
        mib = json.loads((tmp_path / "run" / "results.json").read_text())["model_state_mib"]
        assert all(3 * shard_mib(1) / ranks <= per_rank <= 3 * shard_mib(ranks) for per_rank in mib)


@pytest.mark.slow
def test_a_torchrun_worker_goes_on_at_the_world_size_torchrun_gives_it(root, runs, tmp_path):
    """What an elastic job's node that is left does (torchrun restarts its worker in a world of one): the 2-rank
    checkpoint resumed on 1 rank, whatever gpus the checkpoint says, ends as the uninterrupted 2-rank run."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copyfile(runs / "ddp" / "checkpoint.1.pt", run_dir / "checkpoint.pt")
    # The variables torchrun gives its one worker (its own agent adds nothing to what the app does)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torchrun = {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": 1, "LOCAL_WORLD_SIZE": 1, "MASTER_ADDR": "127.0.0.1"}
    env = {key: str(value) for key, value in {**torchrun, "MASTER_PORT": port}.items()}
    argv = ["mode=ddp", "resume=auto", f"data.root={root}", "data.mirrors=[]", "progress=false"]
    worker = command([*argv, f"hydra.run.dir={run_dir}"], tmp_path, env, output=tmp_path / "worker.out")
    worker.join(timeout=HANG_S)
    output = (tmp_path / "worker.out").read_text()
    assert worker.exitcode == 0, output
    results = json.loads((run_dir / "results.json").read_text())
    assert (results["world_size"], results["steps"]) == (1, 12)
    assert "resuming with mode=ddp on 1 ranks a checkpoint written with mode=ddp on 2" in output
    assert "\ngpus: 1\n" in (run_dir / "config.yaml").read_text()  # what ran, not the checkpoint's gpus=2
    assert_close_weights(torch.load(run_dir / "model.pt"), torch.load(runs / "ddp" / "model.pt"))
