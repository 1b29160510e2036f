"""The benchmark scripts under asv_bench/scripts, loaded for the tests that drive them."""
import importlib.util
import os

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "asv_bench", "scripts")


def load_bounded_auc():
    """A fresh copy of bounded_auc.py as a module (each test gets its own module state)."""
    spec = importlib.util.spec_from_file_location("bounded_auc", os.path.join(SCRIPTS, "bounded_auc.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script
