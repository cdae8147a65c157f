"""Pre-flight check: will this model train correctly in every mode? Seconds, with no data set.

    python -m mnist_dist.tools.check                                           # the convnet
    python -m mnist_dist.tools.check model=resnet
    python -m mnist_dist.tools.check model._target_=my_pkg.models.MyNet ~model.dropout

Arguments are Hydra overrides, as for ``python -m mnist_dist``: the model is built from the config, and
``mode.*`` options (sync_batchnorm, find_unused_parameters, dp_block, split_at) and ``deterministic``
count. It takes one step in every mode on random MNIST-shaped batches, ddp, torch_ddp and fsdp on 2 CPU
ranks with gloo, and prints one line per check: OK, WARN or FAIL, and why. Exits 1 if any check fails.
"""

from __future__ import annotations

import sys

from mnist_dist.operations.errors import exit_on_interrupt

if sys.argv[:1] == ["-m"]:  # `python -m mnist_dist.tools.check` imports this package first (argv[0] is "-m" then)
    exit_on_interrupt()  # before the imports below (torch, Hydra: seconds): Ctrl-C meanwhile is one line too

from hydra import compose, initialize_config_module
from hydra.errors import HydraException
from omegaconf import OmegaConf

from mnist_dist.config import Config, ConfigError, describe_hydra_error, validate
from mnist_dist.tools.check.common import BATCH, RANKS, Line, build
from mnist_dist.tools.check.local import check_batchnorm, check_determinism, check_modes, check_unused
from mnist_dist.tools.check.ranks import check_distributed
from mnist_dist.topology import resolve


def run_checks(cfg: Config) -> list[Line]:
    modes, unused = check_modes(cfg)
    return [
        modes,
        check_unused(cfg, unused),
        check_batchnorm(cfg, build(cfg)),
        check_determinism(cfg),
        *check_distributed(cfg, find_unused=bool(unused)),
    ]


def main(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):  # Hydra would read it as an override
        print(__doc__)
        return 0
    try:
        with initialize_config_module("mnist_dist.conf", version_base="1.3"):
            cfg: Config = OmegaConf.to_object(compose("config", overrides=argv))
        validate(cfg, resolve(cfg))
        parameters = sum(p.numel() for p in build(cfg).parameters())
    except HydraException as error:
        sys.exit(f"error: {describe_hydra_error(error)}")
    except ConfigError as error:
        sys.exit(f"error: {error}")
    print(
        f"checking {cfg.model['_target_']} ({parameters:,} parameters): one step per mode on random "
        f"batches of {BATCH} images per rank, ddp, torch_ddp and fsdp on {RANKS} CPU ranks",
        flush=True,
    )
    lines = run_checks(cfg)
    width = max(len(check) for _, check, _ in lines)
    for status, check, why in lines:
        print(f"{status:<5} {check:<{width}}  {why}")
    counts = {status: sum(line[0] == status for line in lines) for status in ("FAIL", "WARN")}
    print(
        f"{counts['FAIL']} FAIL, {counts['WARN']} WARN: "
        + ("fix the FAILs before training" if counts["FAIL"] else "ready to train")
    )
    return 1 if counts["FAIL"] else 0
