"""SLURM's variables as srun and sbatch set them (no scheduler here): which process is a task, its port, its store."""

import os
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from mnist_dist import topology
from mnist_dist.operations import environment
from mnist_dist.operations.errors import ConfigError

SLURM = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NODELIST", "SLURM_JOB_ID", "SLURM_STEP_ID")
TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def env(monkeypatch):
    """env(**variables): exactly these of SLURM's and torchrun's variables set, the others unset."""
    for key in (*SLURM, *TORCHRUN, "SLURM_NTASKS_PER_NODE", "SLURM_NNODES", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(key, raising=False)

    def set_(**variables):
        for key, value in variables.items():
            monkeypatch.setenv(key, str(value))

    return set_


def task(rank: int, job: int = 1234, step: int | None = 0) -> dict:
    """What srun gives task ``rank`` of a two-task job step; step None: sbatch's batch step instead."""
    variables = dict(SLURM_PROCID=rank, SLURM_LOCALID=rank, SLURM_NTASKS=2, SLURM_NODELIST="localhost")
    variables["SLURM_JOB_ID"] = job
    if step is not None:
        variables["SLURM_STEP_ID"] = step
    return variables


def test_the_batch_step_is_told_to_start_the_tasks_with_srun(env, make_config):
    env(**task(0, step=None))  # sbatch --ntasks=2 exports these to the script itself
    assert environment.launcher() == ""
    with pytest.raises(ConfigError) as error:
        topology.resolve(make_config("mode=ddp", "gpus=2"))
    assert str(error.value) == (
        "SLURM_NTASKS=2, but this process is SLURM's batch step, not one of the tasks: start the tasks with srun "
        "(srun python -m mnist_dist ...), or ask for --ntasks=1 to have mnist_dist start its workers itself"
    )


def test_an_srun_task_is_one(env):
    env(**task(1))
    assert (environment.launcher(), environment.launched_rank()) == ("srun", 1)


def port_of(env, make_config, job: int, step: int) -> int:
    os.environ.pop("MASTER_PORT", None)
    env(**task(0, job, step))
    topology.from_env(make_config("mode=ddp", "device=cpu"))
    return int(os.environ["MASTER_PORT"])


def test_the_derived_port_differs_between_jobs_and_steps(env, make_config):
    ports = {(job, step): port_of(env, make_config, job, step) for job in (1234, 21234) for step in (0, 1)}
    assert len(set(ports.values())) == 4, ports  # 15000 + job % 20000 gave jobs 1234 and 21234 one port
    assert port_of(env, make_config, 1234, 0) == ports[1234, 0]  # every task of a step derives the same
    # below Linux's ephemeral range, so that no outgoing connection of the node holds it
    assert all(15000 <= port < 32768 for port in ports.values())


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def on_loopback(monkeypatch):
    """Rank 0's store serves every interface, for the other nodes; in a test it serves 127.0.0.1 only."""
    tcp_store = dist.TCPStore

    def loopback_store(host, port, is_master=False, **options):
        if is_master:
            listener = socket.socket()
            listener.bind(("127.0.0.1", port))
            listener.listen()
            options["master_listen_fd"] = listener.detach()  # the store owns and closes it
        return tcp_store(host, port, is_master=is_master, **options)

    monkeypatch.setattr(dist, "TCPStore", loopback_store)


def test_a_stray_rank_of_another_job_fails_at_once_naming_it(env, on_loopback):
    port = free_port()
    env(**task(0, job=1234), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    # 300 s: if the stray rank waited instead of failing, this test would take that long and then fail
    served = topology._store_of_this_attempt(timedelta(seconds=300))
    env(**task(1, job=21234))
    with pytest.raises(ConfigError) as error:
        topology._store_of_this_attempt(timedelta(seconds=300))
    assert str(error.value) == (
        f"the rendezvous store at 127.0.0.1:{port} belongs to SLURM job 1234.0, not to this job 21234.0: both "
        "derived the same port; pass dist.port=<a free port> to one of them"
    )
    # A task of the job itself joins, and the job's keys are under its own prefix.
    env(**task(1, job=1234))
    joined = topology._store_of_this_attempt(timedelta(seconds=300))
    joined.set("address", "rank 1")
    assert served.get("address") == b"rank 1"
    del joined, served


def test_leftover_torchrun_variables_are_one_line(env, make_config):
    env(LOCAL_RANK=0, WORLD_SIZE=2)  # left from another job, without torchrun
    with pytest.raises(ConfigError) as error:
        topology.from_env(make_config("mode=ddp"))
    assert str(error.value) == (
        "LOCAL_RANK and WORLD_SIZE are set, but not RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT: left over "
        "from another job? unset them to have mnist_dist start its workers, or start it with torchrun"
    )
