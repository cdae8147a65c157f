"""python -m mnist_dist.tools.check: see the package's docstring."""

import sys

from mnist_dist.tools.check import main

sys.exit(main(sys.argv[1:]))
