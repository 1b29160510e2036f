"""Every code block in the README and in docs/ runs as written: each ```python block in a fresh
namespace (in a temporary folder, for the files it writes), and each command line of the ```bash
blocks parses (cn-table, cn-dlrm) or names a target the Makefile has (make). Every relative link
of these pages leads to a file of the repository, and to a heading of it where it names one."""
import itertools
import os
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TEXTS = {page.relative_to(ROOT).as_posix(): page.read_text() for page in PAGES}
README = TEXTS["README.md"]
BLOCKS = [(name, m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1)
          for name, text in TEXTS.items()
          for m in re.finditer(r"^```(\w+)\n(.*?)^```", text, re.M | re.S)]
PYTHON = [(code, f"{name}:{line}") for name, lang, code, line in BLOCKS if lang == "python"]
COMMANDS = [(cmd, f"{name}:{line}") for name, lang, code, line in BLOCKS if lang == "bash"
            for cmd in (c.split("#")[0].strip() for c in code.splitlines()) if cmd]


def test_the_pages_have_the_blocks_we_test():
    assert len(PYTHON) >= 13 and len(COMMANDS) >= 37


def _headings(text):
    """The headings of a page, outside code blocks."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.findall(r"^#+ (.+)$", text, re.M)


def _anchor(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_is_the_front_door():
    """The README keeps to its job: what it is, install, the two commands, one quick start per
    front end and links into docs/, in at most 300 lines."""
    assert len(README.splitlines()) <= 300
    headings = set(_headings(README))
    for wanted in ("The two commands", "Install (your own environment)", "Quick start (NumPy)",
                   "Quick start (PyTorch)", "Quick start (TorchRec)", "Quick start (JAX)",
                   "Where to read on"):
        assert wanted in headings, wanted


def test_the_docs_keep_their_sections():
    """Every capability keeps its page and its sections (a scripted edit once cut three sections
    out between two headings, quick start blocks included, and every remaining block still
    ran)."""
    wanted = {
        "docs/README.md": ["Guides", "Design notes"],
        "docs/dlrm-job.md": ["Running it", "On several processes", "Bounded tables in the main job"],
        "docs/distributed.md": ["Distributed training (TorchRec's DistributedModelParallel)"],
        "docs/bounded-tables.md": ["Bounded tables", "Bounded tables in PyTorch and TorchRec"],
        "docs/row-dtypes.md": ["Row dtypes"],
        "docs/tables-on-disk.md": ["Table files", "Tables larger than memory (the SSD tier)"],
        "docs/semantics-and-guarantees.md": ["Semantics worth knowing", "Guarantees"],
        "docs/benchmarks.md": ["Benchmarks", "The main job", "The SSD tier"],
        "docs/CHANGELOG.md": ["Changelog"],
    }
    for page, headings in wanted.items():
        assert page in TEXTS, page
        for heading in headings:
            assert heading in _headings(TEXTS[page]), (page, heading)


LINKS = [(name, target) for name, text in TEXTS.items()
         for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S))
         if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("name, target", LINKS, ids=[f"{n}->{t}" for n, t in LINKS])
def test_relative_links_resolve(name, target):
    path, _, anchor = target.partition("#")
    page = (ROOT / name).parent / path if path else ROOT / name
    assert page.resolve().exists(), f"{name}: {target}: no such file"
    if anchor:
        assert page.suffix == ".md", f"{name}: {target}: an anchor into a file that is not a page"
        anchors = {_anchor(h) for h in _headings(page.read_text())}
        assert anchor in anchors, f"{name}: {target}: no heading with that anchor in {path or name}"


@pytest.mark.parametrize("code, where", PYTHON, ids=[where for _, where in PYTHON])
def test_python_block_runs(code, where, tmp_path, monkeypatch):
    if "jax" in code:
        pytest.importorskip("jax")
        pytest.importorskip("optax")
    if "torchrec" in code:
        pytest.importorskip("torchrec")
    elif "torch" in code:
        pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, where, "exec"), {"__name__": "readme"})


def _parses(parser, argv):
    try:
        parser.parse_args(argv)
    except SystemExit as e:  # argparse's way of refusing
        pytest.fail(f"does not parse: {shlex.join(argv)} (exit {e.code})")


@pytest.mark.parametrize("cmd, where", COMMANDS, ids=[f"{where}-{c.split()[0]}" for c, where in COMMANDS])
def test_command_line_parses(cmd, where, tmp_path, monkeypatch):
    argv = [a for a in shlex.split(cmd) if a != "&&"]
    tool = argv[0]
    if tool == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M)
        assert argv[1] in targets
    elif tool == "pip":  # the install lines: tests/test_install_messages.py checks them
        assert argv[1] == "install"
    elif tool == "cn-table":
        from cncore_numpy.cli import _parser
        _parses(_parser(), argv[1:])
    elif tool.endswith("cn-dlrm"):
        from cn_dlrm.cli import build_parser
        monkeypatch.chdir(tmp_path)  # the files it reads exist (empty): parsing checks they do
        for flag, value in itertools.pairwise(argv):
            if flag in ("--criteo-tsv", "--resume"):
                Path(value).touch()
        _parses(build_parser(), argv[1:])
    elif tool in ("python", ".venv/bin/python") and argv[1] == "-m":
        import importlib.util
        assert importlib.util.find_spec(argv[2]), argv[2]  # a module this package installs
    elif tool in ("python", ".venv/bin/python"):
        assert os.path.exists(ROOT / argv[1]), argv[1]  # a script of this repository
    else:
        pytest.fail(f"{where}: no check for {tool!r}")
