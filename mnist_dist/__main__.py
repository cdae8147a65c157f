"""Command line entry point.

    python -m mnist_dist                                   # single mode, MNIST, 14 epochs
    python -m mnist_dist mode=ddp gpus=4                   # our DDP, one process per GPU
    python -m mnist_dist mode=torch_ddp gpus=2 device=cpu  # torch DDP on 2 CPU processes (gloo)
    python -m mnist_dist -m mode=single,ddp,torch_ddp gpus=2 epochs=1   # one run per mode
    torchrun --nproc_per_node=2 -m mnist_dist mode=ddp     # torchrun starts the workers instead

Any key of mnist_dist/config.py can be overridden; a misspelt one is an error."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from mnist_dist.operations.errors import command, exit_on_interrupt

if __name__ == "__main__":
    exit_on_interrupt()  # until main(): the imports below (torch, Hydra: seconds) and Hydra's composition

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from mnist_dist.config import Config, ConfigError, describe_hydra_error, refuse_unknown_keys
from mnist_dist.launch import WorkerFailed, launch
from mnist_dist.operations import checkpoint, preemption, rundir
from mnist_dist.operations.errors import (
    DataError,
    describe_os_error,
    interrupted,
    last_resort,
    raise_on_interrupt,
)
from mnist_dist.step import TrainingDiverged
from mnist_dist.topology import launched_rank, launcher


@hydra.main(version_base="1.3", config_path="pkg://mnist_dist.conf", config_name="config")
def main(cfg: DictConfig) -> None:
    """The command: Hydra composes the config from ``sys.argv`` and runs the job in its directory."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    started = time.time()
    where = run_dir  # where this run writes: run_dir, or the resumed run's directory
    fresh = finished = keep_logs = False  # for _tidy
    try:
        raise_on_interrupt()  # Hydra is done composing: from now on `finally` clauses stop the workers
        with ExitStack() as held:
            if not launched_rank():  # under torchrun or srun rank 0 holds it (its run_dir; the others': the cwd)
                held.enter_context(rundir.owned(run_dir))  # refused while a live run writes there
                fresh = rundir.made_for(run_dir)  # read under the lock: another launch may have made it
            refuse_unknown_keys(cfg)  # before to_object, which drops them
            config: Config = OmegaConf.to_object(cfg)  # launch checks it (config.validate), once its topology is known
            if config.resume not in ("", "auto") and not launched_rank():  # it goes on in its run's directory
                where = checkpoint.locate(config.resume).parent
                if where.resolve() != run_dir.resolve():
                    held.enter_context(rundir.owned(where))
            launch(config, run_dir, HydraConfig.get().overrides.task)
        finished = True
        exit_on_interrupt(_interrupted(where, started))  # a Ctrl-C as it exits: at once, one line
        if signum := preemption.received():  # a Ctrl-C after its last step: the run is complete, the command not
            interrupted(_interrupted(where, started), signum)
    except (WorkerFailed, ConfigError, DataError, TrainingDiverged) as error:  # one line: what is wrong, what to do
        keep_logs = isinstance(error, WorkerFailed)  # its line names the failed rank's log: the traceback
        sys.exit(f"error: {error}")
    except OSError as error:  # disk full, a path that cannot be written, ...
        sys.exit(f"error: {describe_os_error(error)}")
    except preemption.Stopped as stop:  # a checkpoint at the last step boundary, if a step was done
        if launcher() == "srun":  # a scheduler's warning: the requeued job goes on with resume=auto
            interrupted(str(stop), status=preemption.REQUEUE)
        interrupted(_interrupted(where, started), preemption.received())
    except KeyboardInterrupt:
        interrupted(_interrupted(where, started))
    except Exception as error:  # a bug or something unforeseen: still one line, the traceback in the log
        keep_logs = True
        sys.exit(last_resort(error, where / f"rank_{launched_rank()}.log"))
    finally:
        _tidy(run_dir, fresh, finished, keep_logs)


def _interrupted(where: Path, started: float) -> str:
    """That the run finished, if it did (since ``started``), else the checkpoint that resume would go on from,
    if there is one (a resumed run's, when resuming)."""
    if launched_rank():
        return f"rank {launched_rank()} interrupted"  # rank 0 says where the run stands
    results = where / "results.json"  # written last, after model.pt; an older one is an earlier run's
    if results.is_file() and results.stat().st_mtime >= started:
        return f"interrupted as the run ended; it is complete in {where}"
    if (where / "checkpoint.pt").is_file():  # the resume takes the run's own config: nothing to retype
        again = shlex.join([sys.executable, "-m", "mnist_dist", f"resume={where}"])
        return f"interrupted; the last complete checkpoint is {where / 'checkpoint.pt'}; go on with: {again}"
    return "interrupted before the first checkpoint; nothing was saved"


def _tidy(run_dir: Path, fresh: bool, finished: bool, keep_logs: bool) -> None:
    """Leaves nothing of a run that did not finish and has no checkpoint, so that it shows in no TensorBoard; only
    the rank logs stay when its error line names one (``keep_logs``). Only a directory this launch's Hydra made
    (``fresh``, found so under its lock) may go: a resume's, unused since the run went on in its old one, does."""
    if not fresh or not run_dir.is_dir():
        return
    names = {p.name for p in run_dir.iterdir()}
    unused = names <= rundir.HYDRA_OWN | {rundir.LOCK}  # failed before training, or resumed in its old directory
    failed = not finished and "checkpoint.pt" not in names and not launcher()
    if unused or (failed and not keep_logs):
        rundir.remove(run_dir)
    elif failed:
        for path in run_dir.iterdir():
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            elif not (path.name.startswith("rank_") and path.suffix == ".log"):
                path.unlink(missing_ok=True)


if __name__ == "__main__":
    # Under torchrun or srun only rank 0 may have Hydra create a run directory (a second one, named a
    # second later, would split the run: lightning-hydra-template#393); the others learn it from rank 0.
    if launched_rank():
        sys.argv += ["hydra.output_subdir=null", "hydra.run.dir=.", "hydra.job_logging.root.handlers=[console]"]
    # Let Hydra raise instead of printing its multi-line report, so that a bad override is one line.
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    with command():  # once it has its status, the process ends without the interpreter's teardown
        try:
            main()
        except KeyboardInterrupt:  # between a sweep's runs, or as one ends
            interrupted("interrupted; every run that printed its run directory is complete")
        except HydraException as error:  # a sweep's typo is found as its first job is composed
            for sweep in rundir.sweeps:
                if sweep.is_dir() and rundir.made_for(sweep, {"multirun.yaml"}):
                    rundir.remove(sweep)
            sys.exit(f"error: {describe_hydra_error(error)}")
        except OSError as error:  # Hydra could not create the run directory
            sys.exit(f"error: {describe_os_error(error)}")
        except Exception as error:  # before any run directory exists: nowhere to keep a traceback
            sys.exit(f"error: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
