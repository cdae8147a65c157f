"""Messages that were unclear (issue 27): each is one line now, saying what to do. The others of that list
are beside the code they test: an empty split in test_data, leftover torchrun variables in test_slurm, a
killed forkserver in test_spawn."""

import pytest

from mnist_dist.config import ConfigError, validate


@pytest.mark.parametrize("seed", [2**64, 2**32, -1])
def test_a_seed_out_of_range_is_one_line(make_config, seed):
    with pytest.raises(ConfigError) as error:
        validate(make_config(f"seed={seed}"))
    assert str(error.value) == (
        f"seed={seed} must be from 0 to 4294967295: the data order and every rank's random state are seeded "
        "from it within torch's 64 bits"
    )
