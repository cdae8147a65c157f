"""The trainer end to end on tiny data: what it writes, and that every mode computes the same thing."""

import json

import pytest
import torch
from helpers import compose_config, events, scalars

from mnist_dist.data import load_split, to_device_tensors
from mnist_dist.launch import launch
from mnist_dist.model import ConvNet
from mnist_dist.step import evaluate

RANK_TAGS = {"train/loss", "perf/images_per_s"}  # written by rank 0 for every rank r as rank_<r>/<tag>
RUN_TAGS = {
    "train/loss_global",
    "perf/images_per_s_global",
    "train/lr",
    "perf/epoch_time_s",
    "test/loss",
    "test/accuracy",
    "test/accuracy_by_train_ms",  # the same accuracies against training milliseconds
    "results/images_per_s",
}


def rank_tags(world_size: int) -> set[str]:
    return {f"rank_{r}/{tag}" for r in range(world_size) for tag in RANK_TAGS}


def run(make_config, run_dir, *overrides):
    run_dir.mkdir(parents=True, exist_ok=True)
    launch(make_config(*overrides), run_dir)
    return json.loads((run_dir / "results.json").read_text())


def test_single_run_learns_and_writes_everything(make_config, tmp_path):
    results = run(make_config, tmp_path, "epochs=3", "log_every=2", "warmup_steps=2")
    assert results["mode"] == "single" and results["world_size"] == 1 and results["device"] == "cpu"
    assert (results["epochs"], results["batch_size"]) == (3, 64)
    assert results["test_accuracy"] >= 0.9 and results["train_images_per_s"] > 0
    assert results["wall_time_s"] > 0 and results["test_loss"] < 1.0
    tb = scalars(tmp_path)
    assert set(tb) == RUN_TAGS | rank_tags(1)
    assert len(tb["rank_0/train/loss"]) == 15  # 3 epochs x 10 steps, every 2nd step
    assert tb["rank_0/train/loss"][-1] < 0.5 * tb["rank_0/train/loss"][0]
    assert tb["rank_0/train/loss"] == tb["train/loss_global"]  # one rank: the global mean is its own
    assert tb["test/accuracy"][-1] == results["test_accuracy"]
    assert tb["train/lr"][0] == 1.0 and tb["train/lr"][-1] == pytest.approx(0.49)  # StepLR 0.7 twice
    assert tb["results/images_per_s"] == [pytest.approx(results["train_images_per_s"])]
    assert set(events(tmp_path).PluginTagToContent("hparams")) == {
        "_hparams_/experiment",
        "_hparams_/session_start_info",
        "_hparams_/session_end_info",
    }
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert (checkpoint["epoch"], checkpoint["step"]) == (3, 30)
    final = torch.load(tmp_path / "model.pt")
    assert all(torch.equal(final[k], checkpoint["model"][k]) for k in final)
    ConvNet().load_state_dict(final)  # no "module." prefix to strip
    assert "epoch 3: test loss" in (tmp_path / "rank_0.log").read_text()
    assert "batch_size: 64" in (tmp_path / "config.yaml").read_text()


def test_a_profiled_step_names_its_forward_backward_and_optimizer(make_config, tmp_path):
    # The split of a step's time that every mode shows alike: ranges in the step's own code, in the trace.
    run(make_config, tmp_path, "epochs=1", "warmup_steps=1", "profile=true")
    events = json.loads((tmp_path / "trace_rank0.json").read_text())["traceEvents"]
    ranges = [event["name"] for event in events if event.get("cat") == "user_annotation"]
    assert {"forward", "backward", "optimizer"} <= set(ranges)
    assert ranges.count("forward") == ranges.count("optimizer")  # one of each per profiled step


@pytest.fixture(scope="module")
def twenty_steps(tmp_path_factory, tiny_root):
    """Final weights of single, ddp and torch_ddp after the same 20 steps, dropout off."""
    out = {}
    for mode in ("single", "ddp", "torch_ddp"):
        run_dir = tmp_path_factory.mktemp(mode)
        cfg = compose_config(
            tiny_root,
            f"mode={mode}",
            "gpus=2",
            "epochs=1",
            "batch_size=32",
            "model.dropout=false",
            # SGD, not Adadelta: Adadelta divides by a running RMS of the gradients, which turns fp32
            # rounding (one batch mean vs two half-batch means) into differences that outgrow 1e-5 in
            # 20 steps on some CPUs; SGD keeps them at rounding size, and unlike Adadelta it would show
            # gradients summed instead of averaged (REFERENCE.md).
            "optim=sgd",
            "optim.lr=0.05",
            *(["mode.bucket_cap_mb=0.05"] if mode == "ddp" else []),  # several buckets
        )
        launch(cfg, run_dir)
        out[mode] = (torch.load(run_dir / "model.pt"), run_dir)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "torch_ddp"])
def test_distributed_modes_match_single_after_20_steps(twenty_steps, mode):
    single, _ = twenty_steps["single"]
    weights, run_dir = twenty_steps[mode]
    assert torch.load(run_dir / "checkpoint.pt", weights_only=False)["step"] == 20
    torch.manual_seed(1)  # the config's seed: the weights every mode starts from
    start = ConvNet(dropout=False).state_dict()
    assert (weights["classifier.3.weight"] - start["classifier.3.weight"]).abs().max() > 1e-3
    for name, value in weights.items():
        torch.testing.assert_close(value, single[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.slow
def test_our_ddp_matches_torch_ddp_after_20_steps(twenty_steps):
    ours, _ = twenty_steps["ddp"]
    theirs, _ = twenty_steps["torch_ddp"]
    for name, value in ours.items():
        torch.testing.assert_close(value, theirs[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.slow
def test_distributed_evaluation_is_exact(twenty_steps, tiny_root):
    weights, run_dir = twenty_steps["ddp"]
    results = json.loads((run_dir / "results.json").read_text())
    model = ConvNet(dropout=False)
    model.load_state_dict(weights)
    x, y = to_device_tensors(*load_split(tiny_root / "MNIST" / "raw", train=False), 0.1307, 0.3081, "cpu")
    loss, accuracy = evaluate(model, x, y, 1000, rank=0, world_size=1)
    assert results["test_accuracy"] == accuracy  # every test sample counted once, none twice
    assert results["test_loss"] == pytest.approx(loss, rel=1e-6)
    # One TensorBoard run per training run: rank 0 writes every rank's numbers into <run>/tb.
    assert {path.parent for path in run_dir.rglob("events.out.tfevents.*")} == {run_dir / "tb"}
    tb = scalars(run_dir)
    assert set(tb) == RUN_TAGS | rank_tags(2)
    assert tb["rank_0/train/loss"] != tb["rank_1/train/loss"]  # each rank's own share of the batch
    mean = [(a + b) / 2 for a, b in zip(tb["rank_0/train/loss"], tb["rank_1/train/loss"], strict=True)]
    assert tb["train/loss_global"] == pytest.approx(mean, rel=1e-6)  # TensorBoard keeps float32
