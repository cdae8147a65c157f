"""What a checkpoint guarantees (docs/troubleshooting.md): it cannot run code and its config is read without resolving
anything; no fault leaves the last good checkpoint unreadable, none holds weights that are not finite, and
resume=auto gets past an unreadable newest one. Also: a resume goes on with the run's own settings, and one that
changes a setting, or would replace a run, is refused writing nothing."""

import errno
import io
import json
import logging
import os
import shutil
import sys
import threading
from pathlib import Path

import pytest
import torch
import yaml
from helpers import compose_config

from mnist_dist.config import ConfigError
from mnist_dist.launch import _resume, launch
from mnist_dist.operations import checkpoint, files, report
from mnist_dist.operations.errors import setup_logging
from mnist_dist.operations.rundir import HYDRA_OWN
from mnist_dist.step import TrainingDiverged

# 640 tiny images at batch 32: 20 steps an epoch
SHORT = ("epochs=1", "batch_size=32")
FAILING = ("model._target_=failing_model.FailingConvNet", "+model.fail_rank=0")


def contents(run: Path) -> dict:
    """What the run wrote; Hydra's own record of the latest launch (.hydra/, mnist_dist.log) is Hydra's."""
    written = [p for p in sorted(run.rglob("*")) if p.is_file() and p.stat().st_size]
    return {str(p.relative_to(run)): p.read_bytes() for p in written if p.relative_to(run).parts[0] not in HYDRA_OWN}


def saved_step(path: Path) -> int:
    state = torch.load(path, weights_only=True)
    assert all(t.isfinite().all() for t in state["model"].values() if t.is_floating_point()), path
    return state["step"]


# --- 1. a checkpoint cannot run code --------------------------------------------------------------


class _RunsCode:
    """Unpickling this runs code: what a crafted checkpoint.pt would do."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_a_crafted_checkpoint_runs_nothing_and_is_one_line(tmp_path):
    marker = tmp_path / "code_ran"
    torch.save({"model": {}, "step": 1, "x": _RunsCode(str(marker))}, tmp_path / "c.pt")
    with pytest.raises(ConfigError, match="tensors and plain values") as error:
        checkpoint.load(tmp_path / "c.pt")
    assert not marker.exists()
    assert "weights_only" not in str(error.value)  # torch's advice to load it anyway, i.e. to run the code
    assert "\n" not in str(error.value)


# --- 2. no fault leaves the last good checkpoint unreadable -----------------------------------------


class _Full(io.FileIO):
    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class _Interrupted(io.FileIO):
    def write(self, data):
        super().write(bytes(data)[: len(data) // 2])
        raise KeyboardInterrupt  # Ctrl-C, or SIGTERM turned into an exception, half way through the bytes


@pytest.mark.parametrize("fault, raised", [(_Full, OSError), (_Interrupted, KeyboardInterrupt)], ids=["full", "ctrl-c"])
def test_a_save_that_fails_half_way_leaves_the_last_good_checkpoints(tmp_path, monkeypatch, fault, raised):
    path = tmp_path / "checkpoint.pt"
    for step in (1, 2):
        checkpoint.save({"step": step}, path, keep_previous=True)
    (tmp_path / ".checkpoint.pt.tmp").write_bytes(b"half")  # what a write killed by a signal leaves
    monkeypatch.setattr(files, "open", fault, raising=False)  # the temp file files.write opens
    with pytest.raises(raised) as error:
        checkpoint.save({"step": 3, "weights": torch.zeros(10**6)}, path, keep_previous=True)
    monkeypatch.undo()
    assert raised is KeyboardInterrupt or error.value.filename == str(path)  # what the one line names
    assert torch.load(path, weights_only=True) == {"step": 2}
    assert torch.load(tmp_path / "checkpoint.1.pt", weights_only=True) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.1.pt", "checkpoint.pt"]


# --- 3. no checkpoint from unchecked weights ---------------------------------------------------


def test_a_nan_loss_between_log_windows_is_never_checkpointed(tiny_root, tmp_path):
    # log_every=5 checks the loss at step 5 only: steps 3 and 4 (NaN weights) must not rotate the good ones away
    cfg = compose_config(tiny_root, *SHORT, "log_every=5", "checkpoint_every_steps=1", *FAILING, "+model.nan=true")
    with pytest.raises(TrainingDiverged, match=r"loss is nan at step 3 \(rank 0\); lower optim.lr"):
        launch(cfg, tmp_path)
    assert saved_step(tmp_path / "checkpoint.pt") == 2 and saved_step(tmp_path / "checkpoint.1.pt") == 1


def test_weights_poisoned_by_a_step_with_a_finite_loss_are_never_checkpointed(tiny_root, tmp_path):
    # nan_grad: step 4's loss is finite, its update makes every weight NaN; step 4 is a checkpoint step.
    settings = ("log_every=10", "checkpoint_every_steps=2", *FAILING, "+model.fail_step=4", "+model.nan_grad=true")
    cfg = compose_config(tiny_root, *SHORT, *settings)
    with pytest.raises(TrainingDiverged, match=r"weights are not finite after step 4 \(rank 0"):
        launch(cfg, tmp_path)
    assert saved_step(tmp_path / "checkpoint.pt") == 2 and not (tmp_path / "checkpoint.1.pt").exists()


def test_divergence_at_the_last_step_fails_the_run_and_writes_no_results(tiny_root, tmp_path):
    cfg = compose_config(tiny_root, *SHORT, *FAILING, "+model.fail_step=20", "+model.nan_grad=true")
    with pytest.raises(TrainingDiverged, match=r"test loss is nan after step 20 "):
        launch(cfg, tmp_path)
    assert {p.name for p in tmp_path.iterdir()} & {"results.json", "model.pt", "checkpoint.pt"} == set()


def test_results_json_is_strict_json(tmp_path):
    inf = float("inf")
    report.save_json({"loss": float("nan"), "times": [inf, 1.5], "peak": {"x": -inf}, "n": 3}, tmp_path / "r.json")
    text = (tmp_path / "r.json").read_text()
    assert "NaN" not in text and "Infinity" not in text  # what json.dumps writes for them by default
    assert json.loads(text) == {"loss": None, "times": [None, 1.5], "peak": {"x": None}, "n": 3}


# --- 5. resume=auto past an unreadable newest checkpoint ---------------------------------------


@pytest.fixture(scope="module")
def kept(tiny_root, tmp_path_factory) -> Path:
    """One epoch of single mode with a checkpoint every 10 steps: checkpoint.pt (step 20, the epoch's end)
    and checkpoint.1.pt (step 10). Do not modify it."""
    run_dir = tmp_path_factory.mktemp("kept")
    launch(compose_config(tiny_root, *SHORT, "checkpoint_every_steps=10"), run_dir)
    return run_dir


def test_resume_auto_falls_back_past_a_truncated_newest_checkpoint_and_says_so(tiny_root, kept, tmp_path, caplog):
    run_dir = shutil.copytree(kept, tmp_path / "run")
    newest = run_dir / "checkpoint.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # what a disk that filled up under another program leaves
    # no batch_size=32: a resume takes the run's own settings, not the defaults
    launch(compose_config(tiny_root, "epochs=2", "resume=auto"), run_dir, ("epochs=2", "resume=auto"))
    (said,) = [line for line in caplog.messages if line.startswith("resume=auto")]
    assert said.startswith(f"resume=auto: skipped {run_dir}/checkpoint.pt: cannot read the checkpoint (")
    assert said.endswith(f"; resuming from {run_dir}/checkpoint.1.pt (step 10)")
    assert json.loads((run_dir / "results.json").read_text())["steps"] == 40  # steps 11 to 40 were trained
    assert saved_step(run_dir / "checkpoint.pt") == 40 and saved_step(run_dir / "checkpoint.1.pt") == 30
    config = torch.load(run_dir / "checkpoint.pt", weights_only=True)["config"]
    assert "batch_size: 32\n" in config and "checkpoint_every_steps: 10\n" in config and "epochs: 2\n" in config


def test_no_readable_checkpoint_is_refused_naming_each_and_writing_nothing(tiny_root, kept, tmp_path):
    run_dir = shutil.copytree(kept, tmp_path / "run")
    newest = run_dir / "checkpoint.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    (run_dir / "checkpoint.1.pt").write_bytes(b"not a checkpoint")
    before = contents(run_dir)
    with pytest.raises(ConfigError, match=f"^{newest}: cannot read the checkpoint \\("):
        launch(compose_config(tiny_root, *SHORT, "epochs=2", f"resume={run_dir}"), tmp_path / "new")
    with pytest.raises(ConfigError) as error:
        launch(compose_config(tiny_root, *SHORT, "epochs=2", "resume=auto"), run_dir)
    message = str(error.value)
    assert message.startswith(f"resume=auto: no checkpoint in {run_dir} can be read: {newest}: cannot read the")
    assert f"; {run_dir}/checkpoint.1.pt: " in message and message.endswith("; move them away to start afresh")
    assert "\n" not in message and contents(run_dir) == before and not (tmp_path / "new").exists()


# --- 6. a checkpoint's config is plain data -----------------------------------------------------


def test_interpolations_in_a_checkpoints_config_are_never_resolved(tiny_root, kept, tmp_path, monkeypatch):
    monkeypatch.setenv("MNIST_DIST_SECRET", "s3cret-value")
    run_dir = shutil.copytree(kept, tmp_path / "run")
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    config = yaml.safe_load(state["config"])
    config["data"]["name"] = "${oc.env:MNIST_DIST_SECRET}"  # resolved, it would be said in the refusal's line
    torch.save({**state, "config": yaml.safe_dump(config)}, run_dir / "checkpoint.pt")
    with pytest.raises(ConfigError, match="^resume: the checkpoint's config is not a mnist_dist config") as error:
        launch(compose_config(tiny_root, *SHORT, "epochs=2", f"resume={run_dir}"), tmp_path / "new")
    assert "s3cret" not in str(error.value) and not (tmp_path / "new").exists()


# --- 7. a resume that changes the mode or the number of ranks says so -------------------------------


def test_a_resume_in_another_mode_or_on_other_ranks_says_so_in_one_line(tiny_root, kept, caplog):
    overrides = ("epochs=2", f"resume={kept}", "mode=ddp", "gpus=2")
    cfg, _, saved = _resume(compose_config(tiny_root, *SHORT, *overrides), kept, overrides)
    caplog.set_level(logging.INFO, logger="mnist_dist")
    checkpoint.check_resumable(saved, cfg)
    assert [line for line in caplog.messages if line.startswith("resuming")] == [
        "resuming with mode=ddp on 2 ranks a checkpoint written with mode=single on 1"
    ]


# --- 8. a resume goes on with the run's own settings and the ones it names, but not another batch ---------


def test_a_resume_with_another_global_batch_is_refused(tiny_root, kept, tmp_path):
    # batch_size=64 is the default: set, since the command line names it (the CLI passes its overrides)
    overrides = ("epochs=2", "batch_size=64", "model.dropout=false", f"resume={kept}")
    with pytest.raises(ConfigError, match=r"resume: batch_size=64, but the checkpoint's steps are of 32 images"):
        launch(compose_config(tiny_root, *overrides), tmp_path / "unused", overrides)


@pytest.mark.parametrize(
    "changed, said",
    [
        (("model=fastnet",), "RuntimeError: Error(s) in loading state_dict for FastNet"),
        ((), "KeyError: 'meters'"),  # a checkpoint of another shape: there is no format number to compare (0.x)
    ],
    ids=["model", "shape"],
)
def test_a_checkpoint_that_does_not_fit_fails_in_one_line_and_keeps_the_run(
    tiny_root, kept, tmp_path, cli_in_process, changed, said
):
    run_dir = shutil.copytree(kept, tmp_path / "run")
    if not changed:
        state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
        torch.save({key: value for key, value in state.items() if key != "meters"}, run_dir / "checkpoint.pt")
    saved = ("checkpoint.pt", "checkpoint.1.pt", "model.pt", "results.json", "config.yaml")
    before = {name: (run_dir / name).read_bytes() for name in saved}
    code = cli_in_process(
        f"data.root={tiny_root}", "epochs=2", f"resume={run_dir}", *changed, f"hydra.run.dir={tmp_path}/new"
    )
    assert code.startswith(f"error: {said}") and "\n" not in code
    assert {name: (run_dir / name).read_bytes() for name in saved} == before
    assert not (tmp_path / "new").exists()


def test_an_interrupted_resume_names_the_resumed_runs_checkpoint(
    tiny_root, kept, tmp_path, monkeypatch, cli_in_process, capsys
):
    from mnist_dist import __main__ as command

    run = shutil.copytree(kept, tmp_path / "run")

    def interrupted(*args):
        raise KeyboardInterrupt  # as Ctrl-C lands in the middle of the resumed run

    monkeypatch.setattr(command, "launch", interrupted)
    code = cli_in_process(
        f"data.root={tiny_root}", "batch_size=32", "epochs=2", f"resume={run}", f"hydra.run.dir={tmp_path}/new"
    )
    assert code == 130  # 128 + SIGINT: an interrupt, not a failure
    assert capsys.readouterr().err == (
        f"interrupted; the last complete checkpoint is {run}/checkpoint.pt; go on with: {sys.executable} -m "
        f"mnist_dist resume={run}\n"
    )
    assert not (tmp_path / "new").exists()  # the fresh directory Hydra made for the launch


# --- 9. a fresh launch never replaces a run; a checkpoint's position is checked ----------------------


def test_a_fresh_launch_into_a_finished_run_replaces_nothing(tiny_root, kept, tmp_path, cli_in_process):
    run = shutil.copytree(kept, tmp_path / "run")
    before = contents(run)
    code = cli_in_process(f"data.root={tiny_root}", *SHORT, "data.mirrors=[]", f"hydra.run.dir={run}")
    assert code.startswith(f"error: {run} holds a finished run (results.json, model.pt, checkpoint.pt)")
    assert contents(run) == before  # results, model, the one TensorBoard run


def test_a_fresh_launch_into_an_unfinished_run_says_resume_auto(tiny_root, kept, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(kept / "checkpoint.pt", run)
    with pytest.raises(ConfigError, match="holds an unfinished run .checkpoint.pt.*; pass resume=auto"):
        launch(compose_config(tiny_root, "epochs=2", "batch_size=32"), run)


def test_a_library_threads_traceback_goes_to_the_rank_log_not_the_console(tmp_path, capfd):
    # TensorBoard's writer thread on a full disk: the error comes back to its caller as one line; the thread's
    # traceback must not reach the console too
    setup_logging(tmp_path, rank=0)
    try:
        thread = threading.Thread(target=os.write, args=(-1, b""), name="writer")
        thread.start()
        thread.join()
    finally:
        threading.excepthook = threading.__excepthook__
        logging.getLogger("mnist_dist").handlers.clear()
    assert "Traceback" not in capfd.readouterr().err
    assert "thread writer failed" in (tmp_path / "rank_0.log").read_text()
