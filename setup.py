"""Builds the Cython core (cython_src/) into the `cncore` package.

Optimisation is on (-O3); the core's parallel loops run on its own pthread pool
(cn_parallel.h), so no OpenMP runtime is needed. The build is portable (baseline x86-64, the code
a wheel for other machines needs) unless CNCORE_NATIVE=1 asks for -march=native, which compiles
the code outside the dispatched kernels for this CPU only. CNCORE_PORTABLE=1, which once asked
for the portable build, is still accepted and changes nothing.

The hot kernels (pooled forward, fused backward + optimizer, initialiser) are compiled in every
build three times, for the x86-64 levels base (SSE2), v3 (AVX2, FMA, F16C) and v4 (AVX-512),
in cython_src/src/cn_isa_{base,v3,v4}.c; at import the core runs the best level the CPU has, or the
one CNCORE_ISA names (cython_src/include/cn_isa.h). Each level's target pragma replaces the build's
-march, so "base" is baseline x86-64 code in a native build too (a native build runs every
level its CPU has), and v4 is the code a portable wheel runs on an AVX-512 CPU. The rest
of the core (find, insert, eviction, the tier) is compiled once, with the build's flags, and
calls the active level's 16-bit row conversions (cn_dtype.h). Portable is the default because,
measured with both builds in one process, portable with dispatch was level with -march=native on
the training step, the pooled forward, inserts, eviction, 16-bit rows, the SSD tier and table
saves (docs/benchmarks.md, "Instruction-set dispatch" and its 2026-12-08 section), and a source
build, CI and a wheel then run the same code.
"""
import glob
import os
import shutil
import subprocess
import sysconfig
import tempfile

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _compiler_accepts(flags):
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    cc = cc.split()[0]
    if shutil.which(cc) is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as fh:
            fh.write("#include <stdio.h>\nint main(void){int s=0;\n#pragma omp parallel for reduction(+:s)\n"
                     "for(int i=0;i<4;i++) s+=i; printf(\"%d\", s); return 0;}\n")
        cmd = [cc, *flags, src, "-o", os.path.join(tmp, "probe")]
        return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


# -fno-math-errno / -fno-trapping-math: the core reads neither errno nor the FP exception
# flags; without them sqrtf and the branch-free selects of the initialiser cannot vectorise.
compile_args = ["-O3", "-std=gnu11", "-fno-strict-aliasing", "-fno-math-errno", "-fno-trapping-math",
                "-Wno-unused-function"]
link_args = []
if os.environ.get("CNCORE_NATIVE") == "1":
    if os.environ.get("CNCORE_PORTABLE") == "1":
        raise SystemExit("CNCORE_NATIVE=1 and CNCORE_PORTABLE=1 ask for different builds: set one of them")
    if not _compiler_accepts(["-march=native"]):
        raise SystemExit("CNCORE_NATIVE=1: the compiler refuses -march=native; unset CNCORE_NATIVE for the "
                         "portable build")
    compile_args.append("-march=native")
compile_args.append("-pthread")
link_args.append("-pthread")

extensions = [
    Extension(
        "cncore._core",
        # cn_globals.c defines the C globals that the headers declare (one copy for the extension);
        # cn_isa_*.c are the hot kernels once per instruction-set level (cn_isa.h).
        sources=["cython_src/cncore/_core.pyx", "cython_src/src/cn_globals.c", "cython_src/src/cn_isa_base.c",
                 "cython_src/src/cn_isa_v3.c", "cython_src/src/cn_isa_v4.c"],
        include_dirs=["cython_src/include", numpy.get_include()],
        depends=sorted(glob.glob(os.path.join("cython_src", "include", "*.h")) +
                       glob.glob(os.path.join("cython_src", "src", "*.h"))),
        extra_compile_args=compile_args,
        extra_link_args=link_args,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
]

setup(
    ext_modules=cythonize(
        extensions,
        include_path=["cython_src"],
        compiler_directives={"language_level": 3},
    ),
)
