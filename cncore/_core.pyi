"""Type stub of the compiled core (built from cython_src/cncore/_core.pyx).

A partial stub: every name the core defines is Any to the type checker; the Python layer above
it (`cncore.store`, `cncore.grouped`) carries the annotated signatures.
"""
from typing import Any

def __getattr__(name: str) -> Any: ...

ISA_LEVELS: tuple[str, ...]
ISA_VARIABLE: str

def kernel_isa() -> str: ...
def runnable_isas() -> tuple[str, ...]: ...
def build_isa() -> str: ...
