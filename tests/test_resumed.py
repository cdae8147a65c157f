"""A resumed run is one run: its clocks go on from the checkpoint, and TensorBoard keeps every point logged up
to the checkpoint, on every tag, while what the interrupted run logged after it gives way to the resumed run's."""

import itertools
import json

import pytest
from helpers import compose_config, events, scalars

from mnist_dist import train
from mnist_dist.launch import launch
from mnist_dist.operations import checkpoint, preemption
from mnist_dist.tools import read_scalars

STEPS = (
    *("epochs=2", "batch_size=32", "log_every=2", "eval_every_steps=5", "checkpoint_every_steps=7"),
    *("target_accuracy=0.95", "optim.lr=0.01"),  # reached at step 30, after the resume
)
STOP_AT = 12  # steps 8 to 12 were logged after the last checkpoint (step 7) when the run stops
TIMING = ("perf/", "time/", "results/")  # differ from run to run; every other tag is computed


def interrupted_at(step: int, monkeypatch):
    requested = preemption.requested  # the loop asks it after every step, before the mid-epoch checkpoint
    steps = itertools.count(1)  # the steps of a run from its start

    def stop_after() -> str | None:
        asked = requested()
        if next(steps) == step:
            raise KeyboardInterrupt
        return asked

    monkeypatch.setattr(preemption, "requested", stop_after)


@pytest.fixture(scope="module")
def runs(tiny_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("resumed")
    for name in ("whole", "part"):
        (out / name).mkdir()
    launch(compose_config(tiny_root, *STEPS), out / "whole")
    with pytest.MonkeyPatch.context() as monkeypatch:
        interrupted_at(STOP_AT, monkeypatch)
        with pytest.raises(KeyboardInterrupt):
            launch(compose_config(tiny_root, *STEPS), out / "part")
    before = {"saved": checkpoint.load(out / "part" / "checkpoint.pt"), "logged": read_scalars(out / "part")}
    launch(compose_config(tiny_root, *STEPS, f"resume={out / 'part'}"), out / "unused")
    return out, before


@pytest.mark.slow
def test_the_resumed_run_reaches_the_target_at_the_same_step_with_its_clock_going_on(runs):
    out, before = runs
    whole, part = (json.loads((out / name / "results.json").read_text()) for name in ("whole", "part"))
    assert before["saved"]["step"] == 7 and max(before["logged"]["train/loss_global"]) == STOP_AT
    assert STOP_AT < whole["steps_to_target"] == part["steps_to_target"]
    saved = before["saved"]["meters"][0]
    # the time before the checkpoint counts: the resumed run's clocks start from the checkpoint's
    assert part["train_time_s"] > saved["train_s"] > 0 and part["time_to_target_s"] > saved["train_s"]
    assert part["eval_time_s"] > saved["eval_s"] > 0
    assert part["train_images_per_s"] > 0


@pytest.mark.slow
def test_tensorboard_keeps_the_history_up_to_the_checkpoint_on_every_tag(runs):
    out, before = runs
    whole, part = read_scalars(out / "whole"), read_scalars(out / "part")
    assert set(part) == set(whole)
    # every step once: what the interrupted run logged after its checkpoint is purged, not shadowed
    assert len(events(out / "part").Scalars("train/loss_global")) == len(whole["train/loss_global"])
    for tag in whole:
        if tag.startswith(TIMING) or "/perf/" in tag:
            up_to = [step for step in whole[tag] if step <= before["saved"]["step"]]
            assert [step for step in part[tag] if step <= before["saved"]["step"]] == up_to, tag
            assert set(part[tag]) <= set(whole[tag]), tag  # fewer after it: the new process warms up again
        else:
            assert part[tag] == whole[tag], tag  # every step once, the same values


@pytest.mark.slow
def test_a_resume_that_fails_before_its_first_step_leaves_the_history_as_it_was(tiny_root, runs, tmp_path):
    out, _ = runs
    logged = scalars(out / "whole")
    with pytest.MonkeyPatch.context() as monkeypatch:
        interrupted_at(-1, monkeypatch)  # never: the resume below fails in its first step instead
        monkeypatch.setattr(train, "train_step", lambda *args: (_ for _ in ()).throw(RuntimeError("broken")))
        with pytest.raises(RuntimeError, match="broken"):
            resumed = (*STEPS, "epochs=3", f"resume={out / 'whole'}")
            launch(compose_config(tiny_root, *resumed), tmp_path / "unused", resumed)
    assert scalars(out / "whole") == logged
