/* cn_isa_v3.c: the hot kernels for x86-64-v3 (AVX2, FMA, F16C, BMI2; cn_isa.h). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("arch=x86-64-v3")
#define CN_ISA_LEVEL v3
#include "cn_isa_kernels.h"
#endif
