/* XXH64, the 64-bit xxHash (Yann Collet's reference algorithm): the fast
 * content hash of checkpoint files. FNV-1a (rng.c) reads a byte at a time
 * and tops out near 1 GB/s; this reads 8-byte words in four lanes. */
#include "hypertrain/base.h"

#include <string.h>

#define P1 11400714785074694791ULL
#define P2 14029467366897019727ULL
#define P3 1609587929392839161ULL
#define P4 9650029242287828579ULL
#define P5 2870177450012600261ULL

static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

/* Little-endian loads (memcpy: no alignment assumed; every supported host is little-endian). */
static inline uint64_t read64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint32_t read32(const unsigned char *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint64_t lane_round(uint64_t acc, uint64_t input) { return rotl64(acc + input * P2, 31) * P1; }

static inline uint64_t merge_round(uint64_t acc, uint64_t v) { return (acc ^ lane_round(0, v)) * P1 + P4; }

uint64_t ht_xxh64(const void *data, size_t n, uint64_t seed) {
    const unsigned char *p = data, *end = p + n;
    uint64_t h;
    if (n >= 32) {
        uint64_t v1 = seed + P1 + P2, v2 = seed + P2, v3 = seed, v4 = seed - P1;
        const unsigned char *limit = end - 32;
        do {
            v1 = lane_round(v1, read64(p));
            v2 = lane_round(v2, read64(p + 8));
            v3 = lane_round(v3, read64(p + 16));
            v4 = lane_round(v4, read64(p + 24));
            p += 32;
        } while (p <= limit);
        h = rotl64(v1, 1) + rotl64(v2, 7) + rotl64(v3, 12) + rotl64(v4, 18);
        h = merge_round(h, v1);
        h = merge_round(h, v2);
        h = merge_round(h, v3);
        h = merge_round(h, v4);
    } else {
        h = seed + P5;
    }
    h += (uint64_t)n;
    for (; p + 8 <= end; p += 8) h = rotl64(h ^ lane_round(0, read64(p)), 27) * P1 + P4;
    if (p + 4 <= end) {
        h = rotl64(h ^ (uint64_t)read32(p) * P1, 23) * P2 + P3;
        p += 4;
    }
    for (; p < end; p++) h = rotl64(h ^ (uint64_t)*p * P5, 11) * P1;
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    h ^= h >> 32;
    return h;
}
