/* The counter-based streams that initialise the weights: Philox4x32-10
 * against Random123's published answers, the normal values against
 * Box-Muller in double on the same words, their distribution (moments and a
 * Kolmogorov-Smirnov test on 2^20 draws), and a range of values equal to the
 * slice of the whole stream, whatever the offset and the thread count; and
 * the same values from every build. */
#include "harness.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#define DRAWS (1 << 20)

/* Random123's kat_vectors for philox4x32_10: counter, key, answer. */
static void test_philox_known_answers(void **state) {
    (void)state;
    static const uint32_t kat[3][10] = {
        {0, 0, 0, 0, 0, 0, 0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8},
        {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0x408f276d, 0x41c83b0e, 0xa20bc7c6,
         0x6d5451fd},
        {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0, 0xd16cfe09, 0x94fdcceb, 0x5001e420,
         0x24126ea1},
    };
    for (int i = 0; i < 3; i++) {
        uint32_t out[4];
        ht_philox4x32(kat[i], kat[i] + 4, out);
        for (int k = 0; k < 4; k++) assert_int_equal(out[k], kat[i][6 + k]);
    }
}

/* Block j of stream `key` through the scalar reference. */
static void block(uint64_t key, uint64_t j, uint32_t w[4]) {
    uint32_t ctr[4] = {(uint32_t)j, (uint32_t)(j >> 32), 0, 0}, k[2] = {(uint32_t)key, (uint32_t)(key >> 32)};
    ht_philox4x32(ctr, k, w);
}

/* Value i of the normal stream in double: Box-Muller on words (a, b) of its
 * block, u1 as the stream forms it in FP32 (in (0, 1]), the angle 2π b / 2^32
 * exactly. */
static double normal_reference(uint64_t key, int64_t i) {
    uint32_t w[4];
    block(key, (uint64_t)i / 4, w);
    uint32_t a = w[i % 4 < 2 ? 0 : 2], b = w[i % 4 < 2 ? 1 : 3];
    double u1 = (double)(((float)(int32_t)(a >> 1) + 0.5f) * 0x1p-31f);
    double r = sqrt(-2.0 * log(u1)), theta = 2.0 * M_PI * ((double)b * 0x1p-32);
    return i % 2 == 0 ? r * cos(theta) : r * sin(theta);
}

/* Within 2^-21 of the double value, relative to max(1, |z|): the FP32 log,
 * square root and polynomials, a few ulps each (measured: 2.3e-7). The
 * first key's first block is the first answer above: the stream is Philox's. */
static void test_normal_matches_double_box_muller(void **state) {
    (void)state;
    const uint64_t keys[] = {0, 42 ^ 0x9e3779b97f4a7c15ULL, UINT64_MAX};
    float *z = malloc(DRAWS * sizeof(float));
    double worst = 0;
    for (int k = 0; k < 3; k++) {
        ht_random_normal(z, DRAWS, keys[k], 0, 1.0f);
        for (int64_t i = 0; i < DRAWS; i++) {
            double ref = normal_reference(keys[k], i), e = fabs(z[i] - ref) / fmax(1.0, fabs(ref));
            if (e > worst) worst = e;
            if (!(e <= 0x1p-21))
                fail_msg("key %d value %lld: %.9g, Box-Muller in double %.9g", k, (long long)i, z[i], ref);
        }
    }
    print_message("normal stream vs double Box-Muller: worst %.2e (relative to max(1, |z|))\n", worst);
    free(z);
}

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* The Kolmogorov-Smirnov distance of n sorted values from a CDF. */
static double ks_distance(const float *x, int64_t n, double (*cdf)(double)) {
    double d = 0;
    for (int64_t i = 0; i < n; i++) {
        double f = cdf(x[i]);
        d = fmax(d, fmax(fabs((double)(i + 1) / n - f), fabs(f - (double)i / n)));
    }
    return d;
}

static double normal_cdf(double x) { return 0.5 * erfc(-x / sqrt(2.0)); }
static double uniform_cdf(double x) { return x < 0 ? 0 : x > 1 ? 1 : x; }

/* N(0, 1) by its moments (each within 5 standard errors of the sample's
 * moment) and by the KS test at the 0.1% level (critical distance 1.95 /
 * sqrt(n)); the tail past 3σ within 5 binomial standard errors; neighbours
 * (the two of a pair, and across pairs) uncorrelated. scale multiplies. */
static void test_normal_distribution(void **state) {
    (void)state;
    const int64_t n = DRAWS;
    float *z = malloc((size_t)n * sizeof(float)), *z2 = malloc((size_t)n * sizeof(float));
    ht_random_normal(z, n, 0x1234, 0, 1.0f);
    ht_random_normal(z2, n, 0x1234, 0, 0.02f);
    double m1 = 0, m2 = 0, m3 = 0, m4 = 0, lag1 = 0, lag2 = 0, tail = 0;
    for (int64_t i = 0; i < n; i++) {
        double x = z[i];
        assert_true(z2[i] == 0.02f * z[i]);
        m1 += x, m2 += x * x, m3 += x * x * x, m4 += x * x * x * x;
        if (i + 1 < n) lag1 += x * z[i + 1];
        if (i + 2 < n) lag2 += x * z[i + 2];
        tail += fabs(x) > 3.0;
    }
    m1 /= n, m2 /= n, m3 /= n, m4 /= n, lag1 /= n - 1, lag2 /= n - 2, tail /= n;
    const double se = 1.0 / sqrt((double)n), p3 = erfc(3.0 / sqrt(2.0));
    print_message("normal: mean %.2e, var %.5f, m3 %.2e, m4 %.4f, lag-1 %.2e, lag-2 %.2e, P(|z| > 3) %.5f (%.5f)\n", m1,
                  m2, m3, m4, lag1, lag2, tail, p3);
    assert_true(fabs(m1) < 5 * se);
    assert_true(fabs(m2 - 1) < 5 * sqrt(2.0) * se);
    assert_true(fabs(m3) < 5 * sqrt(15.0) * se);
    assert_true(fabs(m4 - 3) < 5 * sqrt(96.0) * se);
    assert_true(fabs(lag1) < 5 * se && fabs(lag2) < 5 * se);
    assert_true(fabs(tail - p3) < 5 * sqrt(p3 * (1 - p3)) * se);
    qsort(z, (size_t)n, sizeof(float), cmp_float);
    double d = ks_distance(z, n, normal_cdf);
    print_message("normal: KS distance %.2e (critical at 0.1%%: %.2e)\n", d, 1.95 * se);
    assert_true(d < 1.95 * se);
    free(z);
    free(z2);
}

/* Value i: word i % 4 of block i / 4, its top 24 bits; uniform by KS. */
static void test_uniform(void **state) {
    (void)state;
    const int64_t n = DRAWS;
    float *u = malloc((size_t)n * sizeof(float));
    ht_random_uniform(u, n, 7, 0);
    for (int64_t i = 0; i < n; i += 997) {
        uint32_t w[4];
        block(7, (uint64_t)i / 4, w);
        assert_true(u[i] == (float)(w[i % 4] >> 8) * 0x1p-24f);
    }
    double mean = 0;
    for (int64_t i = 0; i < n; i++) {
        assert_true(u[i] >= 0.0f && u[i] < 1.0f);
        mean += u[i];
    }
    mean /= n;
    assert_true(fabs(mean - 0.5) < 5 * sqrt(1.0 / 12) / sqrt((double)n));
    qsort(u, (size_t)n, sizeof(float), cmp_float);
    assert_true(ks_distance(u, n, uniform_cdf) < 1.95 / sqrt((double)n));
    free(u);
}

/* Rows [r0, r1) drawn alone equal the slice of the whole tensor drawn at
 * once, bit for bit, at offsets that cut Philox blocks and batches, on 1 and
 * 2 threads: what one process and N ranks need to agree. */
static void test_ranges_equal_slices(void **state) {
    (void)state;
    const int64_t n = 300007;
    float *whole = malloc((size_t)n * sizeof(float)), *part = malloc((size_t)n * sizeof(float));
    float *uwhole = malloc((size_t)n * sizeof(float));
    ht_random_normal(whole, n, 99, 0, 0.5f);
    ht_random_uniform(uwhole, n, 99, 0);
    const int64_t cuts[][2] = {{0, 1}, {1, 3}, {3, 64}, {5, 123}, {63, 65}, {64, 64}, {1001, 70000}, {150001, 150006}};
    int saved = omp_get_max_threads();
    for (int threads = 1; threads <= 2; threads++) {
        omp_set_num_threads(threads);
        for (size_t c = 0; c < sizeof(cuts) / sizeof(cuts[0]); c++) {
            int64_t first = cuts[c][0], count = cuts[c][1];
            ht_random_normal(part, count, 99, first, 0.5f);
            assert_memory_equal(part, whole + first, (size_t)count * sizeof(float));
            ht_random_uniform(part, count, 99, first);
            assert_memory_equal(part, uwhole + first, (size_t)count * sizeof(float));
        }
        ht_random_normal(part, n, 99, 0, 0.5f);
        assert_memory_equal(part, whole, (size_t)n * sizeof(float));
    }
    omp_set_num_threads(saved);
    /* A neighbouring key is another stream. */
    ht_random_normal(part, 64, 98, 0, 0.5f);
    int same = 0;
    for (int i = 0; i < 64; i++) same += part[i] == whole[i];
    assert_true(same < 4);
    free(whole);
    free(part);
    free(uwhole);
}

/* The streams are part of what a seed means: a change to them changes every
 * model's initial weights. These hashes (FNV-1a 64 of the bytes of values
 * [12345, 12345 + 2^20) of key 42) are what gcc -O3 -march=native (AVX-512),
 * clang -O3 -march=x86-64-v3 (AVX2) and gcc -O0 -march=x86-64-v2 (no FMA
 * unit: fmaf in software) all computed, on 1 and 2 threads. */
static void test_streams_are_pinned(void **state) {
    (void)state;
    float *v = malloc(DRAWS * sizeof(float));
    ht_random_normal(v, DRAWS, 42, 12345, 1.0f);
    assert_int_equal(ht_fnv1a64(v, DRAWS * sizeof(float), HT_FNV64_INIT), 0x5ad9206b456fcfa2ULL);
    ht_random_uniform(v, DRAWS, 42, 12345);
    assert_int_equal(ht_fnv1a64(v, DRAWS * sizeof(float), HT_FNV64_INIT), 0xfe852d507d545a40ULL);
    free(v);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_philox_known_answers), cmocka_unit_test(test_normal_matches_double_box_muller),
        cmocka_unit_test(test_normal_distribution),  cmocka_unit_test(test_uniform),
        cmocka_unit_test(test_ranges_equal_slices),  cmocka_unit_test(test_streams_are_pinned),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
