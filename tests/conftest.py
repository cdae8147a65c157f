import sys
from pathlib import Path

# Spawned ranks unpickle test functions by module name: keep tests/ importable as a plain folder.
sys.path.insert(0, str(Path(__file__).parent))
