"""Config composition, the schema's errors, and validation of numbers, through Hydra and the CLI."""

import re
import subprocess
import sys

import pytest
from helpers import validate_here
from hydra import compose, initialize_config_module
from hydra.errors import HydraException
from hydra.utils import instantiate
from torch import nn

from mnist_dist.config import ConfigError, describe_hydra_error, validate
from mnist_dist.topology import from_env


def test_defaults_follow_the_classic_recipe(make_config):
    cfg = make_config()
    assert cfg.mode.name == "single"
    assert cfg.optim == {"_target_": "torch.optim.Adadelta", "_partial_": True, "lr": 1.0}
    assert cfg.scheduler == dict(_target_="torch.optim.lr_scheduler.StepLR", _partial_=True, step_size=1, gamma=0.7)
    assert (cfg.batch_size, cfg.test_batch_size, cfg.epochs, cfg.gpus) == (64, 1000, 14, 1)
    assert cfg.model == {"_target_": "mnist_dist.model.ConvNet", "dropout": True}
    assert cfg.dist.timeout_s == 60  # a hang (a stuck rank, uneven loops without join()) ends within a minute
    assert cfg.tf32 is False  # exact comparisons on a GPU need TF32 off


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["optim=sgd", "optim.momentum=0.9"], {"lr": 0.1, "momentum": 0.9}),
        # +optim.x: any constructor argument of the class
        (["optim=adamw", "+optim.betas=[0.8,0.9]"], {"lr": 0.001, "betas": [0.8, 0.9], "weight_decay": 0.01}),
    ],
)
def test_optimizer_and_scheduler_are_built_from_their_config(make_config, overrides, expected):
    cfg = make_config(*overrides, "scheduler.gamma=0.5")
    optimizer = instantiate(cfg.optim)(nn.Linear(2, 2).parameters())
    assert type(optimizer).__name__ == cfg.optim["_target_"].split(".")[-1]
    assert {key: optimizer.defaults[key] for key in expected} == {
        k: tuple(v) if isinstance(v, list) else v for k, v in expected.items()
    }
    scheduler = instantiate(cfg.scheduler)(optimizer)
    assert (type(scheduler).__name__, scheduler.gamma, scheduler.step_size) == ("StepLR", 0.5, 1)


def test_data_root_defaults_to_the_environment_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("MNIST_DIST_DATA", str(tmp_path))
    with initialize_config_module("mnist_dist.conf", version_base="1.3"):
        assert compose("config").data.root == str(tmp_path)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["epoch=3"], "'epoch' not in 'Config'; valid keys: mode,"),
        (["mode.split_at=x"], "'split_at' not in 'SingleMode'; valid keys: name$"),  # a knob of another mode
        (["amp=fp8"], "amp=fp8: Invalid value 'fp8', expected one of \\[off, bf16, fp16\\]"),
        (["epochs=abc"], "epochs=abc: Value 'abc' of type 'str' could not be converted to Integer"),
        (["mode=foo"], "mode=foo is not an option; choose one of ddp, dp, dp_block, dp_functional, fsdp, single,"),
        (["recipe=fast", "~model.dropout"], "'model.dropout' does not exist"),
        (["recipe=fast", "model.dropout=false"], "override 'model.dropout': Key 'dropout' is not in struct"),
        (["hydra.run.dir=/a\u2014b"], "hydra.run.dir=/a\u2014b"),
    ],
)
def test_composition_errors_are_one_line_naming_the_key(overrides, key):
    """What the command line prints for each (in-process: a CLI process per case costs seconds each)."""
    with initialize_config_module("mnist_dist.conf", version_base="1.3"), pytest.raises(HydraException) as error:
        compose("config", overrides=overrides)
    line = describe_hydra_error(error.value)
    assert "\n" not in line and re.search(key, line), line


@pytest.mark.parametrize("mode, other", [("ddp", "no_such_knob"), ("torch_ddp", "dp_block")])
def test_both_ddps_share_the_bucket_size_and_the_replicated_knobs(make_config, mode, other):
    shared = ("mode.bucket_cap_mb=4", "mode.find_unused_parameters=true", "mode.sync_batchnorm=true")
    cfg = make_config(f"mode={mode}", "mode.gradient_as_bucket_view=true", *shared)
    assert (cfg.mode.bucket_cap_mb, cfg.mode.find_unused_parameters, cfg.mode.sync_batchnorm) == (4, True, True)
    assert cfg.mode.gradient_as_bucket_view
    with initialize_config_module("mnist_dist.conf", version_base="1.3"), pytest.raises(HydraException) as error:
        compose("config", overrides=[f"mode={mode}", f"mode.{other}=4"])
    assert f"Key '{other}' not in" in describe_hydra_error(error.value)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["+model.dropuot=true"], "model._target_=mnist_dist.model.ConvNet takes no argument 'dropuot'"),
        (["recipe=fast", "+model.dropout=true"], "FastNet takes no argument 'dropout'.*~model.dropout"),
        (["model._target_=nowhere.Net"], "model._target_=nowhere.Net cannot be imported .*nowhere"),
        (["model._target_=collections.OrderedDict"], "model._target_=collections.OrderedDict is not a torch.nn.Module"),
    ],
)
def test_a_model_the_parent_cannot_build_is_named_before_any_worker(make_config, overrides, key):
    with pytest.raises(ConfigError, match=key):
        validate_here(make_config(*overrides))


def test_cli_composition_error_is_one_line_and_leaves_no_run_dir(tmp_path):
    # the command's own process: its __main__ block turns Hydra's error into the line; a sweep (-m) has
    # written its directory and multirun.yaml by the time its first job is composed
    command = [sys.executable, "-m", "mnist_dist", "-m", "mode=single", "mode.split_at=x,y"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "'split_at' not in 'SingleMode'" in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["mode=ddp", "gpus=2", "batch_size=63"], "batch_size=63 (global) is not divisible by 2 ranks; use a multiple"),
        (["mode=ddp", "gpus=2", "batch_size=64", "accumulate=3"], "by 2 ranks x accumulate=3; use a multiple of 6"),
        (["accumulate=0"], "accumulate=0 must be at least 1"),
        (["checkpoint_every_steps=-1"], "checkpoint_every_steps=-1 must be at least 0"),
        (["seed=-1"], "seed=-1 must be from 0 to 4294967295"),
        (["seed=4294967296"], "seed=4294967296 must be from 0 to 4294967295"),
        (["optim.lr=0"], "optim.lr=0 must be a finite positive number"),
        (["optim.lr=abc"], "optim.lr=abc must be a finite positive number"),
        (["optim.lr=nan"], "optim.lr=nan must be a finite positive number"),
        (["label_smoothing=nan"], "label_smoothing=nan must be from 0 to 1"),
        (["target_accuracy=91"], "target_accuracy=91.0 must be from 0 to 1"),
        (["dist.timeout_s=0"], "dist.timeout_s=0 must be from 1 to 604800"),
        (["dist.timeout_s=100000000000000"], "dist.timeout_s=100000000000000 must be from 1 to 604800"),
        (["mode=torch_ddp", "mode.bucket_cap_mb=nan"], "mode.bucket_cap_mb=nan must be positive (MiB), or null"),
    ],
)
def test_invalid_numbers_are_named(make_config, overrides, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        validate_here(make_config(*overrides))


def test_cli_invalid_number_is_one_line_and_leaves_no_run_dir(tmp_path, cli_in_process):
    code = cli_in_process("mode=ddp", "gpus=3", "batch_size=64", f"hydra.run.dir={tmp_path}/run")
    assert code == "error: batch_size=64 (global) is not divisible by 3 ranks; use a multiple of 3, e.g. batch_size=63"
    assert not (tmp_path / "run").exists()


def test_a_key_added_where_the_schema_has_none_is_refused(tiny_root, tmp_path, cli_in_process):
    code = cli_in_process(f"data.root={tiny_root}", "+num_workers=2", f"hydra.run.dir={tmp_path}/run")
    assert code.startswith("error: +num_workers: Config has no setting 'num_workers', so it would be ignored;")
    assert not (tmp_path / "run").exists()


def test_gpus_under_torchrun_is_what_runs_or_refused_before_the_batch_is_split_by_it(
    make_config, tiny_root, tmp_path, monkeypatch, cli_in_process
):
    from mnist_dist import launch

    torchrun = dict(RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, LOCAL_WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=29500)
    for key, value in torchrun.items():
        monkeypatch.setenv(key, str(value))
    for gpus in ("gpus=1", "gpus=2"):  # the default, or what runs
        cfg = make_config("mode=ddp", gpus, "device=cpu")
        validate(cfg, from_env(cfg))
    # torchrun's 2 processes are what runs: 64 splits among them; split among gpus=3 it was refused instead
    monkeypatch.setattr(launch, "die_with_parent", lambda: None)  # not this test process
    overrides = ["mode=ddp", "gpus=3", "batch_size=64", "device=cpu", f"data.root={tiny_root}"]
    code = cli_in_process(*overrides, f"hydra.run.dir={tmp_path}/run")  # refused before the rendezvous
    assert code.startswith("error: gpus=3, but torchrun started 2 processes, which is what runs;")
