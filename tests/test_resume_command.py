"""A resume needs nothing retyped: the printed command goes on with the run's own config, for every recipe at
its defaults, and a resume that changes a setting is refused naming exactly that setting."""

import os
import shlex
import signal
import subprocess
import sys

import pytest
import torch
from helpers import HANG_S, compose_config

from mnist_dist.config import ConfigError
from mnist_dist.launch import launch
from mnist_dist.model import make_scheduler
from mnist_dist.operations import checkpoint


@pytest.mark.parametrize("total_steps", [1, 2, 3, 4, 5, 8, 10])
@pytest.mark.parametrize("pct_start", [0.0, 0.1, 0.25, 0.5])
def test_one_cycle_plans_any_number_of_steps(total_steps, pct_start):
    # 0.25 x 4 steps: a warm-up that ends at step 0, which torch's OneCycleLR divides by
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    scheduler_cfg = {"_target_": "torch.optim.lr_scheduler.OneCycleLR", "_partial_": True, "max_lr": 0.01}
    scheduler, per_step = make_scheduler({**scheduler_cfg, "pct_start": pct_start}, optimizer, total_steps)
    assert per_step
    lrs = []
    for _ in range(total_steps):
        optimizer.step()
        lrs.append(scheduler.get_last_lr()[0])
        scheduler.step()
    assert all(0 < lr <= 0.01 for lr in lrs)


def cli(cwd, *args, **popen):
    return subprocess.Popen(
        [sys.executable, "-m", "mnist_dist", *args], cwd=cwd, stderr=subprocess.PIPE, text=True, **popen
    )


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "sent"), [("single", signal.SIGINT), ("ddp", signal.SIGTERM)])
def test_a_stop_mid_epoch_saves_there_and_the_printed_command_ends_as_the_uninterrupted_run(
    tiny_root, tmp_path, mode, sent
):
    # 20 steps in the only epoch; in step 3 Ctrl-C (to every process) or SIGTERM (to the command alone)
    same = [f"mode={mode}", *(["gpus=2"] if mode == "ddp" else []), "epochs=1", "batch_size=32", "log_every=4"]
    same += ["model._target_=failing_model.FailingConvNet", "+model.fail_rank=-1", "+model.step_seconds=0.05"]
    (tmp_path / "whole").mkdir()
    launch(compose_config(tiny_root, *same), tmp_path / "whole")  # the reference: no command line to test
    run = tmp_path / "run"
    where = [f"data.root={tiny_root}", "data.mirrors=[]", "progress=false", f"hydra.run.dir={run}"]
    env = {**os.environ, "INTERRUPT_AT_STEP": f"{sent.name}:3"}
    part = cli(tmp_path, *same, *where, env=env, preexec_fn=_default_sigint, start_new_session=True)
    _, err = part.communicate(timeout=HANG_S)
    assert part.returncode == 128 + sent and "Traceback" not in err, err
    state = checkpoint.load(run / "checkpoint.pt")
    assert state["epoch"] == 0 and 3 <= state["epoch_step"] < 20, err  # at a step boundary, mid-epoch
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"interrupted; the last complete checkpoint is {run}/checkpoint.pt; go on with: "), err
    command = shlex.split(last.split("go on with: ")[1])
    assert command == [sys.executable, "-m", "mnist_dist", f"resume={run}"]
    resumed = subprocess.run(command, cwd=tmp_path, stderr=subprocess.PIPE, text=True, timeout=HANG_S)
    assert resumed.returncode == 0, resumed.stderr
    expected = torch.load(tmp_path / "whole" / "model.pt")
    weights = torch.load(run / "model.pt")
    assert list(weights) == list(expected)
    assert all(torch.equal(weights[name], expected[name]) for name in expected)


@pytest.fixture(scope="module")
def trained(tiny_root, tmp_path_factory):
    """One epoch of single mode at batch_size=32 (the default is 64), with dropout (do not modify it)."""
    run_dir = tmp_path_factory.mktemp("trained")
    launch(compose_config(tiny_root, "epochs=1", "batch_size=32", "log_every=5"), run_dir)
    return run_dir


def test_a_resume_takes_the_runs_own_settings(tiny_root, trained, tmp_path, monkeypatch):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    # epochs=2 to train further; batch_size and log_every are the run's, not the defaults
    launch(compose_config(tiny_root, "epochs=2", f"resume={run_dir}"), tmp_path / "unused")
    saved = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert saved["epoch"] == 2
    assert "batch_size: 32\n" in saved["config"] and "log_every: 5\n" in saved["config"]
    assert "epochs: 2\n" in saved["config"]


def test_a_refused_resume_names_exactly_the_settings_that_differ(tiny_root, trained, tmp_path):
    with pytest.raises(ConfigError) as error:
        # batch_size=64 is the default: set, since the command line names it (the CLI passes its overrides)
        overrides = ("epochs=2", "batch_size=64", "model.dropout=false", f"resume={trained}")
        launch(compose_config(tiny_root, *overrides), tmp_path / "unused", overrides)
    assert str(error.value) == (
        "resume: this command changes what the checkpoint was trained with (model.dropout True -> False; "
        "batch_size 32 -> 64); leave model.dropout and batch_size out to go on with the run's own, or add "
        "resume_allow_changes=true if that is intended"
    )
    with pytest.raises(ConfigError) as error:  # weights that do not fit: allowing changes would not help
        launch(compose_config(tiny_root, "epochs=2", "model=fastnet", f"resume={trained}"), tmp_path / "unused")
    assert str(error.value).startswith(
        "resume: this command changes what the checkpoint was trained with (model._target_ "
        "mnist_dist.model.ConvNet -> mnist_dist.model.FastNet; model.dropout True -> (none); model.widths "
    )
    assert str(error.value).endswith("; leave model out to go on with the run's own")
