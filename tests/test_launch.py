"""The command line as users run it: spawned ranks, torchrun, a failing rank, and full-size data."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import HANG_S, scalars, srun

from mnist_dist.operations import checkpoint
from mnist_dist.operations.preemption import REQUEUE
from mnist_dist.operations.tensorboard import tb_dir

ROOT = Path(__file__).parent.parent
TINY = ["data.mirrors=[]", "progress=false", "epochs=1", "batch_size=32"]


def cli(run_dir: Path, *overrides: str, launcher=(sys.executable, "-m", "mnist_dist"), timeout=HANG_S):
    result = subprocess.run(
        [*launcher, *overrides, f"hydra.run.dir={run_dir}"],
        cwd=run_dir.parent,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    result.run_dir = run_dir
    return result


def assert_complete_run(run_dir: Path, mode: str, ranks: int) -> dict:
    results = json.loads((run_dir / "results.json").read_text())
    assert (results["mode"], results["world_size"]) == (mode, ranks)
    for rank in range(ranks):
        assert "ddp on cpu" in (run_dir / f"rank_{rank}.log").read_text()
    # One TensorBoard run, written by rank 0, with every rank's numbers and no more.
    assert {path.parent for path in run_dir.rglob("events.out.tfevents.*")} == {tb_dir(run_dir)}
    ranks_logged = {tag.split("/")[0] for tag in scalars(run_dir) if tag.startswith("rank_")}
    assert ranks_logged == {f"rank_{rank}" for rank in range(ranks)}
    assert (run_dir / "checkpoint.pt").exists() and (run_dir / "model.pt").exists()
    return results


def interrupted(tiny_root) -> list[str]:
    """2 epochs of 20 steps, a checkpoint every 5, rank 1 misbehaving at step 13 of the first attempt only."""
    same = [f"data.root={tiny_root}", *TINY, "epochs=2", "checkpoint_every_steps=5", "log_every=4", "resume=auto"]
    return [*same, "model._target_=failing_model.FailingConvNet", "+model.fail_step=13", "+model.attempt=0"]


@pytest.fixture(scope="module")
def uninterrupted(tiny_root, tmp_path_factory) -> subprocess.CompletedProcess:
    """A ddp run from the command line: the run the interrupted ones must end as; also profiled
    (profiling changes no number)."""
    whole = cli(
        tmp_path_factory.mktemp("whole") / "run",
        "mode=ddp",
        "gpus=2",
        *interrupted(tiny_root),
        "+model.fail_rank=-1",
        "profile=true",
    )
    assert whole.returncode == 0, whole.stderr
    return whole


@pytest.mark.slow
def test_ddp_spawns_one_worker_per_rank(uninterrupted):
    assert "no CUDA device is visible: mode=ddp runs on the CPU in 2 processes with gloo" in uninterrupted.stderr
    assert "[rank 1]" not in uninterrupted.stderr  # rank 0 alone talks to the console
    assert_complete_run(uninterrupted.run_dir, "ddp", 2)


@pytest.mark.slow
def test_profile_writes_a_chrome_trace_per_rank_with_backward_and_all_reduce(uninterrupted):
    run_dir = uninterrupted.run_dir
    for rank in range(2):
        names = {
            event.get("name", "")
            for event in json.loads((run_dir / f"trace_rank{rank}.json").read_text())["traceEvents"]
        }
        # counted from 0: warmup_steps (5) and the profiler's own warm-up step left out, then 5 steps
        assert {name for name in names if name.startswith("ProfilerStep#")} == {
            f"ProfilerStep#{i}" for i in range(6, 11)
        }
        assert "autograd::engine::evaluate_function: ConvolutionBackward0" in names, rank
        assert "gloo:all_reduce" in names, rank


@pytest.mark.slow
def test_restarted_and_requeued_jobs_end_as_an_uninterrupted_run(tiny_root, tmp_path, uninterrupted):
    # Two interruptions, each mid-epoch and resumed by resume=auto. Dropout is on, so every rank's random
    # state must be restored too.
    same = interrupted(tiny_root)
    # torchrun: SIGKILL; the agent restarts both workers, which go on from the checkpoint of step 10.
    torchrun = (sys.executable, "-m", "torch.distributed.run")  # the torchrun command, without its script
    launcher = (*torchrun, "--nproc_per_node=2", "--max-restarts=1", "-m", "mnist_dist")
    restarted = cli(tmp_path / "restarted", "mode=ddp", *same, "+model.kill=true", launcher=launcher)
    assert restarted.returncode == 0, restarted.stderr
    assert "resuming" in (tmp_path / "restarted" / "rank_0.log").read_text()
    assert_complete_run(tmp_path / "restarted", "ddp", 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["restarted"]  # rank 1 made no directory of its own
    # srun: SIGUSR1 to rank 1 alone in step 13; both ranks stop after step 14 (its vote is read then).
    requeued = tmp_path / "requeued"
    assert srun(requeued, "mode=ddp", *same, "+model.usr1=true") == [REQUEUE, REQUEUE]
    state = checkpoint.load(requeued / "checkpoint.pt")
    assert (state["epoch"], state["epoch_step"], state["step"]) == (0, 14, 14)
    assert srun(requeued, "mode=ddp", *same, "+model.usr1=true", restarts=1) == [0, 0]
    weights = [torch.load(run / "model.pt") for run in (uninterrupted.run_dir, tmp_path / "restarted", requeued)]
    for other in weights[1:]:
        assert other.keys() == weights[0].keys()
        assert all(torch.equal(other[k], weights[0][k]) for k in other), "weights differ"


@pytest.mark.slow
def test_a_failing_rank_stops_the_job_and_is_named(tiny_root, tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    result = cli(
        tmp_path / "run",
        "mode=ddp",
        "gpus=2",
        f"data.root={tiny_root}",
        *TINY,
        "model._target_=failing_model.FailingConvNet",
        f"+model.pid_dir={pids}",
        "dist.timeout_s=3600",  # longer than HANG_S: only the launcher can end the job in time
    )
    assert result.returncode == 1
    # One line on the console: no traceback from the failed rank, nor from rank 0 losing its peer.
    assert "Traceback" not in result.stderr and "ERROR" not in result.stderr
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: rank 1 failed: RuntimeError: injected failure at step 3")
    assert last_line.endswith("rank_1.log)")
    assert "injected failure at step 3" in (tmp_path / "run" / "rank_1.log").read_text()
    # The failed run keeps the logs, and nothing TensorBoard would list as a run (no tb/).
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["rank_0.log", "rank_1.log"]
    workers = [int(p.name) for p in pids.iterdir()]
    assert len(workers) == 2
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()], "orphan worker left running"


@pytest.mark.slow
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU fallback")
def test_dp_without_cuda_says_it_runs_the_cpu_equivalent(tiny_root, tmp_path):
    result = cli(tmp_path / "run", "mode=dp_functional", "gpus=2", f"data.root={tiny_root}", *TINY)
    assert result.returncode == 0, result.stderr
    assert "no CUDA device is visible: mode=dp_functional runs on the CPU in one process" in result.stderr
    assert json.loads((tmp_path / "run" / "results.json").read_text())["world_size"] == 1


def test_a_torchrun_worker_checks_the_config_it_resumes_with_once(make_config, tmp_path, monkeypatch):
    # before: it also checked the command's own config first, whose default batch_size=64 does not split over
    # 3 ranks, though the checkpoint's batch_size=48, which the run goes on with, does
    import mnist_dist.launch as launch_module

    torchrun = {
        "RANK": 0,
        "WORLD_SIZE": 3,
        "LOCAL_RANK": 0,
        "LOCAL_WORLD_SIZE": 3,
        "MASTER_ADDR": "x",
        "MASTER_PORT": 1,
    }
    for name, value in torchrun.items():
        monkeypatch.setenv(name, str(value))
    resumed = make_config("mode=ddp", "device=cpu", "batch_size=48")
    monkeypatch.setattr(launch_module, "_resume", lambda cfg, run_dir, overrides: (resumed, run_dir, {"epoch_step": 0}))
    monkeypatch.setattr(launch_module.compatibility, "check_resumable", lambda saved, cfg: None)
    monkeypatch.setattr(launch_module, "die_with_parent", lambda: None)  # not this test process
    monkeypatch.setattr(launch_module, "setup_process", lambda *args: None)  # no other rank will come
    monkeypatch.setattr(launch_module.rundir, "on_this_node", lambda run_dir: run_dir)
    checked, validate = [], launch_module.validate
    monkeypatch.setattr(launch_module, "validate", lambda cfg, topology: validate(cfg, topology) or checked.append(cfg))
    monkeypatch.setattr(launch_module, "train", lambda cfg, run_dir, data_dir, topology: {"ranks": topology.world_size})
    assert launch_module.launch(make_config("mode=ddp", "device=cpu", "resume=auto"), tmp_path) == {"ranks": 3}
    assert [cfg.batch_size for cfg in checked] == [48]
