/* Deterministic random numbers (xoshiro256**, seeded by splitmix64) and the
 * FNV-1a 64 hash. The RNG state is four words so a checkpoint can hold it. */
#include "hypertrain/base.h"

#include <math.h>

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

void ht_rng_seed(ht_rng *rng, uint64_t seed) {
    for (int i = 0; i < 4; i++) rng->s[i] = splitmix64(&seed);
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t ht_rng_next(ht_rng *rng) {
    uint64_t *s = rng->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

uint64_t ht_rng_below(ht_rng *rng, uint64_t n) {
    if (n == 0) return 0;
    uint64_t limit = UINT64_MAX - UINT64_MAX % n; /* reject the biased tail */
    uint64_t x;
    do x = ht_rng_next(rng);
    while (x >= limit);
    return x % n;
}

float ht_rng_uniform(ht_rng *rng) { return (float)(ht_rng_next(rng) >> 40) * 0x1p-24f; }

float ht_rng_normal(ht_rng *rng) {
    double u1 = ((double)(ht_rng_next(rng) >> 11) + 1.0) * 0x1p-53; /* (0, 1] */
    double u2 = (double)(ht_rng_next(rng) >> 11) * 0x1p-53;
    return (float)(sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2));
}

uint64_t ht_fnv1a64(const void *data, size_t n, uint64_t seed) {
    const unsigned char *p = data;
    uint64_t h = seed;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}
