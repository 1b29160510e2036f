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
#include "cn_mix.h"

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

static inline float cn_std_normal(uint64_t stream, uint32_t counter) {
    float u1 = cn_unit_open(cn_draw32(stream, 2 * counter));
    float u2 = cn_unit(cn_draw32(stream, 2 * counter + 1));
    return sqrtf(-2.0f * logf(u1)) * cosf(6.283185307179586f * u2);
}

static inline void cn_init_row(const cn_init *init, int64_t key, float *restrict row, int64_t dim) {
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
    case CN_INIT_TRUNCATED_NORMAL:
        for (int64_t d = 0; d < dim; d++) {
            float v = init->p2;
            /* Rejection sampling; each retry draws from a fresh counter, so it stays a pure
             * function of (seed, key, column). Bounds are validated to hold enough mass. */
            for (uint32_t attempt = 0; attempt < 1000; attempt++) {
                float z = init->p0 + init->p1 * cn_std_normal(s, (uint32_t)d + attempt * (uint32_t)dim);
                if (z >= init->p2 && z <= init->p3) {
                    v = z;
                    break;
                }
            }
            row[d] = v;
        }
        break;
    default:
        for (int64_t d = 0; d < dim; d++) row[d] = init->p0;
        break;
    }
}

#endif
