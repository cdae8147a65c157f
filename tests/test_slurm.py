"""srun's variables as srun sets them (no scheduler here): each task's ranks, and where rank 0 serves the rendezvous."""

import os

from mnist_dist import topology


def test_an_srun_task_reads_its_ranks_and_meets_on_the_first_node_unless_told(make_config, monkeypatch):
    cfg = make_config("mode=ddp", "device=cpu")
    slurm = dict(SLURM_PROCID=3, SLURM_LOCALID=1, SLURM_NTASKS=4, SLURM_NNODES=2, SLURM_STEP_ID=0)
    monkeypatch.setattr(os, "environ", {key: str(value) for key, value in slurm.items()})
    os.environ["SLURM_NODELIST"] = "node[03-04]"
    found = topology.from_env(cfg)
    assert (found.rank, found.world_size, found.local_rank, found.local_world_size) == (3, 4, 1, 2)
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("node03", "29500")
    os.environ["MASTER_PORT"] = "15234"  # the batch script's: kept
    topology.from_env(cfg)
    assert os.environ["MASTER_PORT"] == "15234"
