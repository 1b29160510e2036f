"""The JAX tests' shared fixtures: `route` (each test that takes it runs through both boundaries)
and `no_context_left_waiting` (autouse where a test module imports it)."""
import jax
import pytest

import cncore_jax as cj
from cncore_jax import _ffi

ROUTES = ["callback", pytest.param("ffi", marks=pytest.mark.skipif(not _ffi.available(),
                                                                  reason="no C++ compiler for the FFI route"))]


@pytest.fixture(params=ROUTES)
def route(request):
    """Each test that takes it runs through the ordered io_callback and through the FFI call."""
    previous = cj.set_boundary(request.param)
    yield request.param
    cj.set_boundary(previous)


@pytest.fixture(autouse=True)
def no_context_left_waiting():
    """Tests look up without applying; each starts with no context waiting (the bound refuses more)."""
    yield
    try:
        jax.effects_barrier()
    except Exception:  # a test's own refused call, already asserted
        pass
    cj.discard_pending()
