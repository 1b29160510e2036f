/* cn_init.h: deterministic row initialisation.
 *
 * A new row's value is a pure function of (table seed, key, column): a counter-based generator
 * (hash of the counter, no state), so the same key gets the same row whatever the insertion
 * order, batch composition, thread count or shard. The per-column draw is a 32-bit
 * MurmurHash3 finaliser, which vectorises, so initialising a row costs about as much as
 * writing it.
 */
#ifndef CN_INIT_H
#define CN_INIT_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include "cn_global.h"
#include "cn_mix.h"
#include "cn_parallel.h"

/* Contraction
 * -----------
 * Everything below is compiled without floating-point contraction: GCC's default
 * (-ffp-contract=fast) fuses `low + span * u` into one multiply-add wherever the target has FMA,
 * which rounds once instead of twice, so a key's initial row would differ in the last bit
 * between a build (or an instruction-set level, cn_isa.h) with FMA and one without. Without
 * contraction the row is the same bits on every x86-64 level, in every build, and in NumPy's
 * float32 re-derivation (tests/reference.py). The functions below still inline into one another
 * (they share these options); their callers call cn_init_row, which is not inlined anyway. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif

enum { CN_INIT_UNIFORM = 0, CN_INIT_NORMAL = 1, CN_INIT_TRUNCATED_NORMAL = 2, CN_INIT_CONSTANT = 3 };

typedef struct {
    int kind;
    uint64_t seed;
    float p0, p1; /* uniform: low, high; normal / truncated: mean, std; constant: value */
    float p2, p3; /* truncated normal: low, high (absolute bounds, as torch.nn.init.trunc_normal_) */
} cn_init;

static inline uint64_t cn_row_stream(uint64_t seed, int64_t key) {
    return cn_mix64(cn_mix64((uint64_t)key) ^ (seed * 0x9E3779B97F4A7C15ULL + 0x632BE59BD9B4E019ULL));
}

static inline uint32_t cn_draw32(uint64_t stream, uint32_t counter) {
    uint32_t h = ((uint32_t)stream + counter * 0x9E3779B9u) ^ (uint32_t)(stream >> 32);
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    h ^= h >> 16;
    return h;
}

/* [0, 1) with 24 random bits. */
static inline float cn_unit(uint32_t bits) { return (float)(int32_t)(bits >> 8) * (1.0f / 16777216.0f); }

/* (0, 1], for the logarithm in Box-Muller. */
static inline float cn_unit_open(uint32_t bits) { return (float)(int32_t)((bits >> 8) + 1) * (1.0f / 16777216.0f); }

/* Branch-free logf and cos(2 pi u), so that the initialisation loop vectorises (libm's calls
 * do not) and gives the same bits on every machine that runs IEEE float arithmetic.
 * cn_logf: |error| < 1e-6 on (0, 1]; cn_cos2pi: |error| < 2e-7 (checked against libm on every input the draws can produce). */
static inline float cn_logf(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    int32_t e = (int32_t)((bits >> 23) & 0xff) - 127;
    uint32_t mbits = (bits & 0x007fffffu) | 0x3f800000u;
    float m;
    memcpy(&m, &mbits, sizeof m); /* x = m * 2^e, m in [1, 2) */
    const int big = m > 1.41421356f;
    m = big ? 0.5f * m : m;       /* m in [0.707, 1.414) */
    e += big;
    const float s = (m - 1.0f) / (m + 1.0f); /* log m = 2 atanh(s), |s| < 0.172 */
    const float s2 = s * s;
    const float series = 1.0f + s2 * (1.0f / 3 + s2 * (1.0f / 5 + s2 * (1.0f / 7 + s2 * (1.0f / 9))));
    return (float)e * 0.69314718056f + 2.0f * s * series;
}

static inline float cn_cos2pi(float u) { /* cos(2 pi u), u in [0, 1) */
    float t = u > 0.5f ? 1.0f - u : u;  /* cos is even around 0 and 1: t in [0, 0.5] */
    const int flip = t > 0.25f;          /* cos(2 pi t) = -cos(2 pi (0.5 - t)) */
    t = flip ? 0.5f - t : t;             /* t in [0, 0.25] */
    const float x = 6.283185307f * t, x2 = x * x;
    const float c = 1.0f + x2 * (-1.0f / 2 + x2 * (1.0f / 24 + x2 * (-1.0f / 720 + x2 * (1.0f / 40320 +
                    x2 * (-1.0f / 3628800 + x2 * (1.0f / 479001600))))));
    return flip ? -c : c;
}

/* Box-Muller: a standard normal from two draws. */
static inline float cn_std_normal(uint64_t stream, uint32_t counter) {
    float u1 = cn_unit_open(cn_draw32(stream, 2 * counter));
    float u2 = cn_unit(cn_draw32(stream, 2 * counter + 1));
    return sqrtf(-2.0f * cn_logf(u1)) * cn_cos2pi(u2);
}

/* The standard normal CDF and its inverse, in double (the truncated normal's slow path).
 * The inverse is Acklam's rational approximation (relative error < 1.2e-9) refined by one
 * Halley step against erfc where exp(x^2 / 2) cannot overflow. */
static inline double cn_phi(double x) { return 0.5 * erfc(-x * 0.70710678118654752440); }

static inline double cn_phi_inv(double p) {
    static const double a[6] = {-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02,
                                1.383577518672690e+02, -3.066479806614716e+01, 2.506628277459239e+00};
    static const double b[5] = {-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
                                6.680131188771972e+01, -1.328068155288572e+01};
    static const double c[6] = {-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
                                -2.549732539343734e+00, 4.374664141464968e+00, 2.938163982698783e+00};
    static const double d[4] = {7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
                                3.754408661907416e+00};
    const double p_low = 0.02425;
    double x;
    if (p < p_low) {
        const double q = sqrt(-2.0 * log(p));
        x = (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
            ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1.0);
    } else if (p <= 1.0 - p_low) {
        const double q = p - 0.5, r = q * q;
        x = (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q /
            (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1.0);
    } else {
        const double q = sqrt(-2.0 * log1p(-p));
        x = -(((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
            ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1.0);
    }
    if (fabs(x) < 8.0) {
        const double e = cn_phi(x) - p;
        const double u = e * 2.50662827463100050242 * exp(0.5 * x * x);
        x = x - u / (1.0 + 0.5 * x * u);
    }
    return x;
}

/* A standard normal restricted to [a, b], by inverse CDF from u in (0, 1). An interval above
 * the mean is sampled as its mirror below it and negated: lower-tail probabilities keep their
 * relative precision (Phi(-3.96) = 3.7e-5 is exact to 16 digits; 1 - Phi(3.96) is not). */
static inline double cn_truncated_std_normal(double a, double b, double u) {
    const int flip = a > 0.0;
    if (flip) {
        const double t = a;
        a = -b;
        b = -t;
    }
    const double pa = cn_phi(a), pb = cn_phi(b);
    double x = cn_phi_inv(pa + u * (pb - pa));
    x = x < a ? a : (x > b ? b : x);
    return flip ? -x : x;
}

/* Not inlined: one compiled body for every caller. Inlined, each call site was compiled on its
 * own, and with -march=native GCC contracts `low + span * u` into a fused multiply-add at
 * some sites and not others (its default -ffp-contract=fast), so a store's new row and
 * initial_rows() of the same key differed in the last bit once a caller's loop changed
 * (found by test_store_stateful after a prefetch was added to the insert loop). A call per
 * row costs nothing beside the row's dim draws. */
__attribute__((noinline)) static void cn_init_row(const cn_init *init, int64_t key, float *restrict row,
                                                  int64_t dim) {
    uint64_t s = cn_row_stream(init->seed, key);
    switch (init->kind) {
    case CN_INIT_UNIFORM: {
        float low = init->p0, span = init->p1 - init->p0;
        for (int64_t d = 0; d < dim; d++) row[d] = low + span * cn_unit(cn_draw32(s, (uint32_t)d));
        break;
    }
    case CN_INIT_NORMAL:
        for (int64_t d = 0; d < dim; d++) row[d] = init->p0 + init->p1 * cn_std_normal(s, (uint32_t)d);
        break;
    case CN_INIT_TRUNCATED_NORMAL: {
        /* A first normal draw for every column (a loop that vectorises) is kept where it falls
         * inside [low, high]; each column outside is drawn again from the truncated
         * distribution itself by inverse CDF, with draw counter 2 dim + d (the normal draws use 0 .. 2 dim - 1): a mixture of "inside on the
         * first draw" and "drawn from the truncated law" is exactly the truncated law, and a
         * row stays a pure function of (seed, key, column). Rejection sampling, the former
         * slow path, gave up after 1000 tries on narrow tail intervals and pinned the value at
         * `low` (98.9 % of TruncatedNormal(0, 1, 3.9, 3.96)). */
        const double mean = init->p0, std = init->p1;
        const double a = ((double)init->p2 - mean) / std, b = ((double)init->p3 - mean) / std;
        for (int64_t d = 0; d < dim; d++) row[d] = init->p0 + init->p1 * cn_std_normal(s, (uint32_t)d);
        for (int64_t d = 0; d < dim; d++) {
            if (row[d] >= init->p2 && row[d] <= init->p3) continue;
            const double u = ((double)cn_draw32(s, (uint32_t)(2 * dim + d)) + 0.5) * (1.0 / 4294967296.0);
            float v = (float)(mean + std * cn_truncated_std_normal(a, b, u));
            row[d] = v < init->p2 ? init->p2 : (v > init->p3 ? init->p3 : v);
        }
        break;
    }
    default:
        for (int64_t d = 0; d < dim; d++) row[d] = init->p0;
        break;
    }
}

typedef struct {
    const cn_init *init;
    const int64_t *keys;
    float *out;
    int64_t dim;
} cn_init_rows_of_job;

static void cn_init_rows_of_range(void *ctx, int64_t begin, int64_t end) {
    const cn_init_rows_of_job *j = (const cn_init_rows_of_job *)ctx;
    for (int64_t i = begin; i < end; i++) cn_init_row(j->init, j->keys[i], j->out + i * j->dim, j->dim);
}

/* out[i, 0:dim] = the initial row of keys[i], for i < n (what a store would insert). */
static inline void cn_init_rows_of(const cn_init *init, const int64_t *keys, int64_t n, float *out, int64_t dim,
                                   int nthreads) {
    cn_init_rows_of_job job = {init, keys, out, dim};
    cn_parallel_for(cn_init_rows_of_range, &job, n, nthreads);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

/* The initialiser of the insert path (cn_table_draw_row), which is compiled with the build's
 * flags: cn_isa_use (cn_isa.h) points this at the cn_init_row of the kernels' level, so a
 * portable build draws new rows with AVX-512 or AVX2 where the CPU has them. NULL (a C driver
 * that links cn_globals.c alone, or before module initialisation): the including unit's own.
 * The row is the same bits either way (no contraction above). Measured (AMD EPYC, both builds
 * in one process, 4096 new keys a training lookup, pooling 1, 8M x 64): before, the portable
 * build's lookup took 1.11-1.24x the native build's time, its base-level cn_init_row 2.9x the
 * samples of native's. */
typedef void (*cn_init_row_fn)(const cn_init *init, int64_t key, float *restrict row, int64_t dim);
CN_GLOBAL cn_init_row_fn cn_init_row_active;

static inline void cn_init_row_of_level(const cn_init *init, int64_t key, float *restrict row, int64_t dim) {
    const cn_init_row_fn f = cn_init_row_active;
    if (f != NULL)
        f(init, key, row, dim);
    else
        cn_init_row(init, key, row, dim);
}

#endif
