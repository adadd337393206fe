/* dtype conversions: every bf16 and f16 bit pattern both ways, and float32
 * edge cases, against exact arithmetic on the bit fields, and where the
 * compiler has _Float16 (__FLT16_MAX__: gcc on x86-64, clang only with
 * AVX512-FP16) against its IEEE conversions as well. */
#include "harness.h"

#include <math.h>
#include <string.h>

#include "hypertrain/ckpt.h"

static uint32_t bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

static float from_bits(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* The value of an f16 pattern from its fields, in double (exact): subnormals
 * are mantissa · 2^-24, normals (1024 + mantissa) · 2^(exponent − 25). */
static double f16_reference_value(uint16_t h) {
    int sign = h >> 15, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    double v = exponent == 0    ? ldexp(mantissa, -24)
               : exponent == 31 ? (mantissa ? NAN : INFINITY)
                                : ldexp(1024 + mantissa, exponent - 25);
    return sign ? -v : v;
}

/* f32 -> f16 by exact double arithmetic: the largest f16 not above |x| and
 * the next one up, the nearer wins, ties to the even mantissa. Past the
 * largest finite f16 (65504) the next one up is Inf, reached at 65536. */
static uint16_t f16_reference(float x) {
    uint16_t sign = (uint16_t)((bits(x) >> 16) & 0x8000);
    double dx = fabs((double)x);
    if (isnan(x)) return 0x7e00 | sign;
    uint16_t lo = 0;
    for (uint16_t step = 0x4000; step; step >>= 1) /* binary search over 0 .. 0x7c00 */
        if (lo + step <= 0x7c00 && f16_reference_value((uint16_t)(lo + step)) <= dx) lo = (uint16_t)(lo + step);
    if (lo == 0x7c00 || f16_reference_value(lo) == dx) return lo | sign;
    uint16_t hi = (uint16_t)(lo + 1);
    double dhi = hi == 0x7c00 ? 65536.0 : f16_reference_value(hi);
    double elo = dx - f16_reference_value(lo), ehi = dhi - dx;
    uint16_t r = elo < ehi ? lo : ehi < elo ? hi : (lo & 1) ? hi : lo;
    return r | sign;
}

#ifdef __FLT16_MAX__
static float f16_compiler_widen(uint16_t h) {
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}

static uint16_t f16_compiler_narrow(float x) {
    _Float16 v = (_Float16)x;
    uint16_t h;
    memcpy(&h, &v, 2);
    return h;
}
#endif

/* f16 -> f32 for all 65,536 patterns. */
static void test_f16_to_f32_all(void **state) {
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        double want = f16_reference_value((uint16_t)h);
        float got = ht_f16_to_f32((uint16_t)h);
        if (isnan(want)) {
            assert_true(isnan(got));
            assert_int_equal(bits(got) >> 31, h >> 15);
        } else {
            assert_true((double)got == want);
            assert_int_equal(bits(got) >> 31, h >> 15); /* −0 stays −0 */
        }
#ifdef __FLT16_MAX__
        float compiler = f16_compiler_widen((uint16_t)h);
        if (!isnan(compiler)) assert_int_equal(bits(got), bits(compiler));
#endif
    }
}

/* f32 -> f16: every f16 value, every midpoint between neighbours (ties), and
 * values just off the midpoints. */
static void check_f32_to_f16(float x) {
    uint16_t got = ht_f32_to_f16(x);
    if (isnan(x)) {
        assert_true((got & 0x7c00) == 0x7c00 && (got & 0x3ff) != 0);
        assert_true(got & 0x200); /* quiet */
        return;
    }
    uint16_t want = f16_reference(x);
    if (got != want) fail_msg("f32 %a (0x%08x) -> f16 0x%04x, want 0x%04x", (double)x, bits(x), got, want);
#ifdef __FLT16_MAX__
    if (got != f16_compiler_narrow(x))
        fail_msg("f32 %a -> f16 0x%04x, _Float16 0x%04x", (double)x, got, f16_compiler_narrow(x));
#endif
}

static void test_f32_to_f16_all(void **state) {
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        float v = ht_f16_to_f32((uint16_t)h);
        check_f32_to_f16(v);
        if ((h & 0x7fff) >= 0x7c00) continue;
        float next = ht_f16_to_f32((uint16_t)(h + 1));
        if ((h & 0x7fff) == 0x7bff) next = (h & 0x8000) ? -65536.0f : 65536.0f; /* the Inf boundary */
        float mid = (float)(((double)v + (double)next) / 2.0);                  /* exact in f32 */
        check_f32_to_f16(mid);
        check_f32_to_f16(nextafterf(mid, 0.0f));
        check_f32_to_f16(nextafterf(mid, INFINITY));
        check_f32_to_f16(nextafterf(mid, -INFINITY));
    }
    /* f32 values far outside f16's range: deep subnormals and huge values. */
    for (uint32_t e = 0; e < 256; e++) {
        check_f32_to_f16(from_bits(e << 23 | 0x2aaaaa));
        check_f32_to_f16(from_bits(0x80000000u | e << 23 | 0x7fffff));
    }
}

/* bf16 -> f32 is exact: the bits move up 16 places. */
static void test_bf16_to_f32_all(void **state) {
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        float got = ht_bf16_to_f32((uint16_t)h);
        assert_int_equal(bits(got), h << 16);
    }
}

/* f32 -> bf16 reference by exact double arithmetic: pick the nearer of the two
 * bf16 neighbours, ties to the even mantissa. */
static uint16_t bf16_reference(float x) {
    uint32_t u = bits(x);
    if (isnan(x)) return (uint16_t)((u >> 16) | 0x40);
    uint16_t lo = (uint16_t)(u >> 16); /* truncation: toward zero */
    if ((u & 0xffff) == 0) return lo;
    uint16_t hi = (uint16_t)(lo + 1); /* away from zero (may become Inf) */
    double dx = fabs((double)x);
    double dlo = fabs((double)from_bits((uint32_t)lo << 16));
    double dhi = fabs((double)from_bits((uint32_t)hi << 16)); /* Inf when hi is Inf */
    if ((hi & 0x7fff) == 0x7f80) dhi = ldexp(1.0, 128);       /* the rounding point past max */
    double elo = dx - dlo, ehi = dhi - dx;
    if (elo < ehi) return lo;
    if (ehi < elo) return hi;
    return (lo & 1) ? hi : lo;
}

static void test_f32_to_bf16_all(void **state) {
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        uint32_t base = h << 16;
        static const uint32_t lows[] = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff};
        for (size_t i = 0; i < sizeof(lows) / sizeof(lows[0]); i++) {
            float x = from_bits(base | lows[i]);
            uint16_t got = ht_f32_to_bf16(x);
            uint16_t want = bf16_reference(x);
            if (isnan(x)) {
                assert_true(isnan(ht_bf16_to_f32(got)));
                assert_true(got & 0x40);
            } else if (got != want) {
                fail_msg("f32 0x%08x -> bf16 0x%04x, want 0x%04x", base | lows[i], got, want);
            }
        }
    }
}

static void test_edge_cases(void **state) {
    (void)state;
    /* Ties: 1 + 2^-8 sits halfway between bf16 1.0 and 1.0078125: ties to even (1.0). */
    assert_int_equal(ht_f32_to_bf16(1.00390625f), 0x3f80);
    assert_int_equal(ht_f32_to_bf16(1.01171875f), 0x3f82); /* halfway to odd neighbour: up to even */
    /* Overflow: the largest float rounds to bf16 Inf; f16 overflows at 65520. */
    assert_int_equal(ht_f32_to_bf16(3.4028235e38f), 0x7f80);
    assert_int_equal(ht_f32_to_f16(65519.0f), 0x7bff);
    assert_int_equal(ht_f32_to_f16(65520.0f), 0x7c00);
    assert_int_equal(ht_f32_to_f16(-1e9f), 0xfc00);
    /* Infinities and signed zeros. */
    assert_int_equal(ht_f32_to_bf16(INFINITY), 0x7f80);
    assert_int_equal(ht_f32_to_bf16(-INFINITY), 0xff80);
    assert_int_equal(ht_f32_to_f16(INFINITY), 0x7c00);
    assert_int_equal(ht_f32_to_f16(-0.0f), 0x8000);
    assert_int_equal(ht_f32_to_bf16(-0.0f), 0x8000);
    /* f16 subnormals: 2^-24 is the smallest, 2^-25 ties to zero, just above rounds up. */
    assert_int_equal(ht_f32_to_f16(0x1p-24f), 0x0001);
    assert_int_equal(ht_f32_to_f16(0x1p-25f), 0x0000);
    assert_int_equal(ht_f32_to_f16(nextafterf(0x1p-25f, 1.0f)), 0x0001);
    assert_int_equal(ht_f32_to_f16(0x3p-25f), 0x0002); /* 1.5 units ties to even 2 */
    /* f32 subnormals go to zero in f16 and keep their bits in bf16 (truncated + rounded). */
    assert_int_equal(ht_f32_to_f16(from_bits(0x00000001)), 0x0000);
    assert_int_equal(ht_f32_to_bf16(from_bits(0x00010000)), 0x0001);
    /* NaN stays NaN. */
    assert_true(isnan(ht_bf16_to_f32(ht_f32_to_bf16(NAN))));
    assert_true(isnan(ht_f16_to_f32(ht_f32_to_f16(NAN))));
    assert_true(isnan(ht_bf16_to_f32(ht_f32_to_bf16(from_bits(0x7f800001))))); /* sNaN must not become Inf */
}

static void test_bulk_convert(void **state) {
    (void)state;
    enum { N = 100003 };
    static float src[N], back[N];
    static uint16_t half[N];
    ht_rng rng;
    ht_rng_seed(&rng, 7);
    for (int i = 0; i < N; i++) src[i] = ht_rng_normal(&rng) * 100.0f;
    ht_convert(half, HT_DTYPE_BF16, src, HT_DTYPE_F32, N);
    ht_convert(back, HT_DTYPE_F32, half, HT_DTYPE_BF16, N);
    for (int i = 0; i < N; i++) assert_int_equal(half[i], ht_f32_to_bf16(src[i]));
    for (int i = 0; i < N; i++) assert_true(fabsf(back[i] - src[i]) <= fabsf(src[i]) * 0x1p-8f);
    ht_convert(half, HT_DTYPE_F16, src, HT_DTYPE_F32, N);
    for (int i = 0; i < N; i++) assert_int_equal(half[i], ht_f32_to_f16(src[i]));
}

/* Against PyTorch (tools/reference/make_dtype_fixtures.py): its casts of
 * 100,000 float32 values (ties, subnormals, overflow edges, Inf, NaN) and its
 * widening of every bf16 and f16 pattern. NaN payloads differ between code
 * paths, so a NaN only has to stay a NaN. */
static void test_against_torch(void **state) {
    (void)state;
    ht_safetensors *st;
    ht_error err;
    assert_ht_ok(ht_safetensors_open(fixture_path("dtype/torch_casts.safetensors"), &st, &err), &err);
    const ht_st_tensor *x = ht_safetensors_find(st, "f32"), *bf = ht_safetensors_find(st, "bf16_bits"),
                       *hf = ht_safetensors_find(st, "f16_bits"), *bfw = ht_safetensors_find(st, "bf16_all_to_f32"),
                       *hfw = ht_safetensors_find(st, "f16_all_to_f32");
    assert_true(x && bf && hf && bfw && hfw);
    size_t n = x->nbytes / 4;
    assert_true(n >= 100000);
    const float *xs = x->data;
    const uint16_t *bfs = bf->data, *hfs = hf->data;
    for (size_t i = 0; i < n; i++) {
        uint16_t b = ht_f32_to_bf16(xs[i]), h = ht_f32_to_f16(xs[i]);
        if (isnan(xs[i])) {
            assert_true(isnan(ht_bf16_to_f32(b)) && isnan(ht_f16_to_f32(h)));
            continue;
        }
        if (b != bfs[i]) fail_msg("bf16(0x%08x) = 0x%04x, torch 0x%04x", bits(xs[i]), b, bfs[i]);
        if (h != hfs[i]) fail_msg("f16(0x%08x) = 0x%04x, torch 0x%04x", bits(xs[i]), h, hfs[i]);
    }
    const float *bw = bfw->data, *hw = hfw->data;
    for (uint32_t u = 0; u < 65536; u++) {
        float b = ht_bf16_to_f32((uint16_t)u), h = ht_f16_to_f32((uint16_t)u);
        assert_true(isnan(bw[u]) ? isnan(b) : bits(b) == bits(bw[u]));
        assert_true(isnan(hw[u]) ? isnan(h) : bits(h) == bits(hw[u]));
    }
    ht_safetensors_close(st);
}

/* Stochastic rounding: always one of the two neighbours, unbiased on average,
 * exact values untouched, reproducible for a seed. */
static void test_stochastic_rounding(void **state) {
    (void)state;
    enum { N = 200000 };
    static float src[N];
    static uint16_t a[N], b[N];
    const ht_dtype types[2] = {HT_DTYPE_BF16, HT_DTYPE_F16};
    for (int t = 0; t < 2; t++) {
        bool bf = types[t] == HT_DTYPE_BF16;
        float x = bf ? 1.0f + 0x1p-9f : 1.0f + 0x1p-12f; /* a quarter of the way from 1 to the next value */
        float up = bf ? 1.0f + 0x1p-7f : 1.0f + 0x1p-10f;
        for (int i = 0; i < N; i++) src[i] = i % 2 ? x : -x;
        src[7] = 0.5f; /* exact */
        ht_convert_stochastic(a, types[t], src, N, 42);
        ht_convert_stochastic(b, types[t], src, N, 42);
        assert_memory_equal(a, b, sizeof(a));
        double sum = 0;
        int n = 0;
        for (int i = 1; i < N; i += 2) {
            if (i == 7) continue;
            float v = bf ? ht_bf16_to_f32(a[i]) : ht_f16_to_f32(a[i]);
            assert_true(v == 1.0f || v == up);
            sum += v;
            n++;
        }
        for (int i = 0; i < N; i += 2) {
            float v = bf ? ht_bf16_to_f32(a[i]) : ht_f16_to_f32(a[i]);
            assert_true(v == -1.0f || v == -up);
        }
        assert_true((bf ? ht_bf16_to_f32(a[7]) : ht_f16_to_f32(a[7])) == 0.5f);
        /* The mean over 100,000 draws lands within 5 standard deviations of x. */
        double p = 0.25, sd = sqrt(p * (1 - p) / n) * (double)(up - 1.0f);
        assert_true(fabs(sum / n - (double)x) < 5 * sd);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_f16_to_f32_all),  cmocka_unit_test(test_f32_to_f16_all),
        cmocka_unit_test(test_bf16_to_f32_all), cmocka_unit_test(test_f32_to_bf16_all),
        cmocka_unit_test(test_edge_cases),      cmocka_unit_test(test_bulk_convert),
        cmocka_unit_test(test_against_torch),   cmocka_unit_test(test_stochastic_rounding),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
