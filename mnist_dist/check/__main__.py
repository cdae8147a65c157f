"""python -m mnist_dist.check: see the package's docstring."""

import sys

from mnist_dist.check import main

sys.exit(main(sys.argv[1:]))
