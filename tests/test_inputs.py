"""Issue 38: settings and launcher variables that were checked by type only, or not at all, are one line
naming the setting. Each test failed on commit ee05943."""

import pytest
from helpers import validate_here

from mnist_dist.config import ConfigError, validate
from mnist_dist.topology import from_env


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lr=abc", "optim.lr=abc must be a finite positive number"),
        ("label_smoothing=nan", "label_smoothing=nan must be in [0, 1), e.g. 0.1"),
        ("label_smoothing=-1", "label_smoothing=-1.0 must be in [0, 1), e.g. 0.1"),
        ("dist.port=-1", "dist.port=-1 must be a TCP port, 1 to 65535, or 0 to pick a free one"),
        ("dist.port=70000", "dist.port=70000 must be a TCP port, 1 to 65535, or 0 to pick a free one"),
        ("dist.timeout_s=100000000000000", "dist.timeout_s=100000000000000 must be from 1 to 604800 (seconds: a week)"),
        ("mode=torch_ddp mode.bucket_cap_mb=nan", "mode.bucket_cap_mb=nan must be positive (MiB), or null"),
        ("optim.lr=nan", "optim.lr=nan must be a finite positive number"),
        ("optim.lr=inf", "optim.lr=inf must be a finite positive number"),
        ("dist.timeout_s=0", "dist.timeout_s=0 must be from 1 to 604800 (seconds: a week)"),
    ],
)
def test_a_setting_out_of_range_is_one_line_naming_it(make_config, override, message):
    with pytest.raises(ConfigError) as error:
        validate_here(make_config(*override.split()))
    assert str(error.value).startswith(message)


def test_a_key_added_where_the_schema_has_none_is_refused(tiny_root, tmp_path, cli_in_process):
    code = cli_in_process(f"data.root={tiny_root}", "+num_workers=2", f"hydra.run.dir={tmp_path}/run")
    assert code.startswith("error: +num_workers: Config has no setting 'num_workers', so it would be ignored;")
    assert not (tmp_path / "run").exists()


TORCHRUN = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_gpus_under_torchrun_is_what_runs_or_refused(make_config, monkeypatch):
    for key, value in {**TORCHRUN, "RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    cfg = make_config("mode=ddp", "gpus=3", "device=cpu")
    with pytest.raises(ConfigError, match="gpus=3, but torchrun started 2 processes, which is what runs"):
        validate(cfg, from_env(cfg))
    for gpus in ("gpus=1", "gpus=2"):  # the default, or what runs
        cfg = make_config("mode=ddp", gpus, "device=cpu")
        validate(cfg, from_env(cfg))


def test_gpus_under_torchrun_is_refused_before_the_batch_is_split_by_it(
    tiny_root, tmp_path, monkeypatch, cli_in_process
):
    # torchrun's 2 processes are what runs: 64 splits among them; split among gpus=3 it was refused instead
    from mnist_dist import launch

    for key, value in {**TORCHRUN, "RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(launch, "die_with_parent", lambda: None)  # not this test process
    overrides = ["mode=ddp", "gpus=3", "batch_size=64", "device=cpu", f"data.root={tiny_root}"]
    code = cli_in_process(*overrides, f"hydra.run.dir={tmp_path}/run")  # refused before the rendezvous
    assert (
        code == "error: gpus=3, but torchrun started 2 processes, which is what runs; leave gpus= out (or pass gpus=2)"
    )
