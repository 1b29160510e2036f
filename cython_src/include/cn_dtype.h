/* cn_dtype.h: the storage dtype of a table's embedding values (float32, float16, bfloat16).
 *
 * Only the embedding part of a row takes the row dtype; the optimizer state stays float32
 * after it (at a 4-byte aligned offset), and every kernel computes in float32: a value is
 * widened when read and rounded when written back. Half the bytes per row on the
 * bandwidth-bound lookup, half the memory of the rows.
 *
 * Rounding: to nearest, ties to even (IEEE's default; FBGEMM's fp16 tables default to it too,
 * with stochastic rounding as an option). Chosen because it is deterministic: a row's value
 * after an update is a function of its inputs, so results stay independent of the thread
 * count and of batching, as everywhere else in the core. Stochastic rounding keeps small
 * updates from vanishing in expectation (an update below half a unit in the last place of
 * the row value is lost to nearest rounding; with bf16's 8 bits that is 1/512 of the value);
 * it needs a random stream per (row, step) to stay reproducible, and is left for later.
 * Values past the dtype's largest finite value saturate to it (float16: 65504), rather than
 * becoming inf, which would then poison every bag the row is pooled into.
 */
#ifndef CN_DTYPE_H
#define CN_DTYPE_H

#include <stdint.h>
#include <string.h>
#include "cn_global.h"
#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
/* float16 <-> float32 eight at a time. The compiler left `(float)h[d]` over _Float16 scalar:
 * a float16 forward ran at 0.42x EmbeddingBag against bfloat16's 0.79x (8M rows, one thread). */
#define CN_F16_VECTOR 1
#endif

enum { CN_ROW_F32 = 0, CN_ROW_F16 = 1, CN_ROW_BF16 = 2 };

typedef union {
    float f;
    uint32_t u;
} cn_f32_bits;

static inline int64_t cn_dtype_bytes(int dtype) { return dtype == CN_ROW_F32 ? 4 : 2; }

/* float32 slots the embedding part of a row takes (the state starts after them). */
static inline int64_t cn_dtype_row_floats(int dtype, int64_t dim) {
    return (dim * cn_dtype_bytes(dtype) + 3) / 4;
}

static inline float cn_bf16_load(uint16_t h) {
    cn_f32_bits b;
    b.u = (uint32_t)h << 16;
    return b.f;
}

static inline uint16_t cn_bf16_round(float x) {
    cn_f32_bits b;
    b.f = x;
    if ((b.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b.u >> 16) | 0x40u); /* NaN stays NaN */
    if ((b.u & 0x7fffffffu) == 0x7f800000u) return (uint16_t)(b.u >> 16);         /* inf stays inf */
    const uint32_t rounded = b.u + 0x7fffu + ((b.u >> 16) & 1u);
    uint16_t h = (uint16_t)(rounded >> 16);
    if ((h & 0x7fffu) == 0x7f80u) h = (uint16_t)((h & 0x8000u) | 0x7f7fu); /* a finite value saturates */
    return h;
}

#define CN_F16_MAX 65504.0f

static inline float cn_f16_load(uint16_t h) {
    _Float16 x;
    memcpy(&x, &h, 2);
    return (float)x;
}

static inline uint16_t cn_f16_round(float x) {
    if (x > CN_F16_MAX) x = CN_F16_MAX;
    if (x < -CN_F16_MAX) x = -CN_F16_MAX;
    _Float16 h = (_Float16)x;
    uint16_t bits;
    memcpy(&bits, &h, 2);
    return bits;
}

/* x as a value of the row dtype would read back (rounded, widened). */
static inline float cn_round_trip(int dtype, float x) {
    if (dtype == CN_ROW_F16) return cn_f16_load(cn_f16_round(x));
    if (dtype == CN_ROW_BF16) return cn_bf16_load(cn_bf16_round(x));
    return x;
}

/* dst[0:dim] = the row's values as float32. */
static inline void cn_row_load(int dtype, const void *src, float *restrict dst, int64_t dim) {
    if (dtype == CN_ROW_F32) {
        memcpy(dst, src, (size_t)dim * sizeof(float));
    } else if (dtype == CN_ROW_F16) {
        const uint16_t *restrict h = (const uint16_t *)src;
        int64_t d = 0;
#ifdef CN_F16_VECTOR
        for (; d + 8 <= dim; d += 8) _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + d))));
#endif
        for (; d < dim; d++) dst[d] = cn_f16_load(h[d]);
    } else {
        const uint16_t *restrict h = (const uint16_t *)src;
        for (int64_t d = 0; d < dim; d++) dst[d] = cn_bf16_load(h[d]);
    }
}

/* The row's values = src[0:dim], rounded to the row dtype. */
static inline void cn_row_store(int dtype, const float *restrict src, void *dst, int64_t dim) {
    if (dtype == CN_ROW_F32) {
        memcpy(dst, src, (size_t)dim * sizeof(float));
    } else if (dtype == CN_ROW_F16) {
        uint16_t *restrict h = (uint16_t *)dst;
        int64_t d = 0;
#ifdef CN_F16_VECTOR
        const __m256 hi = _mm256_set1_ps(CN_F16_MAX), lo = _mm256_set1_ps(-CN_F16_MAX);
        for (; d + 8 <= dim; d += 8) {
            /* min/max return their second operand when either is NaN: the value goes second, so
             * a NaN stays NaN as in cn_f16_round (clamped first, it became 65504) */
            const __m256 x = _mm256_max_ps(lo, _mm256_min_ps(hi, _mm256_loadu_ps(src + d)));
            _mm_storeu_si128((__m128i *)(h + d), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
#endif
        for (; d < dim; d++) h[d] = cn_f16_round(src[d]);
    } else {
        uint16_t *restrict h = (uint16_t *)dst;
        for (int64_t d = 0; d < dim; d++) h[d] = cn_bf16_round(src[d]);
    }
}

/* The conversions of the code outside the kernels (inserts, lookups and exports of rows, the
 * evicted rows a bounded table hands out, the SSD tier's records), which is compiled with the
 * build's flags: cn_isa_use (cn_isa.h) points these at the cn_row_load / cn_row_store of the
 * kernels' level, so a portable build converts 16-bit rows with F16C and AVX-512 where the CPU
 * has them. NULL (a C driver that links cn_globals.c alone, or before module initialisation):
 * the including unit's own. float32 rows stay a memcpy here (no call through a pointer). The
 * same bits either way: every level rounds to nearest even and saturates alike.
 * Measured (AMD EPYC Zen 4, both builds in one process, 2M x 64 rows, 16,384 keys a call, CPU
 * time of one thread): before, a portable build's float16 lookup took 5.2x a native build's
 * time and its insert_or_assign 9.3x (baseline x86-64 has no half-precision instructions: each
 * value went through libgcc's soft-float conversion), bfloat16's 1.1x and 1.6x (scalar
 * rounding); through these pointers 1.01-1.07x, the noise of those runs. */
typedef void (*cn_row_load_fn)(int dtype, const void *src, float *restrict dst, int64_t dim);
typedef void (*cn_row_store_fn)(int dtype, const float *restrict src, void *dst, int64_t dim);
CN_GLOBAL cn_row_load_fn cn_row_load_active;
CN_GLOBAL cn_row_store_fn cn_row_store_active;

static inline void cn_row_load_of_level(int dtype, const void *src, float *restrict dst, int64_t dim) {
    const cn_row_load_fn f = cn_row_load_active;
    if (dtype != CN_ROW_F32 && f != NULL)
        f(dtype, src, dst, dim);
    else
        cn_row_load(dtype, src, dst, dim);
}

static inline void cn_row_store_of_level(int dtype, const float *restrict src, void *dst, int64_t dim) {
    const cn_row_store_fn f = cn_row_store_active;
    if (dtype != CN_ROW_F32 && f != NULL)
        f(dtype, src, dst, dim);
    else
        cn_row_store(dtype, src, dst, dim);
}

/* o[0:dim] += w * row (the pooled forward's inner loop, vectorised per dtype). */
static inline void cn_row_axpy(int dtype, float w, const void *row, float *restrict o, int64_t dim) {
    if (dtype == CN_ROW_F32) {
        const float *restrict r = (const float *)row;
        for (int64_t d = 0; d < dim; d++) o[d] += w * r[d];
    } else if (dtype == CN_ROW_F16) {
        const uint16_t *restrict h = (const uint16_t *)row;
        int64_t d = 0;
#if defined(CN_F16_VECTOR) && defined(__FMA__)
        /* fused multiply-add, as the compiler contracts the float32 loop's o += w * r */
        const __m256 vw = _mm256_set1_ps(w);
        for (; d + 8 <= dim; d += 8) {
            const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + d)));
            _mm256_storeu_ps(o + d, _mm256_fmadd_ps(vw, x, _mm256_loadu_ps(o + d)));
        }
#endif
        for (; d < dim; d++) o[d] += w * cn_f16_load(h[d]);
    } else {
        const uint16_t *restrict h = (const uint16_t *)row;
        for (int64_t d = 0; d < dim; d++) o[d] += w * cn_bf16_load(h[d]);
    }
}

/* Sixteen float32 lanes, as the compiler's generic vectors: one zmm register with AVX-512, two
 * ymm with AVX2, four xmm on baseline x86-64 (the portable wheel), NEON elsewhere. The pooled
 * forward keeps a bag's sum in these (cn_pool.h). */
typedef float cn_v16x __attribute__((vector_size(64)));
typedef uint16_t cn_u16x16 __attribute__((vector_size(32)));
typedef uint32_t cn_u32x16 __attribute__((vector_size(64)));

/* Lanes 16k .. 16k+15 of a row, as float32, into *v. (Vectors go through pointers, not by value:
 * a function that returns a 64-byte vector changes the ABI where AVX-512 is off, and GCC warns
 * about every one in the portable build.) */
static inline __attribute__((always_inline)) void cn_v16x_load_row(const int dtype, const void *row, int k,
                                                                   cn_v16x *v) {
    if (dtype == CN_ROW_F32) {
        memcpy(v, (const float *)row + 16 * k, sizeof(*v));
    } else if (dtype == CN_ROW_BF16) {
        cn_u16x16 h;
        memcpy(&h, (const uint16_t *)row + 16 * k, sizeof(h));
        const cn_u32x16 u = __builtin_convertvector(h, cn_u32x16) << 16;
        memcpy(v, &u, sizeof(*v));
    } else {
        const uint16_t *h = (const uint16_t *)row + 16 * k;
#ifdef CN_F16_VECTOR
        const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
        const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 8)));
        memcpy(v, &lo, 32);
        memcpy((char *)v + 32, &hi, 32);
#else
        float f[16];
        for (int d = 0; d < 16; d++) f[d] = cn_f16_load(h[d]);
        memcpy(v, f, sizeof(*v));
#endif
    }
}

/* Value d of a row. */
static inline float cn_row_get(int dtype, const void *row, int64_t d) {
    if (dtype == CN_ROW_F32) return ((const float *)row)[d];
    if (dtype == CN_ROW_F16) return cn_f16_load(((const uint16_t *)row)[d]);
    return cn_bf16_load(((const uint16_t *)row)[d]);
}

#endif
