/* cn_isa_v4.c: the hot kernels for x86-64-v4 (v3 + AVX-512 F/BW/CD/DQ/VL; cn_isa.h). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("arch=x86-64-v4")
#define CN_ISA_LEVEL v4
#include "cn_isa_kernels.h"
#endif
