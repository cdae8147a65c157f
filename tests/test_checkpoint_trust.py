"""What a checkpoint can be trusted with (issue 27, round 3): no checkpoint holds weights that were not
checked, a schedule is never resumed past its plan, resume=auto gets past an unreadable newest
checkpoint, and a checkpoint's config is read as plain data. Each test failed on commit f307ea7."""

import json
import logging
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import yaml
from helpers import compose_config

from mnist_dist.config import ConfigError
from mnist_dist.launch import launch
from mnist_dist.operations import checkpoint
from mnist_dist.step import TrainingDiverged

# 640 tiny images at batch 32: 20 steps an epoch
SHORT = ("epochs=1", "batch_size=32")
FAST = ("recipe=fast", "batch_size=128")  # OneCycleLR needs 8 steps or more (pct_start 0.25)
FAILING = ("model._target_=failing_model.FailingConvNet", "+model.fail_rank=0")


def tree(run_dir: Path) -> dict[str, bytes]:
    """Every file under ``run_dir`` (tb/ included), by relative path: what a refused launch must not change."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def saved_step(path: Path) -> int:
    state = torch.load(path, weights_only=True)
    assert all(t.isfinite().all() for t in state["model"].values() if t.is_floating_point()), path
    return state["step"]


# --- 1. no checkpoint from unchecked weights ---------------------------------------------------


def test_a_nan_loss_between_log_windows_is_never_checkpointed(tiny_root, tmp_path):
    # log_every=5 checks the loss at step 5 only; checkpoints at every step used to save steps 3 and 4
    # (NaN weights) and rotate the good ones away, and the error then pointed at them.
    cfg = compose_config(tiny_root, *SHORT, "log_every=5", "checkpoint_every_steps=1", *FAILING, "+model.nan=true")
    with pytest.raises(TrainingDiverged) as error:
        launch(cfg, tmp_path)
    assert str(error.value) == (
        "the training loss is nan at step 3 (rank 0); lower optim.lr, check the data, or resume from "
        f"{tmp_path}/checkpoint.pt (step 2, checked)"
    )
    assert saved_step(tmp_path / "checkpoint.pt") == 2 and saved_step(tmp_path / "checkpoint.1.pt") == 1


def test_weights_poisoned_by_a_step_with_a_finite_loss_are_never_checkpointed(tiny_root, tmp_path):
    # nan_grad: step 4's loss is finite, its update makes every weight NaN; step 4 is a checkpoint step.
    settings = ("log_every=10", "checkpoint_every_steps=2", *FAILING, "+model.fail_step=4", "+model.nan_grad=true")
    cfg = compose_config(tiny_root, *SHORT, *settings)
    with pytest.raises(TrainingDiverged) as error:
        launch(cfg, tmp_path)
    assert str(error.value) == (
        "the weights are not finite after step 4 (rank 0, features.0.weight); lower optim.lr, check the data, or "
        f"resume from {tmp_path}/checkpoint.pt (step 2, checked)"
    )
    assert saved_step(tmp_path / "checkpoint.pt") == 2 and not (tmp_path / "checkpoint.1.pt").exists()


def test_divergence_at_the_last_step_fails_the_run_and_writes_no_results(tiny_root, tmp_path):
    cfg = compose_config(tiny_root, *SHORT, *FAILING, "+model.fail_step=20", "+model.nan_grad=true")
    with pytest.raises(TrainingDiverged) as error:
        launch(cfg, tmp_path)
    assert str(error.value) == (
        "the test loss is nan after step 20 (rank 0); lower optim.lr or check the data (no checkpoint was "
        "written before it)"
    )
    assert {p.name for p in tmp_path.iterdir()} & {"results.json", "model.pt", "checkpoint.pt"} == set()


def _no_constants(name: str):
    raise AssertionError(f"{name} in strict JSON")


def test_results_json_is_strict_json(tmp_path):
    inf = float("inf")
    checkpoint.save_json({"loss": float("nan"), "times": [inf, 1.5], "peak": {"x": -inf}, "n": 3}, tmp_path / "r.json")
    parsed = json.loads((tmp_path / "r.json").read_text(), parse_constant=_no_constants)
    assert parsed == {"loss": None, "times": [None, 1.5], "peak": {"x": None}, "n": 3}


# --- 2. a per-step schedule resumed with another length ----------------------------------------


@pytest.fixture(scope="module")
def fast_run(tiny_root, tmp_path_factory) -> Path:
    """recipe=fast (OneCycleLR over all steps), 2 epochs of 5 steps, a checkpoint at every step: the run
    directory holds checkpoint.pt (finished, step 10) and checkpoint.1.pt (step 9). Do not modify it."""
    run_dir = tmp_path_factory.mktemp("fast")
    launch(compose_config(tiny_root, *FAST, "epochs=2", "checkpoint_every_steps=1"), run_dir)
    return run_dir


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    return copy


@pytest.mark.parametrize(
    "resume, epochs, message",
    [
        (
            "checkpoint.1.pt",
            3,
            "resume: the checkpoint's OneCycleLR plans the learning rate over epochs=2 at batch_size=128, this run "
            "over epochs=3 at batch_size=128; a schedule over all steps cannot change length: resume with "
            "epochs=2 batch_size=128, or start a new run",
        ),
        (
            "checkpoint.pt",
            3,
            "resume: the checkpoint has finished epoch 2 of 2, and its OneCycleLR schedule ended there; start a "
            "new run to train longer",
        ),
    ],
    ids=["mid-run", "finished"],
)
def test_a_per_step_schedule_of_another_length_is_refused_and_nothing_is_written(
    tiny_root, fast_run, tmp_path, resume, epochs, message
):
    run_dir = _copy(fast_run, tmp_path)
    before = tree(run_dir)
    cfg = compose_config(tiny_root, *FAST, f"epochs={epochs}", f"resume={run_dir / resume}")
    with pytest.raises(ConfigError) as error:
        launch(cfg, tmp_path / "new")
    assert str(error.value) == message
    assert tree(run_dir) == before and not (tmp_path / "new").exists()


def test_a_per_step_schedule_resumes_with_its_own_length(tiny_root, fast_run, tmp_path):
    run_dir = _copy(fast_run, tmp_path)
    launch(compose_config(tiny_root, *FAST, "epochs=2", f"resume={run_dir / 'checkpoint.1.pt'}"), tmp_path)
    assert json.loads((run_dir / "results.json").read_text())["steps"] == 10


# --- 3. resume=auto past an unreadable newest checkpoint ---------------------------------------


@pytest.fixture(scope="module")
def kept(tiny_root, tmp_path_factory) -> Path:
    """One epoch of single mode with a checkpoint every 10 steps: checkpoint.pt (step 20, the epoch's end)
    and checkpoint.1.pt (step 10). Do not modify it."""
    run_dir = tmp_path_factory.mktemp("kept")
    launch(compose_config(tiny_root, *SHORT, "checkpoint_every_steps=10"), run_dir)
    return run_dir


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@contextmanager
def logged():
    """The mnist_dist logger's messages, as lines (the worker replaces its handlers once it starts)."""
    records, logger = Records(), logging.getLogger("mnist_dist")
    logger.addHandler(records)
    try:
        yield records.lines
    finally:
        logger.removeHandler(records)


def _poison(path: Path) -> None:
    """What an older mnist_dist could save after a diverged step: NaN weights."""
    state = torch.load(path, weights_only=True)
    state["model"]["classifier.3.bias"][0] = float("nan")
    torch.save(state, path)


@pytest.mark.parametrize("damage", ["truncated", "nan"])
def test_resume_auto_falls_back_to_the_newest_readable_checkpoint_and_says_so(tiny_root, kept, tmp_path, damage):
    run_dir = _copy(kept, tmp_path)
    if damage == "truncated":
        newest = run_dir / "checkpoint.pt"
        newest.write_bytes(newest.read_bytes()[:1000])
        why = "cannot read the checkpoint (not a complete torch.save file: "
    else:
        _poison(run_dir / "checkpoint.pt")
        why = "the checkpoint's weights are not finite (classifier.3.bias)"
    cfg = compose_config(tiny_root, *SHORT, "epochs=2", "resume=auto")
    with logged() as lines:
        launch(cfg, run_dir)
    (said,) = [line for line in lines if line.startswith("resume=auto")]
    assert said.startswith(f"resume=auto: skipped checkpoint.pt ({why}")
    assert said.endswith(f"; resuming from {run_dir}/checkpoint.1.pt (step 10)")
    assert json.loads((run_dir / "results.json").read_text())["steps"] == 40  # steps 11 to 40 were trained


def test_resume_auto_with_no_readable_checkpoint_is_refused_naming_each(tiny_root, kept, tmp_path):
    run_dir = _copy(kept, tmp_path)
    for name in ("checkpoint.pt", "checkpoint.1.pt"):
        (run_dir / name).write_bytes(b"not a checkpoint")
    before = tree(run_dir)
    with pytest.raises(ConfigError) as error:
        launch(compose_config(tiny_root, *SHORT, "epochs=2", "resume=auto"), run_dir)
    message = str(error.value)
    assert message.startswith(f"resume=auto: no checkpoint in {run_dir} can be read: checkpoint.pt (cannot read ")
    assert "; checkpoint.1.pt (cannot read " in message and message.endswith("; move them away to start afresh")
    assert "\n" not in message and tree(run_dir) == before


def test_an_explicit_unreadable_checkpoint_is_refused_naming_the_older_ones(tiny_root, kept, tmp_path):
    run_dir = _copy(kept, tmp_path)
    (run_dir / "checkpoint.pt").write_bytes(b"not a checkpoint")
    before = tree(run_dir)
    with pytest.raises(ConfigError) as error:
        launch(compose_config(tiny_root, *SHORT, "epochs=2", f"resume={run_dir}"), tmp_path / "new")
    assert str(error.value).startswith(f"resume={run_dir}/checkpoint.pt: cannot read the checkpoint (")
    assert str(error.value).endswith(
        f"; older checkpoints there: checkpoint.1.pt (resume={run_dir}/checkpoint.1.pt; resume=auto takes the "
        "newest readable one)"
    )
    assert tree(run_dir) == before and not (tmp_path / "new").exists()


# --- 4. a checkpoint's config is plain data -----------------------------------------------------


@contextmanager
def deadline(seconds: int):
    """Fails the test instead of hanging it: a guard, not a time bound (SIGALRM, main thread)."""

    def expired(signum, frame):
        raise AssertionError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _crafted(kept: Path, tmp_path: Path, edit) -> Path:
    """A copy of the kept run whose checkpoint.pt holds the config text ``edit(config)`` returns."""
    run_dir = _copy(kept, tmp_path)
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    state["config"] = edit(yaml.safe_load(state["config"]))
    torch.save(state, run_dir / "checkpoint.pt")
    return run_dir


def _with(**fields):
    def edit(config):
        for dotted, value in fields.items():
            *parents, key = dotted.split("__")
            node = config
            for parent in parents:
                node = node[parent]
            node[key] = value
        return yaml.safe_dump(config)

    return edit


def test_interpolations_in_a_checkpoints_config_are_never_resolved(tiny_root, kept, tmp_path, monkeypatch):
    monkeypatch.setenv("MNIST_DIST_SECRET", "s3cret-value")
    made = tmp_path / "made_by_a_resolver"
    # unique_dir is mnist_dist's own resolver (it creates directories); oc.env reads the environment
    secret = "${oc.env:MNIST_DIST_SECRET}"
    run_dir = _crafted(kept, tmp_path, _with(data__name=secret, batch_size=f"${{unique_dir:{made}}}"))
    with deadline(120), pytest.raises(ConfigError) as error:
        launch(compose_config(tiny_root, *SHORT, "epochs=2", f"resume={run_dir}"), tmp_path / "new")
    assert str(error.value) == (
        "resume: the checkpoint's config is not a mnist_dist config; resume another checkpoint.pt"
    )
    assert not made.exists() and not (tmp_path / "new").exists()
    run_dir = _crafted(kept, tmp_path / "2", _with(data__name=secret))
    with deadline(120), pytest.raises(ConfigError) as error:
        launch(compose_config(tiny_root, *SHORT, "epochs=2", f"resume={run_dir}"), tmp_path / "new")
    assert str(error.value) == (  # a resume takes the checkpoint's config: one never resolved is refused
        "resume: the checkpoint's config is not a mnist_dist config; resume another checkpoint.pt"
    )
    assert "s3cret" not in str(error.value)


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]\n" for prev, name in zip("abcdefgh", "bcdefghi")
)


@pytest.mark.parametrize(
    "text, message",
    [
        (
            f"{BOMB}model: *i\nbatch_size: 32\nepochs: 1\ndata: {{name: mnist}}\n",
            "resume: the checkpoint's config uses YAML aliases, which mnist_dist never writes; resume another "
            "checkpoint.pt",
        ),
        (
            "model: {_target_: x}\nbatch_size: 32\nepochs: 1\ndata: {name: mnist}\n# " + "x" * 2**20 + "\n",
            "resume: the checkpoint's config is over 1 MiB, far more than mnist_dist writes; resume another "
            "checkpoint.pt",
        ),
    ],
    ids=["alias-bomb", "oversized"],
)
def test_an_alias_bomb_or_a_huge_config_is_refused_in_one_line(tiny_root, kept, tmp_path, text, message):
    # 378 bytes that expand to 9**9 strings: the commit before refusing aliases ran out of memory on it
    assert len(BOMB) < 1500
    run_dir = _crafted(kept, tmp_path, lambda config: text)
    before = tree(run_dir)
    with deadline(120), pytest.raises(ConfigError) as error:
        launch(compose_config(tiny_root, *SHORT, "epochs=2", f"resume={run_dir}"), tmp_path / "new")
    assert str(error.value) == message
    assert tree(run_dir) == before and not (tmp_path / "new").exists()


def test_the_compared_fields_still_tell_a_changed_setting(tiny_root, kept, tmp_path):
    said = ("epochs=2", "batch_size=64", f"resume={kept}")  # as the command line passes them
    with pytest.raises(ConfigError) as error:
        launch(compose_config(tiny_root, *SHORT, *said), tmp_path / "new", said)
    assert str(error.value).startswith(
        "resume: this command changes what the checkpoint was trained with (batch_size 32 -> 64)"
    )
