"""Command line entry point.

    python -m mnist_dist                                   # single mode, MNIST, 14 epochs
    python -m mnist_dist mode=ddp gpus=4                   # our DDP, one process per GPU
    python -m mnist_dist mode=torch_ddp gpus=2 device=cpu  # torch DDP on 2 CPU processes (gloo)
    python -m mnist_dist -m mode=single,ddp,torch_ddp gpus=2 epochs=1   # one run per mode
    torchrun --nproc_per_node=2 -m mnist_dist mode=ddp     # torchrun starts the workers instead

Any key of mnist_dist/config.py can be overridden; a misspelt one is an error.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
from contextlib import ExitStack
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from mnist_dist import checkpoint, preemption, rundir
from mnist_dist.config import Config, ConfigError, describe_hydra_error, validate
from mnist_dist.data import DataError
from mnist_dist.errors import describe_os_error, last_resort, rank_log
from mnist_dist.launch import WorkerFailed, launch
from mnist_dist.step import TrainingDiverged
from mnist_dist.topology import launched_rank


@hydra.main(version_base="1.3", config_path="pkg://mnist_dist.conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # libraries: warnings only
    logging.getLogger("mnist_dist").setLevel(logging.INFO)
    signal.signal(signal.SIGTERM, _interrupt)  # so that `finally` clauses stop the workers
    try:
        config: Config = OmegaConf.to_object(cfg)
        validate(config)
        with ExitStack() as held:
            for directory in _directories_written(config, run_dir):
                held.enter_context(rundir.owned(directory))  # refused while a live run writes there
            launch(config, run_dir, HydraConfig.get().overrides.task)
    except (ConfigError, DataError, WorkerFailed, TrainingDiverged) as error:
        sys.exit(f"error: {error}")  # one line: what was wrong and what to do
    except OSError as error:  # disk full, a path that cannot be written, ...
        sys.exit(f"error: {describe_os_error(error)}")
    except preemption.Stopped as stop:  # a scheduler's warning: the requeued job goes on with resume=auto
        sys.stderr.write(f"{stop}\n")
        sys.exit(preemption.REQUEUE)
    except KeyboardInterrupt:
        sys.exit(f"interrupted; the last complete checkpoint is {run_dir}/checkpoint.pt")
    except Exception as error:  # a bug or something unforeseen: still one line, the traceback in the log
        sys.exit(last_resort(error, rank_log(run_dir / f"rank_{launched_rank()}.log")))
    finally:
        _remove_if_unused(run_dir)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _directories_written(config: Config, run_dir: Path) -> list[Path]:
    # Under torchrun or srun only rank 0 had Hydra create a directory; the others' run_dir is the cwd.
    if launched_rank():
        return []
    explicit = config.resume not in ("", "auto")
    return [checkpoint.locate(config.resume).parent] if explicit else [run_dir]


def _remove_if_unused(run_dir: Path) -> None:
    # A run that failed before training, or resumed in its old directory, leaves only Hydra's
    # .hydra/ (and the released lock) here: remove it rather than leave a half-written run behind.
    if run_dir != Path.cwd() and {p.name for p in run_dir.iterdir()} <= {".hydra", rundir.LOCK}:
        shutil.rmtree(run_dir)


def _torchrun_rank_overrides() -> list[str]:
    # Under torchrun or srun every rank runs this file. Only rank 0 may have Hydra create a run directory
    # (a second one, named a second later, would split the run: lightning-hydra-template#393);
    # the others learn rank 0's directory through the process group.
    if launched_rank():
        return ["hydra.output_subdir=null", "hydra.run.dir=."]
    return []


if __name__ == "__main__":
    sys.argv += _torchrun_rank_overrides()
    # Let Hydra raise instead of printing its multi-line report, so that a bad override is one line.
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        main()
    except HydraException as error:
        sys.exit(f"error: {describe_hydra_error(error)}")
    except OSError as error:  # Hydra could not create the run directory
        sys.exit(f"error: {describe_os_error(error)}")
    except Exception as error:  # before any run directory exists: nowhere to keep a traceback
        sys.exit(f"error: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
