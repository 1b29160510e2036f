/* cn_mix.h: the 64-bit mixer (SplitMix64's finaliser) behind the key index's hash and the
 * initialiser's per-row stream. */
#ifndef CN_MIX_H
#define CN_MIX_H

#include <stdint.h>

static inline uint64_t cn_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

#endif
