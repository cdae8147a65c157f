"""The README and docs/ say what is true: every command shown runs a real module with overrides that compose,
every link leads somewhere, and the README's commands train data that is here offline."""

from __future__ import annotations

import importlib.util
import itertools
import re
import shlex
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
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
PLACEHOLDER = re.compile(r"<[^>]*>|my_pkg|\$")  # <run dir>, your own package, a shell variable


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


def anchors(page: Path) -> set[str]:
    return {slug(heading) for heading in re.findall(r"^#+ (.+)$", prose(page.read_text()), re.M)}


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


def test_every_training_command_in_the_docs_composes_and_the_readmes_train_data_that_is_here_offline(tmp_path):
    composed = offline = 0
    for page in PAGES:
        for lang, body in code_blocks(page.read_text()):
            if lang not in ("bash", "sh", "shell"):  # ```text blocks show errors on purpose
                continue
            for words in shell_commands(body):
                overrides = trainer_overrides(words)
                if page == README and words[1:3] == ["-m", "mnist_dist.tools.compare"]:  # a run per mode
                    overrides = [o for o in words[3:] if not o.startswith("modes=")]
                if overrides is None or any(PLACEHOLDER.search(word) for word in overrides):
                    continue
                for job in jobs(overrides):
                    try:
                        cfg = compose_config(tmp_path, *job)  # as a machine with the GPUs it asks for runs it:
                        validate(cfg, Topology(cfg.mode.name, "cuda", world_size(cfg), cfg.gpus))
                    except Exception as error:
                        pytest.fail(f"{page.name}: {shlex.join(words)}\n  {type(error).__name__}: {error}")
                    composed += 1
                    if page == README:  # MNIST cannot be downloaded offline; Debian's Fashion-MNIST is on the machine
                        assert (cfg.data.name, cfg.data.mirrors) == ("fashion_mnist", [str(FASHION)]), shlex.join(words)
                        offline += 1
    assert composed >= 20 and offline >= 5  # the parser still finds the commands: the README's first, sweep, compare


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
        # A test named as a guarantee's proof: a renamed or deleted one leaves the claim without its test.
        defined = set(re.findall(r"def (test_\w+)", "".join(p.read_text() for p in (ROOT / "tests").glob("*.py"))))
        for name in re.findall(r"`(?:tests/test_\w+\.py::)?(test_\w+)`", text):
            assert name in defined, f"{page.name}: `{name}` is no test"
