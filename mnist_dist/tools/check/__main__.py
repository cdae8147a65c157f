"""python -m mnist_dist.tools.check: see the package's docstring."""

import sys

from mnist_dist.operations.errors import interrupted, raise_on_interrupt
from mnist_dist.tools.check import main

raise_on_interrupt()  # Ctrl-C and SIGTERM: the check's ranks are stopped, then one line
try:
    sys.exit(main(sys.argv[1:]))
except KeyboardInterrupt:
    interrupted("interrupted; the checks did not finish")
