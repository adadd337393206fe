/* A vectorizable exponential for the kernels (internal to kernels/). */
#ifndef HT_KERNELS_EXP_H
#define HT_KERNELS_EXP_H

#include <stdint.h>

/* e^x for x <= 0 (a score minus its row's maximum, minus |g| in a
 * sigmoid), within 2 ulp of expf, branch-free so that the loops calling it
 * vectorize: libm's expf, one call per score, was two thirds of the
 * attention's forward pass. x = n ln2 + r with |r| <= ln2/2
 * (ln2 in two parts, Cody-Waite), e^r by its Taylor polynomial to r^7 / 7!
 * (truncation 2e-9 relative), 2^n built in the exponent bits. Below -87.3
 * the result would be subnormal: the input is clamped there, so it gives
 * e^-87.3 = 1.2e-38 (the smallest normal floats), a weight too small to
 * matter next to any other in its sum, and never a subnormal. */
static inline float exp_nonpositive(float x) {
    x = x < -87.3f ? -87.3f : x;
    float n = x * 1.44269504f + 12582912.0f; /* + 1.5 * 2^23: rounds to an integer */
    n -= 12582912.0f;
    float r = x - n * 0.693145752f;
    r -= n * 1.42860677e-6f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union {
        int32_t i;
        float f;
    } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

/* 1 / (1 + e^-x) from e^-|x| (never an overflow), branch-free. */
static inline float sigmoid_fast(float x) {
    float t = exp_nonpositive(x < 0 ? x : -x);
    float r = 1.0f / (1.0f + t);
    return x >= 0 ? r : t * r;
}

#endif
