"""Every code block in the README runs as written: each ```python block in a fresh namespace (in
a temporary folder, for the files it writes), and each command line of the ```bash blocks
parses (cn-table, cn-dlrm) or names a target the Makefile has (make)."""
import os
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = [(m.group(1), m.group(2), README.count("\n", 0, m.start()) + 1)
          for m in re.finditer(r"^```(\w+)\n(.*?)^```", README, re.M | re.S)]
PYTHON = [(code, line) for lang, code, line in BLOCKS if lang == "python"]
COMMANDS = [(cmd, line) for lang, code, line in BLOCKS if lang == "bash"
            for cmd in (c.split("#")[0].strip() for c in code.splitlines()) if cmd]


def test_the_readme_has_the_blocks_we_test():
    assert len(PYTHON) >= 6 and len(COMMANDS) >= 10


def test_the_readme_keeps_its_sections():
    """Every audience's quick start and the sections the brief asks for are there (a scripted
    edit once cut three sections out between two headings, quick start blocks included, and
    every remaining block still ran)."""
    headings = set(re.findall(r"^## (.+)$", README, re.M))
    for wanted in ("The two commands", "Install (your own environment)", "Quick start (NumPy)",
                   "Quick start (PyTorch)", "Quick start (TorchRec)", "Quick start (JAX)",
                   "Distributed training (TorchRec's DistributedModelParallel)", "Bounded tables", "Row dtypes",
                   "Tables larger than memory (the SSD tier)", "Guarantees", "Benchmarks"):
        assert wanted in headings, wanted


@pytest.mark.parametrize("code, line", PYTHON, ids=[f"line{line}" for _, line in PYTHON])
def test_python_block_runs(code, line, tmp_path, monkeypatch):
    if "jax" in code:
        pytest.importorskip("jax")
        pytest.importorskip("optax")
    if "torchrec" in code:
        pytest.importorskip("torchrec")
    elif "torch" in code:
        pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "readme"})


def _parses(parser, argv):
    try:
        parser.parse_args(argv)
    except SystemExit as e:  # argparse's way of refusing
        pytest.fail(f"does not parse: {shlex.join(argv)} (exit {e.code})")


@pytest.mark.parametrize("cmd, line", COMMANDS, ids=[f"line{line}-{c.split()[0]}" for c, line in COMMANDS])
def test_command_line_parses(cmd, line, tmp_path, monkeypatch):
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
        for flag, value in zip(argv, argv[1:]):
            if flag in ("--criteo-tsv", "--resume"):
                Path(value).touch()
        _parses(build_parser(), argv[1:])
    elif tool in ("python", ".venv/bin/python") and argv[1] == "-m":
        import importlib.util
        assert importlib.util.find_spec(argv[2]), argv[2]  # a module this package installs
    elif tool in ("python", ".venv/bin/python"):
        assert os.path.exists(ROOT / argv[1]), argv[1]  # a script of this repository
    else:
        pytest.fail(f"README.md:{line}: no check for {tool!r}")
