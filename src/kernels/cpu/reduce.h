/* The largest of n floats, vectorized by hand (internal to kernels/): a
 * max written as a comparison does not vectorize under every compiler
 * (clang will not reduce it without -ffast-math), and the scores' and the
 * logits' row maxima are on the attention's and the loss's critical path.
 * NaNs are skipped, as `x > m ? x : m` skips them; the result is exact, so
 * the same bits as the scalar loop. */
#ifndef HT_KERNELS_REDUCE_H
#define HT_KERNELS_REDUCE_H

#include <immintrin.h>
#include <stdint.h>

static inline float max_of(const float *x, int64_t n, float init) {
    float r = init;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 m = _mm512_set1_ps(init);
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(_mm512_loadu_ps(x + i), m); /* a NaN in x gives m */
    r = _mm512_reduce_max_ps(m);
#elif defined(__AVX2__)
    __m256 m = _mm256_set1_ps(init);
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(_mm256_loadu_ps(x + i), m);
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    for (int l = 0; l < 8; l++) r = lanes[l] > r ? lanes[l] : r;
#endif
    for (; i < n; i++) r = x[i] > r ? x[i] : r;
    return r;
}

#endif
