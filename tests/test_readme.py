"""README numbers come from the commands: embedded verbatim, and the first command's accuracy reproduced."""

import json
import re
import shlex
import subprocess
import sys

import pytest
import torch
from helpers import FASHION

from mnist_dist.readme_numbers import README, embed, main


def test_embed_replaces_only_the_marked_block():
    readme = "intro\n<!-- begin compare.md -->\nold table\n<!-- end compare.md -->\nrest\n"
    assert embed(readme, "compare.md", "machine: x\n\n| new |\n") == (
        "intro\n<!-- begin compare.md -->\nmachine: x\n\n| new |\n<!-- end compare.md -->\nrest\n"
    )
    with pytest.raises(ValueError, match="no '<!-- begin bench.md -->'"):
        embed(readme, "bench.md", "x")


def test_the_readme_has_the_blocks_and_the_command_refreshes_them(tmp_path):
    for name in ("bench", "compare", "tta"):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{name}.md").write_text(f"machine: test\n\n| {name} |\n")
        if name != "tta":  # the time-to-accuracy table comes without a chart
            (tmp_path / name / f"{name}.png").write_bytes(b"\x89PNG")
    (tmp_path / "docs").mkdir()
    readme = tmp_path / "README.md"
    readme.write_text(README.read_text())
    dirs = [f"--{name}={tmp_path / name}" for name in ("bench", "compare", "tta")]
    assert main([*dirs, "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "<!-- begin tta.md -->\nmachine: test\n\n| tta |\n<!-- end tta.md -->" in text
    assert "<!-- begin bench.md -->\nmachine: test\n\n| bench |\n<!-- end bench.md -->" in text
    assert "<!-- begin compare.md -->\nmachine: test\n\n| compare |\n<!-- end compare.md -->" in text
    assert (tmp_path / "docs" / "compare.png").read_bytes() == b"\x89PNG"


@pytest.mark.slow
@pytest.mark.skipif(not FASHION.exists(), reason="needs the dataset-fashion-mnist package")
def test_the_first_command_reaches_the_accuracy_the_readme_states(tmp_path):
    text = README.read_text()
    first_command = re.search(r"```bash\n(.+?)\n```", text, re.S).group(1)
    training = shlex.split(first_command.split(" && ")[-1])  # .venv/bin/python -m mnist_dist ...
    assert training[:3] == [".venv/bin/python", "-m", "mnist_dist"]
    ((claimed, kernels),) = re.findall(r"reaches (\d+\.\d+) % test accuracy where torch runs its\s+(\w+) kernels", text)
    result = subprocess.run(
        [sys.executable, *training[1:], f"data.root={tmp_path / 'data'}", f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr
    accuracy = json.loads((tmp_path / "run" / "results.json").read_text())["test_accuracy"]
    assert accuracy >= 0.85  # on any machine: one epoch of the fast recipe learns
    if torch.backends.cpu.get_cpu_capability() == kernels:  # other kernels round differently
        assert f"{100 * accuracy:.2f}" == claimed
