"""The import-circle check CI runs (.ci/check_imports.py), on small package trees built here."""
import importlib.util
import pathlib
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("check_imports", ROOT / ".ci" / "check_imports.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_a_circle_hidden_inside_a_function_is_reported_with_its_lines(check, tmp_path, capsys):
    write(tmp_path, {
        "cncore/__init__.py": "from cncore.store import Store\n",
        "cncore/store.py": "import numpy\n\n\ndef tiered():\n    from cncore.tier import Tier\n    return Tier\n",
        "cncore/tier/__init__.py": "from cncore.tier.tier import Tier\n",
        "cncore/tier/tier.py": "from cncore import store\n",
    })
    assert check.main(tmp_path) == 1
    out = capsys.readouterr().out
    assert "import circle among 3 modules: cncore.store, cncore.tier, cncore.tier.tier" in out
    assert "cncore.store -> cncore.tier   (cncore/store.py:5)" in out
    assert "cncore.tier.tier -> cncore.store   (cncore/tier/tier.py:1)" in out
    assert out.splitlines()[-1].startswith("1 import circle(s), 0 Python import(s)")


def test_relative_imports_resolve_and_a_layered_tree_passes(check, tmp_path, capsys):
    write(tmp_path, {
        "cncore/__init__.py": "from .store import Store\nfrom . import config\n",
        "cncore/config.py": "import math\n",
        "cncore/store.py": "from .config import X\n",
        "frontends/cncore_torch/__init__.py": "from cncore_torch.modules import M\n",
        "frontends/cncore_torch/modules.py": "import cncore\nfrom cncore.store import Store\n",
        "cython_src/cncore/_core.pyx": "from libc.stdint cimport int64_t\nimport numpy as np\n",
    })
    assert check.main(tmp_path) == 0
    out = capsys.readouterr().out
    assert out == ("no import circle (6 modules, 6 imports between them); cython_src/ imports none of ours\n")
    # The same tree with the config importing the store back (relative, at the end of the module).
    (tmp_path / "cncore/config.py").write_text("import math\n\nfrom . import store\n")
    assert check.main(tmp_path) == 1
    assert "cncore.config -> cncore.store   (cncore/config.py:3)" in capsys.readouterr().out


def test_a_python_import_of_our_packages_in_the_c_layer_is_reported(check, tmp_path, capsys):
    write(tmp_path, {
        "cncore/__init__.py": "",
        "cncore/config.py": "",
        "cython_src/cncore/_core.pyx": ("from cncore._typedefs cimport key_t\n\n"
                                        "def f():\n    from cncore.config import X\n"),
    })
    assert check.main(tmp_path) == 1
    out = capsys.readouterr().out
    assert "the C layer imports a package of ours: cython_src/cncore/_core.pyx:4: from cncore.config import X" in out
