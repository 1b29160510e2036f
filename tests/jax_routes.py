"""The `route` fixture of the JAX tests: each test that takes it runs through both boundaries."""
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
