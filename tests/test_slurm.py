"""SLURM's variables as srun sets them (no scheduler here): the port a job step derives; leftover torchrun variables."""

import os

import pytest

from mnist_dist import topology
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


def task(rank: int, job: int = 1234, step: int = 0) -> dict:
    """What srun gives task ``rank`` of a two-task job step."""
    variables = dict(SLURM_PROCID=rank, SLURM_LOCALID=rank, SLURM_NTASKS=2, SLURM_NODELIST="localhost")
    return variables | dict(SLURM_JOB_ID=job, SLURM_STEP_ID=step)


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


def test_leftover_torchrun_variables_are_one_line(env, make_config):
    env(LOCAL_RANK=0, WORLD_SIZE=2)  # left from another job, without torchrun
    with pytest.raises(ConfigError, match="^LOCAL_RANK and WORLD_SIZE are set, but not RANK.*left over"):
        topology.from_env(make_config("mode=ddp"))
