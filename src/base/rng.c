/* Deterministic random numbers: a sequential generator (xoshiro256**, seeded
 * by splitmix64; its state is four words so a checkpoint can hold it), the
 * counter-based Philox4x32-10 streams that initialise the weights, and the
 * FNV-1a 64 hash. */
#include "hypertrain/base.h"

#include <math.h>
#include <string.h>

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

/* ---------------------------------------------------------------- counter-based streams */

/* The same values from every build: no multiply is fused into an add unless
 * written as fmaf, so the loops below round alike with gcc and clang, AVX2
 * and AVX-512, vectorized or not (CMakeLists.txt builds this file without
 * errno, so that sqrtf is an instruction and vectorizes). */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u
#define PHILOX_ROUNDS 10

void ht_philox4x32(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]) {
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3], k0 = key[0], k1 = key[1];
    for (int r = 0; r < PHILOX_ROUNDS; r++, k0 += PHILOX_W0, k1 += PHILOX_W1) {
        uint64_t p0 = (uint64_t)PHILOX_M0 * c0, p1 = (uint64_t)PHILOX_M1 * c2;
        c0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        c1 = (uint32_t)p1;
        c2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c3 = (uint32_t)p0;
    }
    out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

/* Blocks j0 .. j0 + BATCH - 1 of the stream, lane by lane with the rounds
 * unrolled inside, so that the lanes vectorize: w[k][b] is word k of block
 * j0 + b. */
#define BATCH 16
static void philox_batch(uint64_t j0, uint64_t key, uint32_t w[4][BATCH]) {
    const uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    for (int b = 0; b < BATCH; b++) {
        uint32_t c0 = (uint32_t)(j0 + (uint64_t)b), c1 = (uint32_t)((j0 + (uint64_t)b) >> 32), c2 = 0, c3 = 0;
        for (uint32_t r = 0; r < PHILOX_ROUNDS; r++) {
            uint64_t p0 = (uint64_t)PHILOX_M0 * c0, p1 = (uint64_t)PHILOX_M1 * c2;
            c0 = (uint32_t)(p1 >> 32) ^ c1 ^ (k0 + r * PHILOX_W0);
            c1 = (uint32_t)p1;
            c2 = (uint32_t)(p0 >> 32) ^ c3 ^ (k1 + r * PHILOX_W1);
            c3 = (uint32_t)p0;
        }
        w[0][b] = c0, w[1][b] = c1, w[2][b] = c2, w[3][b] = c3;
    }
}

static inline uint32_t f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof(u));
    return u;
}

static inline float f32_of(uint32_t u) {
    float x;
    memcpy(&x, &u, sizeof(x));
    return x;
}

/* ln x for normal x > 0, within an ulp: x = 2^k m with m in [sqrt(1/2), sqrt(2)),
 * ln m = 2 atanh(s) with s = (m - 1) / (m + 1) as a polynomial (FreeBSD's
 * e_logf.c, whose coefficients these are). Branch-free, so it vectorizes. */
static inline float log_pos(float x) {
    uint32_t ix = f32_bits(x) + (0x3f800000u - 0x3f3504f3u);
    float k = (float)((int32_t)(ix >> 23) - 0x7f);
    float f = f32_of((ix & 0x007fffffu) + 0x3f3504f3u) - 1.0f;
    float s = f / (2.0f + f), z = s * s, w = z * z;
    float t1 = w * fmaf(w, 0.24279078841f, 0.40000972152f), t2 = z * fmaf(w, 0.28498786688f, 0.66666662693f);
    float hfsq = 0.5f * f * f;
    return s * (hfsq + (t1 + t2)) + k * 9.0580006145e-06f - hfsq + f + k * 6.9313812256e-01f;
}

/* One Box-Muller pair from the words (a, b): r = sqrt(-2 ln u1) with u1 =
 * (a/2 + 1/2) 2^-31 in (0, 1] (so |z| < 6.7), and the angle 2π b / 2^32 as
 * the quadrant q (b's top two bits, rounded) and ψ in [-π/4, π/4) from the
 * rest, where Cephes' sinf and cosf polynomials are within an ulp or two.
 * (z0, z1) = r (cos, sin) of q π/2 + ψ. */
static inline void box_muller(uint32_t a, uint32_t b, float *z0, float *z1) {
    float u1 = ((float)(int32_t)(a >> 1) + 0.5f) * 0x1p-31f;
    float r = sqrtf(-2.0f * log_pos(u1));
    uint32_t t = b + 0x20000000u, q = t >> 30;
    float psi = (float)((int32_t)(t & 0x3fffffffu) - 0x20000000) * 0x1.921fb6p-30f; /* 2π / 2^32 */
    float x2 = psi * psi;
    float sn = fmaf(psi * x2, fmaf(x2, fmaf(x2, -1.9515295891e-4f, 8.3321608736e-3f), -1.6666654611e-1f), psi);
    float cs = fmaf(x2 * x2, fmaf(x2, fmaf(x2, 2.443315711809948e-5f, -1.388731625493765e-3f), 4.166664568298827e-2f),
                    fmaf(-0.5f, x2, 1.0f));
    /* Selects and sign flips as bit masks: branch-free, so the lanes vectorize. */
    uint32_t odd = 0u - (q & 1), cbits = (f32_bits(sn) & odd) | (f32_bits(cs) & ~odd);
    uint32_t sbits = (f32_bits(cs) & odd) | (f32_bits(sn) & ~odd);
    *z0 = r * f32_of(cbits ^ ((q ^ (q >> 1)) & 1) << 31); /* cos < 0 in quadrants 1, 2 */
    *z1 = r * f32_of(sbits ^ (q >> 1) << 31);             /* sin < 0 in quadrants 2, 3 */
}

/* Values 4 j0 .. 4 (j0 + BATCH) - 1 of the normal stream. */
static void normal_batch(uint64_t j0, uint64_t key, float z[4 * BATCH]) {
    uint32_t w[4][BATCH];
    float c0[BATCH], s0[BATCH], c1[BATCH], s1[BATCH];
    philox_batch(j0, key, w);
    for (int b = 0; b < BATCH; b++) box_muller(w[0][b], w[1][b], &c0[b], &s0[b]);
    for (int b = 0; b < BATCH; b++) box_muller(w[2][b], w[3][b], &c1[b], &s1[b]);
    for (int b = 0; b < BATCH; b++) {
        z[4 * b] = c0[b];
        z[4 * b + 1] = s0[b];
        z[4 * b + 2] = c1[b];
        z[4 * b + 3] = s1[b];
    }
}

static void uniform_batch(uint64_t j0, uint64_t key, float u[4 * BATCH]) {
    uint32_t w[4][BATCH];
    philox_batch(j0, key, w);
    for (int b = 0; b < BATCH; b++)
        for (int k = 0; k < 4; k++) u[4 * b + k] = (float)(w[k][b] >> 8) * 0x1p-24f;
}

/* out[i - first] = scale · value i, i in [first, first + n): whole batches of
 * 4 BATCH values, the partial ones at the ends cut to the range. */
static void fill_stream(float *out, int64_t n, uint64_t key, int64_t first, float scale, bool normal) {
    if (n <= 0) return;
    const int64_t per = 4 * BATCH, g0 = first / per, g1 = (first + n - 1) / per;
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t g = g0; g <= g1; g++) {
        float v[4 * BATCH];
        if (normal)
            normal_batch((uint64_t)g * BATCH, key, v);
        else
            uniform_batch((uint64_t)g * BATCH, key, v);
        int64_t lo = g * per > first ? g * per : first, hi = g * per + per < first + n ? g * per + per : first + n;
        for (int64_t i = lo; i < hi; i++) out[i - first] = scale * v[i - g * per];
    }
}

void ht_random_normal(float *out, int64_t n, uint64_t key, int64_t first, float scale) {
    fill_stream(out, n, key, first, scale, true);
}

void ht_random_uniform(float *out, int64_t n, uint64_t key, int64_t first) {
    fill_stream(out, n, key, first, 1.0f, false);
}
