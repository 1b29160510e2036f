"""cn-dlrm before torch: `--help` and option errors answer without importing it, and a missing
PyTorch or TorchRec is named with the line that installs it (exit code 2, no traceback). The
install lines in the README, the Makefile and setup.cfg agree with what the command prints."""
import configparser
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cn_dlrm.cli import TORCH_INSTALL, TORCHREC_INSTALL

ROOT = Path(__file__).resolve().parents[1]


def cn_dlrm(*argv, block=()):
    """Run cn-dlrm's entry point in a fresh interpreter with the modules in `block` unimportable
    (as if not installed); print whether torch got imported."""
    code = (f"import sys\n"
            f"for name in {list(block)!r}:\n    sys.modules[name] = None\n"
            f"from cn_dlrm.cli import main\n"
            f"try:\n    code = main({list(argv)!r})\n"
            f"except SystemExit as e:\n    code = e.code\n"
            f"print('torch imported:', 'torch' in sys.modules)\n"
            f"sys.exit(code)\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_help_imports_no_torch_and_shows_defaults():
    proc = cn_dlrm("--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip().endswith("torch imported: False")
    assert "(default: 800)" in proc.stdout and "(default: 2048)" in proc.stdout
    assert "first --eval-batches x --batch-size lines" in proc.stdout  # the held-out evaluation lines


def test_option_errors_come_before_torch():
    proc = cn_dlrm("--eval-every", "0")
    assert proc.returncode == 2
    assert proc.stderr == "cn-dlrm: error: argument --eval-every: must be at least 1, got 0 (see cn-dlrm --help)\n"
    assert "torch imported: False" in proc.stdout


@pytest.mark.parametrize("block, expected", [
    (["torch"], f"cn-dlrm: error: PyTorch is not installed; cn-dlrm needs it and TorchRec (CPU builds): "
                f"{TORCH_INSTALL} && {TORCHREC_INSTALL}"),
    (["torchrec"], f"cn-dlrm: error: TorchRec is not installed; install TorchRec with: {TORCHREC_INSTALL}"),
    (["fbgemm_gpu"], f"cn-dlrm: error: TorchRec's dependency 'fbgemm_gpu' is not installed; install TorchRec with: "
                     f"{TORCHREC_INSTALL}"),
])
def test_a_missing_dependency_is_one_line_naming_the_pip_command(block, expected):
    if block != ["torch"]:
        pytest.importorskip("torchrec")
    proc = cn_dlrm("--steps", "1", block=block)
    assert proc.returncode == 2
    assert proc.stderr == expected + "\n"


def test_the_installed_command_answers_help():
    script = Path(sys.executable).parent / "cn-dlrm"
    if not script.exists():
        pytest.skip("cn-dlrm is not installed in this environment")
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "usage: cn-dlrm" in proc.stdout


def test_install_lines_agree_across_readme_makefile_and_setup_cfg():
    readme = (ROOT / "README.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    # the README gives each line the command prints, and the pins the Makefile installs
    for line in [TORCH_INSTALL, *TORCHREC_INSTALL.split(" && ")]:
        assert line in readme, line
    for pin in ["torch==2.13.0", "fbgemm-gpu-cpu==1.8.0", "torchrec==1.8.0", "torchmetrics==1.0.3"]:
        assert pin in makefile and pin in TORCH_INSTALL + TORCHREC_INSTALL, pin
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = {name: value.split() for name, value in cfg["options.extras_require"].items()}
    # TorchRec's metadata asks for the GPU package fbgemm-gpu, so the extra cannot list TorchRec:
    # it installs its CPU dependencies, and the README adds `pip install --no-deps torchrec==1.8.0`
    assert "fbgemm-gpu-cpu==1.8.0" in extras["torchrec"]
    assert not any(re.match(r"torchrec\b", req) for req in extras["torchrec"])
    assert "pip install --no-deps torchrec==1.8.0" in readme
    assert cfg["options.entry_points"]["console_scripts"].split("\n").count("cn-dlrm = cn_dlrm.cli:main") == 1
