"""Which instruction set the core's hot kernels run, chosen once when cncore is imported.

The pooled forward, the fused backward with its optimizer update, and the initialiser are
compiled for three x86-64 levels (cython_src/include/cn_isa.h): "base" (SSE2, every x86-64
CPU), "v3" (AVX2, FMA, F16C) and "v4" (AVX-512). cncore runs the highest level this CPU has,
or the one the environment variable CNCORE_ISA names (base | v3 | v4); a level this CPU cannot
run makes `import cncore` fail with a message that says which levels it can. The levels differ
only in the last bits of a pooled sum or an update (a fused multiply-add rounds once); initial
rows are the same bits on every level.

>>> import cncore
>>> cncore.kernel_isa() in cncore.runnable_isas()
True
"""
from cncore import _core

__all__ = ["kernel_isa", "runnable_isas"]


def kernel_isa() -> str:
    """The instruction-set level the hot kernels run in this process.

    Returns:
        str: "base" (x86-64), "v3" (x86-64-v3: AVX2, FMA) or "v4" (x86-64-v4: AVX-512); set
        CNCORE_ISA before importing cncore to choose another this CPU runs.

    >>> import cncore
    >>> cncore.kernel_isa() in ("base", "v3", "v4")
    True
    """
    return _core.kernel_isa()


def runnable_isas() -> tuple[str, ...]:
    """The levels this CPU and this build of cncore can run, lowest first (CNCORE_ISA's choices).

    Returns:
        tuple[str, ...]: a prefix of ("base", "v3", "v4"); ("base",) off x86-64.

    >>> import cncore
    >>> cncore.runnable_isas()[0]
    'base'
    """
    return _core.runnable_isas()
