/* cn_isa_base.c: the hot kernels for baseline x86-64 (SSE2), what every x86-64 CPU runs
 * (cn_isa.h). The pragma lowers a -march=native build's ISA too, so that CI runs this code. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("arch=x86-64")
#endif
#define CN_ISA_LEVEL base
#include "cn_isa_kernels.h"
