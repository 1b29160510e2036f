import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# Deterministic property tests: the same examples on every run and machine.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("soak", derandomize=False, deadline=None, max_examples=5000,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if "soak" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="soak test: run with -m soak")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def restore_threads():
    """The core's thread count as it was before the test (a test that sets it uses this)."""
    import cncore
    before = cncore.get_num_threads()
    yield
    cncore.set_num_threads(before)


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


@pytest.fixture
def cncard(monkeypatch):
    """The accelerator placement (device="cncard") for a test. CI has no accelerator, so by
    default CNCORE_CNCARD=cpu runs that code path on the CPU; CNCORE_TEST_ACCELERATOR=1 runs it on
    the real one (CUDA or MLU), which the tests then compare with the core through `.cpu()`."""
    if os.environ.get("CNCORE_TEST_ACCELERATOR") == "1":
        monkeypatch.delenv("CNCORE_CNCARD", raising=False)
    else:
        monkeypatch.setenv("CNCORE_CNCARD", "cpu")
