/* The three float storage formats and exact round-to-nearest-even conversions
 * between them (docs/NUMERICS.md, floating-point formats), plus dtype names. */
#include "hypertrain/base.h"

#include <math.h>
#include <string.h>

static const struct {
    const char *name;
    const char *st_name;
    size_t size;
    bool is_float;
} dtype_info[HT_DTYPE_COUNT] = {
    [HT_DTYPE_F32] = {"float32", "F32", 4, true}, [HT_DTYPE_BF16] = {"bfloat16", "BF16", 2, true},
    [HT_DTYPE_F16] = {"float16", "F16", 2, true}, [HT_DTYPE_I32] = {"int32", "I32", 4, false},
    [HT_DTYPE_I64] = {"int64", "I64", 8, false},  [HT_DTYPE_U16] = {"uint16", "U16", 2, false},
    [HT_DTYPE_U8] = {"uint8", "U8", 1, false},
};

size_t ht_dtype_size(ht_dtype dtype) { return dtype < HT_DTYPE_COUNT ? dtype_info[dtype].size : 0; }
bool ht_dtype_is_float(ht_dtype dtype) { return dtype < HT_DTYPE_COUNT && dtype_info[dtype].is_float; }
const char *ht_dtype_name(ht_dtype dtype) { return dtype < HT_DTYPE_COUNT ? dtype_info[dtype].name : "?"; }
const char *ht_dtype_safetensors_name(ht_dtype dtype) {
    return dtype < HT_DTYPE_COUNT ? dtype_info[dtype].st_name : "?";
}

bool ht_dtype_from_name(const char *name, ht_dtype *out) {
    for (int i = 0; i < HT_DTYPE_COUNT; i++) {
        if (strcmp(name, dtype_info[i].name) == 0) {
            *out = (ht_dtype)i;
            return true;
        }
    }
    return false;
}

bool ht_dtype_from_safetensors_name(const char *name, ht_dtype *out) {
    for (int i = 0; i < HT_DTYPE_COUNT; i++) {
        if (strcmp(name, dtype_info[i].st_name) == 0) {
            *out = (ht_dtype)i;
            return true;
        }
    }
    return false;
}

static inline uint32_t f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

static inline float f32_from_bits(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

uint16_t ht_f32_to_f16(float x) {
    uint32_t u = f32_bits(x);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u | (uint16_t)((a >> 13) & 0x3ffu); /* quiet NaN */
    if (a >= 0x477ff000u) return sign | 0x7c00u; /* >= 65520 rounds to Inf (65520 is a tie to even Inf) */
    if (a >= 0x38800000u) {                      /* normal f16: rebias 127 -> 15 and round 13 bits */
        uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
        return sign | (uint16_t)((r - 0x38000000u) >> 13);
    }
    /* Subnormal f16 (or zero): count in units of 2^-24, round to nearest even. */
    uint32_t e = a >> 23;
    uint32_t shift = 126u - e;    /* >= 14 here */
    if (shift > 24u) return sign; /* below 2^-25: rounds to zero */
    uint32_t mant = (a & 0x7fffffu) | 0x800000u;
    uint32_t q = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return sign | (uint16_t)q;
}

float ht_f16_to_f32(uint16_t h) {
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0) {
        float v = (float)mant * 0x1p-24f; /* exact: subnormal or zero */
        return sign ? -v : v;
    }
    if (exp == 31) return f32_from_bits(sign | 0x7f800000u | (mant << 13));
    return f32_from_bits(sign | ((exp + 112u) << 23) | (mant << 13));
}

/* One thread's conversion of n elements between different dtypes. */
static void convert_serial(void *dst, ht_dtype dst_dtype, const void *src, ht_dtype src_dtype, size_t n) {
    const uint16_t *s16 = src;
    uint16_t *d16 = dst;
    float *d32 = dst;
    const float *s32 = src;
    if (dst_dtype == HT_DTYPE_F32 && src_dtype == HT_DTYPE_BF16) {
#pragma omp simd
        for (size_t i = 0; i < n; i++) d32[i] = ht_bf16_to_f32(s16[i]);
    } else if (dst_dtype == HT_DTYPE_F32 && src_dtype == HT_DTYPE_F16) {
        for (size_t i = 0; i < n; i++) d32[i] = ht_f16_to_f32(s16[i]);
    } else if (dst_dtype == HT_DTYPE_BF16 && src_dtype == HT_DTYPE_F32) {
#pragma omp simd
        for (size_t i = 0; i < n; i++) d16[i] = ht_f32_to_bf16(s32[i]);
    } else if (dst_dtype == HT_DTYPE_F16 && src_dtype == HT_DTYPE_F32) {
        for (size_t i = 0; i < n; i++) d16[i] = ht_f32_to_f16(s32[i]);
    } else { /* bf16 <-> f16 goes through f32, which holds both exactly. */
        for (size_t i = 0; i < n; i++) {
            float v = src_dtype == HT_DTYPE_BF16 ? ht_bf16_to_f32(s16[i]) : ht_f16_to_f32(s16[i]);
            d16[i] = dst_dtype == HT_DTYPE_BF16 ? ht_f32_to_bf16(v) : ht_f32_to_f16(v);
        }
    }
}

/* Large conversions split across the threads, in chunks; small ones, and
 * any inside a parallel region (a kernel's rows), run on the calling thread
 * without entering the OpenMP runtime. */
enum { CONVERT_CHUNK = 65536 };

void ht_convert(void *dst, ht_dtype dst_dtype, const void *src, ht_dtype src_dtype, size_t n) {
    if (dst_dtype == src_dtype) {
        memmove(dst, src, n * ht_dtype_size(dst_dtype));
        return;
    }
    if (n <= CONVERT_CHUNK) {
        convert_serial(dst, dst_dtype, src, src_dtype, n);
        return;
    }
    const size_t ds = ht_dtype_size(dst_dtype), ss = ht_dtype_size(src_dtype);
    const size_t chunks = (n + CONVERT_CHUNK - 1) / CONVERT_CHUNK;
#pragma omp parallel for schedule(static)
    for (size_t c = 0; c < chunks; c++) {
        size_t first = c * CONVERT_CHUNK, len = n - first < CONVERT_CHUNK ? n - first : CONVERT_CHUNK;
        convert_serial((char *)dst + first * ds, dst_dtype, (const char *)src + first * ss, src_dtype, len);
    }
}

/* A uniform [0, 1) from (seed, i): splitmix64's finaliser over the pair. */
static inline double counter_uniform(uint64_t seed, uint64_t i) {
    uint64_t z = seed + (i + 1) * 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return (double)(z >> 11) * 0x1p-53;
}

void ht_convert_stochastic(uint16_t *dst, ht_dtype dst_dtype, const float *src, size_t n, uint64_t seed) {
    ht_convert_stochastic_at(dst, dst_dtype, src, n, seed, 0);
}

void ht_convert_stochastic_at(uint16_t *dst, ht_dtype dst_dtype, const float *src, size_t n, uint64_t seed,
                              size_t first) {
    bool bf16 = dst_dtype == HT_DTYPE_BF16;
#pragma omp parallel for if (n > 65536) schedule(static)
    for (size_t i = 0; i < n; i++) {
        float x = src[i];
        uint16_t h = bf16 ? ht_f32_to_bf16(x) : ht_f32_to_f16(x);
        float v = bf16 ? ht_bf16_to_f32(h) : ht_f16_to_f32(h);
        if (v == x || !isfinite(x) || !isfinite(v)) {
            dst[i] = h;
            continue;
        }
        /* Neighbours in magnitude: the sign bit is separate, so +-1 on the pattern moves away from or toward 0. */
        uint16_t lo = fabsf(v) > fabsf(x) ? (uint16_t)(h - 1) : h, hi = fabsf(v) > fabsf(x) ? h : (uint16_t)(h + 1);
        float flo = bf16 ? ht_bf16_to_f32(lo) : ht_f16_to_f32(lo), fhi = bf16 ? ht_bf16_to_f32(hi) : ht_f16_to_f32(hi);
        double p_hi = ((double)fabsf(x) - fabs((double)flo)) / (fabs((double)fhi) - fabs((double)flo));
        dst[i] = counter_uniform(seed, first + i) < p_hi ? hi : lo;
    }
}

void ht_round_to(float *x, size_t n, ht_dtype precision) {
    if (precision == HT_DTYPE_BF16) {
#pragma omp parallel for if (n > 65536) schedule(static)
        for (size_t i = 0; i < n; i++) x[i] = ht_bf16_to_f32(ht_f32_to_bf16(x[i]));
    } else if (precision == HT_DTYPE_F16) {
#pragma omp parallel for if (n > 65536) schedule(static)
        for (size_t i = 0; i < n; i++) x[i] = ht_f16_to_f32(ht_f32_to_f16(x[i]));
    }
}
