"""`pip install .` (a wheel, not the editable clone) must carry every module and the Hydra configs."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.mark.slow
def test_wheel_contains_every_module_and_config(tmp_path):
    # Build from a copy: setuptools writes build/ beside the sources it builds.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".*", "outputs", "*.egg-info", "build"))
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)]
    subprocess.run([*build, str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("mnist_dist-*.whl")
    packaged = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"mnist_dist/conf/{p.relative_to(ROOT / 'conf')}" for p in (ROOT / "conf").rglob("*.yaml")}
    assert expected and expected <= packaged
    # pyproject.toml lists the packages by hand: a new subpackage must be added there
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "mnist_dist").rglob("*.py")}
    assert modules - packaged == set()
    assert "mnist_dist/conf/config.yaml" in packaged
