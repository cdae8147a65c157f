"""The README and docs/ say what is true: numbers embedded verbatim from the commands that measured them,
every command shown runs a real module with overrides that compose, every link leads somewhere, the
README stays a front door, and its first command reaches the accuracy it states."""

from __future__ import annotations

import importlib.util
import itertools
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FASHION, compose_config
from hydra.core.override_parser.overrides_parser import OverridesParser

from mnist_dist.config import validate
from mnist_dist.modes import world_size
from mnist_dist.topology import Topology

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = ("bench.md", "compare.md", "tta.md", "sweep.md", "ablation.md")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
PLACEHOLDER = re.compile(r"<[^>]*>|my_pkg|\$")  # <run dir>, your own package, a shell variable
MARKED = re.compile(r"<!-- begin (\S+) -->\n.*?<!-- end \1 -->\n?", re.S)  # a block the tools write
# A figure that moves with every measurement: a number with its unit, or a date.
FIGURE = re.compile(r"\d(?:[\d,]*\d)?(?:\.\d+)? ?(?:%|images/s|min\b|s\b|ms\b|MiB\b|GiB\b)|\b20\d\d-\d\d-\d\d\b")


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block, indented ones (inside a list item) included."""
    return [(lang, body) for lang, body in FENCE.findall(re.sub(r"^ +```", "```", text, flags=re.M))]


def prose(text: str) -> str:
    """``text`` without its fenced code blocks."""
    return FENCE.sub("", re.sub(r"^ +```", "```", text, flags=re.M))


def shell_commands(body: str) -> list[list[str]]:
    """Each command of a bash block as its words: continuation lines joined, comments dropped, and
    ``a && b`` split in two."""
    commands = []
    for line in body.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        for is_separator, group in itertools.groupby(words, lambda word: word in ("&&", "||", ";", "|")):
            if not is_separator:
                commands.append(list(group))
    return commands


def trainer_overrides(words: list[str]) -> list[str] | None:
    """The Hydra overrides of a ``python -m mnist_dist ...`` or ``torchrun ... -m mnist_dist ...``
    command, else None."""
    words = list(itertools.dropwhile(lambda word: re.fullmatch(r"[A-Z_]+=.*", word), words))  # VAR=... python
    for i, (word, following) in enumerate(itertools.pairwise(words)):
        if word == "-m" and following == "mnist_dist":
            program = Path(words[0]).name
            if program.startswith("python") or program == "torchrun":
                return words[i + 2 :]
    return None


def jobs(overrides: list[str]) -> list[list[str]]:
    """The runs a command line makes: one, or under ``-m`` (multirun) one per combination of its sweeps."""
    if "-m" not in overrides and "--multirun" not in overrides:
        return [overrides]
    parsed = OverridesParser.create().parse_overrides([o for o in overrides if o not in ("-m", "--multirun")])
    choices = [
        [f"{o.get_key_element()}={value}" for value in o.sweep_string_iterator()]
        if o.is_sweep_override()
        else [o.input_line]
        for o in parsed
    ]
    return [list(job) for job in itertools.product(*choices)]


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def facts(page: Path) -> list[str]:
    """What a page states, as units that a second page could repeat word for word: table rows, sentences
    of 50 characters or more, and the command lines of its shell blocks; the blocks the tools write
    (which repeat their machine line) are left out."""
    text = MARKED.sub("", page.read_text())
    lines = prose(text).splitlines()
    rows = [line.strip() for line in lines if line.startswith("|") and not re.fullmatch(r"[|:\- ]+", line)]
    paragraphs = "\n".join("" if re.match(r"\||#+ ", line) else line for line in lines).split("\n\n")
    sentences = [s for p in paragraphs for s in re.split(r"(?<=[.:;])\s+", " ".join(p.split())) if len(s) >= 50]
    commands = [
        line.split("  #")[0].strip()
        for lang, body in code_blocks(text)
        if lang in ("bash", "sh", "shell")
        for line in body.splitlines()
    ]
    return rows + sentences + [command for command in commands if len(command) >= 30]


def table_modes(page: Path) -> list[str]:
    """The modes a page's tables have a row for, in order."""
    return re.findall(r"^\| `(\w+)` \|", prose(page.read_text()), re.M)


def anchors(page: Path) -> set[str]:
    return {slug(heading) for heading in re.findall(r"^#+ (.+)$", prose(page.read_text()), re.M)}


def test_each_number_block_lives_in_exactly_one_page():
    for name in BLOCKS:
        holders = [page.relative_to(ROOT) for page in PAGES if f"<!-- begin {name} -->" in page.read_text()]
        assert len(holders) == 1, (name, holders)
        text = (ROOT / holders[0]).read_text()
        assert text.count(f"<!-- begin {name} -->") == text.count(f"<!-- end {name} -->") == 1, name
        block = text.split(f"<!-- begin {name} -->\n")[1].split(f"<!-- end {name} -->")[0]
        assert block.startswith("machine: "), f"{name} in {holders[0]} does not name its machine first"


def test_every_module_the_docs_run_exists():
    named = set()
    for page in PAGES:  # prose and code alike: `python -m mnist_dist.tools.<name>` (a placeholder) is skipped
        named |= {(page.name, m) for m in re.findall(r"-m (mnist_dist(?:\.\w+)*)(?![\w.<])", page.read_text())}
    assert {module for _, module in named} >= {"mnist_dist", "mnist_dist.tools.bench", "mnist_dist.tools.check"}
    for page, module in sorted(named):
        spec = importlib.util.find_spec(module)
        assert spec is not None, f"{page}: python -m {module}: no such module"
        if spec.submodule_search_locations is not None:  # a package runs its __main__
            assert importlib.util.find_spec(f"{module}.__main__") is not None, f"{page}: {module} has no __main__"


def test_every_training_command_in_the_docs_composes(tmp_path):
    composed = 0
    for page in PAGES:
        for lang, body in code_blocks(page.read_text()):
            if lang not in ("bash", "sh", "shell"):  # ```text blocks show errors on purpose
                continue
            for words in shell_commands(body):
                overrides = trainer_overrides(words)
                if overrides is None or any(PLACEHOLDER.search(word) for word in overrides):
                    continue
                for job in jobs(overrides):
                    try:
                        cfg = compose_config(tmp_path, *job)  # as a machine with the GPUs it asks for runs it:
                        validate(cfg, Topology(cfg.mode.name, "cuda", world_size(cfg), cfg.gpus))
                    except Exception as error:
                        pytest.fail(f"{page.name}: {shlex.join(words)}\n  {type(error).__name__}: {error}")
                    composed += 1
    assert composed >= 20  # the parser still finds the commands


def test_every_script_and_link_in_the_docs_exists():
    for page in PAGES:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(text)):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            assert resolved.exists(), f"{page.name}: link to {target}: no such file"
            if anchor and resolved.suffix == ".md":
                assert anchor in anchors(resolved), f"{page.name}: link to {target}: no such heading"
        for lang, body in code_blocks(text):
            if lang in ("bash", "sh", "shell"):
                for words in shell_commands(body):
                    for word in words[1:]:
                        if re.fullmatch(r"[\w.-]+(/[\w.-]+)+\.(py|sh)", word) and not PLACEHOLDER.search(word):
                            assert (ROOT / word).is_file(), f"{page.name}: {shlex.join(words)}: no {word}"
        # Repository files named in prose, e.g. `mnist_dist/parallel/fsdp.py`: a moved file leaves none behind.
        for path in re.findall(r"`((?:mnist_dist|tests|examples|conf|docs|\.ci)/[\w./-]*)`", prose(text)):
            assert (ROOT / path).exists(), f"{page.name}: `{path}` does not exist"


def test_the_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; topics belong in docs/"
    inside = False
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            inside = not inside
        elif not inside:
            assert len(line) <= 120, f"README.md:{number} is {len(line)} characters"
    assert not inside, "README.md has an unclosed code block"


def test_no_page_repeats_what_another_states():
    # One home per fact: a second page links to the first instead of restating it.
    homes: dict[str, Path] = {}
    for page in PAGES:
        for fact in facts(page):
            home = homes.setdefault(fact, page)
            assert home == page, f"{page.name} repeats {home.name}: {fact}"


def test_the_mode_table_is_the_readmes_and_lists_every_mode():
    modes = sorted(path.stem for path in (ROOT / "conf" / "mode").glob("*.yaml"))
    assert sorted(table_modes(README)) == modes
    for page in PAGES[1:]:
        assert not set(table_modes(page)) >= set(modes), f"{page.name} repeats the README's mode table"


def test_the_readme_has_one_line_of_figures_and_it_links_to_their_page():
    # Figures that move with every measurement live on the docs page that names their machine and date.
    paragraphs = prose(README.read_text()).split("\n\n")
    holding = [(p, line) for p in paragraphs for line in p.splitlines() if FIGURE.search(line)]
    assert len(holding) <= 1, "figures on more than one line of README.md: " + "; ".join(line for _, line in holding)
    for paragraph, line in holding:
        assert "](docs/" in paragraph, f"README.md: figures that link to no docs page: {line}"


@pytest.mark.slow
@pytest.mark.skipif(not FASHION.exists(), reason="needs the dataset-fashion-mnist package")
def test_the_first_command_reaches_the_accuracy_the_readme_states(tmp_path):
    text = README.read_text()
    first_command = re.search(r"```bash\n(.+?)\n```", text, re.S).group(1)
    training = shlex.split(first_command.split(" && ")[-1])  # .venv/bin/python -m mnist_dist ...
    assert training[:3] == [".venv/bin/python", "-m", "mnist_dist"]
    # a range, not one CPU's figure: other CPUs and torch's kernels for them round differently
    ((low, high),) = re.findall(r"The first command reaches (\d+\.\d+) to (\d+\.\d+) % test accuracy", text)
    result = subprocess.run(
        [sys.executable, *training[1:], f"data.root={tmp_path / 'data'}", f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    percent = 100 * results["test_accuracy"]
    assert float(low) <= percent <= float(high), f"{percent:.2f} % on {results['machine']}"


def test_the_readmes_runs_and_comparison_train_data_that_is_here_offline(tmp_path):
    # MNIST cannot be downloaded without internet; the Debian package's Fashion-MNIST is on the machine.
    commands = [
        words for lang, body in code_blocks(README.read_text()) if lang == "bash" for words in shell_commands(body)
    ]
    checked = 0
    for words in commands:
        compare = words[1:3] == ["-m", "mnist_dist.tools.compare"]
        overrides = words[3:] if compare else trainer_overrides(words)
        if overrides is None or any(PLACEHOLDER.search(word) for word in overrides):
            continue
        overrides = [o for o in overrides if not o.startswith("modes=")]
        for job in jobs(overrides):
            cfg = compose_config(tmp_path, *job)
            assert (cfg.data.name, cfg.data.mirrors) == ("fashion_mnist", [str(FASHION)]), shlex.join(words)
            checked += 1
    assert checked >= 3  # the first command, the sweep, the compare
