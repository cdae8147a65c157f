"""The command line (docs/running.md): ``python -m mnist_dist [key=value ...]``, ``-m`` for a sweep, or one rank of
torchrun or srun. Any key of mnist_dist/config.py can be overridden; a misspelt one is an error."""

from __future__ import annotations

import os
import shlex
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from mnist_dist.operations.errors import NOTHING_STARTED, command, on_interrupt

if __name__ == "__main__":
    on_interrupt(NOTHING_STARTED)  # until main(): the imports below (torch, Hydra: seconds) and Hydra's composition

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from mnist_dist.config import Config, ConfigError, describe_hydra_error, refuse_unknown_keys
from mnist_dist.launch import WorkerFailed, launch
from mnist_dist.operations import checkpoint, preemption, rundir
from mnist_dist.operations.errors import DataError, describe, interrupted, last_resort
from mnist_dist.step import TrainingDiverged
from mnist_dist.topology import launched_rank, launcher


@hydra.main(version_base="1.3", config_path="pkg://mnist_dist.conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    started, where = time.time(), run_dir  # where: the directory the run writes, a resumed run's own
    fresh = stopped = False
    try:
        on_interrupt()  # Hydra is done composing: from now on `finally` clauses stop the workers
        with ExitStack() as held:
            if not launched_rank():  # under torchrun or srun rank 0 holds it (its run_dir; the others': the cwd)
                fresh = held.enter_context(rundir.owned(run_dir))  # refused while a live run writes there
            refuse_unknown_keys(cfg)  # before to_object, which drops them
            config: Config = OmegaConf.to_object(cfg)  # launch checks it (config.validate), once its topology is known
            if config.resume not in ("", "auto") and not launched_rank():  # it goes on in its run's directory
                where = checkpoint.locate(config.resume).parent
                if where.resolve() != run_dir.resolve():
                    held.enter_context(rundir.owned(where))
            launch(config, run_dir, HydraConfig.get().overrides.task)
        on_interrupt(exit_with=_interrupted(where, started))  # a Ctrl-C as it exits: at once, one line
    except (WorkerFailed, ConfigError, DataError, TrainingDiverged) as error:  # one line: what is wrong, what to do
        sys.exit(f"error: {error}")
    except OSError as error:  # disk full, a path that cannot be written, ...
        sys.exit(f"error: {describe(error)}")
    except KeyboardInterrupt as stop:  # Ctrl-C, or a signal answered with a checkpoint (preemption.Stopped)
        stopped = True
        if isinstance(stop, preemption.Stopped) and launcher() == "srun":  # the requeued job goes on (resume=auto)
            interrupted(str(stop), status=preemption.REQUEUE)
        interrupted(_interrupted(where, started))
    except Exception as error:  # a bug or something unforeseen: still one line, the traceback in the log
        sys.exit(last_resort(error, where / f"rank_{launched_rank()}.log"))
    finally:
        # Hydra's new directory goes if no run is in it (bad input, a resume that went on in its old one) or if the
        # run stopped before its first checkpoint: nothing to resume. A failed run keeps it: its logs say why.
        nothing = stopped and not ((run_dir / "checkpoint.pt").exists() or launcher())
        if fresh and (rundir.made_for(run_dir) or nothing):
            rundir.remove(run_dir)


def _interrupted(where: Path, started: float) -> str:
    """That the run finished (since ``started``), else the checkpoint that resume would go on from, if any."""
    if launched_rank():
        return f"rank {launched_rank()} interrupted"  # rank 0 says where the run stands
    results = where / "results.json"  # written last, after model.pt; an older one is an earlier run's
    if results.is_file() and results.stat().st_mtime >= started:
        return f"interrupted as the run ended; it is complete in {where}"
    if (where / "checkpoint.pt").is_file():  # the resume takes the run's own config: nothing to retype
        again = shlex.join([sys.executable, "-m", "mnist_dist", f"resume={where}"])
        return f"interrupted; the last complete checkpoint is {where / 'checkpoint.pt'}; go on with: {again}"
    return "interrupted before the first checkpoint; nothing was saved"


if __name__ == "__main__":
    # Under torchrun or srun only rank 0 may have Hydra create a run directory (a second one, named a
    # second later, would split the run: lightning-hydra-template#393); the others learn it from rank 0.
    if launched_rank():
        sys.argv += ["hydra.output_subdir=null", "hydra.run.dir=.", "hydra.job_logging.root.handlers=[console]"]
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # Hydra raises instead of printing a report: one line
    with command():  # once it has its status, the process ends without the interpreter's teardown
        try:
            main()
        except KeyboardInterrupt:  # between a sweep's runs, or as one ends
            interrupted("interrupted; every run that printed its run directory is complete")
        except HydraException as error:  # a sweep's typo is found as its first job is composed
            for sweep in rundir.noted:
                if rundir.made_for(sweep, {"multirun.yaml"}):
                    rundir.remove(sweep)
            sys.exit(f"error: {describe_hydra_error(error)}")
        except Exception as error:  # Hydra could not create the run directory, ...: no log to name yet
            sys.exit(f"error: {describe(error)}")
