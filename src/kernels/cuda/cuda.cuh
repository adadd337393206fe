/* What the CUDA backend's files share (internal to kernels/cuda/): the
 * backend's one context (device, stream, cuBLASLt handle, scratch, the first
 * failure), launch helpers, and the device versions of the CPU's dtype
 * conversions, exponential and counter-based random numbers, written to
 * give the same bits as theirs (base/dtype.c, kernels/cpu/exp.h, kernels/cpu/ops.c). */
#ifndef HT_KERNELS_CUDA_CUH
#define HT_KERNELS_CUDA_CUH

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "hypertrain/kernels.h"

/* ---------------------------------------------------------------- the context */

/* The backend's state, made once (cuda_context) and kept for the process,
 * as kernels/cpu/gemm.c keeps oneDNN's engine: every entry queues on `stream`. */
typedef struct cuda_context {
    int device;
    char name[256]; /* the device's, for logs */
    cudaStream_t stream;
    cublasLtHandle_t lt;
    void *lt_workspace; /* cuBLASLt's, lt_workspace_bytes */
    size_t lt_workspace_bytes;
    void *scratch; /* the reductions' partial sums, grown on demand */
    size_t scratch_bytes;
} cuda_context;

/* The context, or NULL with the reason in err (no device, no driver). */
cuda_context *cuda_context_get(ht_error *err);
/* The context of a backend already made (the entries' own). */
cuda_context *cuda_ctx(void);

/* Records the first failure (kept for synchronize, logged once); false. */
bool cuda_fail(const char *what, const char *detail);
/* cuda_fail when e is an error; whether it was not. */
bool cuda_ok(cudaError_t e, const char *what);
/* The host waits for stream s (cudaStreamSynchronize), counted
 * (ht_kernels_cuda_waits); a failure recorded under `what`; whether it did not fail. */
bool cuda_wait(cudaStream_t s, const char *what);
/* A launch's error, if any (cudaGetLastError), recorded under `what`. */
void cuda_check_launch(const char *what);
/* A device block of `bytes` (not zeroed), counted in the backend's peak and
 * allocations; NULL where cudaMalloc refuses (the caller's, not a failure). */
void *cuda_block(size_t bytes);
/* Gives a cuda_block back (cudaFree: after the device is done with it). */
void cuda_block_free(void *p);
/* At least `bytes` of device scratch, valid until the next call (stream order). */
void *cuda_scratch(size_t bytes);
/* HT_OK or the first failure since the process started. */
ht_status cuda_status(ht_error *err);

/* Grid-stride loops over int64 counts: blocks of CUDA_THREADS, at most
 * CUDA_MAX_BLOCKS of them (enough to fill an H200's 132 multiprocessors). */
#define CUDA_THREADS 256
#define CUDA_MAX_BLOCKS 4096
static inline unsigned cuda_blocks(int64_t n) {
    int64_t b = (n + CUDA_THREADS - 1) / CUDA_THREADS;
    return (unsigned)(b < 1 ? 1 : b > CUDA_MAX_BLOCKS ? CUDA_MAX_BLOCKS : b);
}
#define CUDA_FOR(i, n)                                                                                                 \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (int64_t)gridDim.x * blockDim.x)

/* ---------------------------------------------------------------- the entries */

/* cuda_NAME for each entry NAME of the table (include/hypertrain/kernels.h,
 * HT_KERNEL_ENTRIES): the products in gemm.cu, the decoder's kernels and
 * the reductions in ops.cu, attention in attention.cu (and flash.cu), the
 * sparse blocks in moe.cu, the optimizers' passes in optim.cu, the table's
 * own entries and the moving of bytes in backend.cu. */
#define CUDA_DECLARE(kind, type, name, params, args, arrays) CUDA_DECLARE_##kind(type, name, params)
#define CUDA_DECLARE_OWN(type, name, params) /* backend.cu's own */
#define CUDA_DECLARE_SIZE(type, name, params) type cuda_##name params;
#define CUDA_DECLARE_GEMM CUDA_DECLARE_SIZE
#define CUDA_DECLARE_RUN CUDA_DECLARE_SIZE
#define CUDA_DECLARE_GET CUDA_DECLARE_SIZE
HT_KERNEL_ENTRIES(CUDA_DECLARE)

/* Σ x² in double into *out (device memory), queued: no wait (Newton-Schulz's norms). */
void cuda_sum_squares_into(double *out, const float *x, int64_t n);

/* flash.cu: attention with 16-bit operands on tensor cores, where the dtype,
 * the head dims and the device allow (false: the plain kernels'). The
 * forward's head_max, when given, is filled with -inf by the caller. */
typedef struct cuda_flash_call {
    const ht_attention_shape *shape;
    ht_dtype dtype;
    bool forward;
    float *out, *lse, *head_max; /* forward's outputs; out and lse backward's inputs */
    const float *q, *k, *v, *dout;
    float *dq, *dk, *dv;
} cuda_flash_call;
bool cuda_flash_attention(const cuda_flash_call *c);
/* cudnn_attention.cu: the call on cuDNN's fused attention where the policy
 * (ht_kernels_cuda_set_attention) and the shape let it, timed at a shape's
 * first call against `own` (attention.cu's kernels for the same call) and
 * the faster kept; true when it ran the call (or recorded the failure),
 * false: the caller runs `own`. */
typedef void (*cuda_attention_fn)(const cuda_flash_call *c);
bool cuda_cudnn_attention(const cuda_flash_call *c, cuda_attention_fn own);
/* ---------------------------------------------------------------- device helpers */

#ifdef __CUDACC__
/* kernel<<<grid, block, shared>>>(...) on the backend's stream, and a
 * kernel's dynamic shared memory; on the host (tests/emu/cuda_emu.h, where
 * HT_CUDA_EMU is defined) a launch runs the kernel's blocks there. A
 * template kernel goes through a pointer (its commas would split the
 * macro's arguments). */
#ifdef HT_CUDA_EMU
#define CUDA_LAUNCH(kernel, grid, block, shared, ...)                                                                  \
    emu::launch(dim3(grid), dim3(block), (shared), [&] { kernel(__VA_ARGS__); })
#define CUDA_DYNAMIC_SHARED(type, name) type *name = (type *)emu::dynamic_shared
#else
#define CUDA_LAUNCH(kernel, grid, block, shared, ...)                                                                  \
    kernel<<<(grid), (block), (shared), cuda_ctx()->stream>>>(__VA_ARGS__)
#define CUDA_DYNAMIC_SHARED(type, name) extern __shared__ __align__(128) type name[]
#endif

/* CUDA_LAUNCH without shared memory, its launch error recorded under `what`. */
#define LAUNCH(what, kernel, grid, block, ...)                                                                         \
    do {                                                                                                               \
        CUDA_LAUNCH(kernel, grid, block, 0, __VA_ARGS__);                                                              \
        cuda_check_launch(what);                                                                                       \
    } while (0)

/* base.h's ht_f32_to_bf16: round to nearest even, NaN stays quiet NaN. */
__device__ __forceinline__ uint16_t dev_f32_to_bf16(float x) {
    uint32_t u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
__device__ __forceinline__ float dev_bf16_to_f32(uint16_t x) { return __uint_as_float((uint32_t)x << 16); }

/* base/dtype.c's ht_f32_to_f16, bit for bit (NaN payloads included). */
__device__ __forceinline__ uint16_t dev_f32_to_f16(float x) {
    uint32_t u = __float_as_uint(x);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u | (uint16_t)((a >> 13) & 0x3ffu);
    if (a >= 0x477ff000u) return sign | 0x7c00u;
    if (a >= 0x38800000u) {
        uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
        return sign | (uint16_t)((r - 0x38000000u) >> 13);
    }
    uint32_t e = a >> 23;
    uint32_t shift = 126u - e;
    if (shift > 24u) return sign;
    uint32_t mant = (a & 0x7fffffu) | 0x800000u;
    uint32_t q = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return sign | (uint16_t)q;
}

__device__ __forceinline__ float dev_f16_to_f32(uint16_t h) {
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0) {
        float v = __fmul_rn((float)mant, 0x1p-24f);
        return sign ? -v : v;
    }
    if (exp == 31) return __uint_as_float(sign | 0x7f800000u | (mant << 13));
    return __uint_as_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

/* Element i of an array of a float dtype (f32, bf16, f16), as FP32. */
__device__ __forceinline__ float dev_load(const void *p, ht_dtype dtype, int64_t i) {
    if (dtype == HT_DTYPE_F32) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    return dtype == HT_DTYPE_BF16 ? dev_bf16_to_f32(h) : dev_f16_to_f32(h);
}
/* x rounded to nearest even into element i of such an array. */
__device__ __forceinline__ void dev_store(void *p, ht_dtype dtype, int64_t i, float x) {
    if (dtype == HT_DTYPE_F32)
        ((float *)p)[i] = x;
    else
        ((uint16_t *)p)[i] = dtype == HT_DTYPE_BF16 ? dev_f32_to_bf16(x) : dev_f32_to_f16(x);
}
__device__ __forceinline__ uint16_t dev_to16(float x, bool bf16) {
    return bf16 ? dev_f32_to_bf16(x) : dev_f32_to_f16(x);
}
__device__ __forceinline__ float dev_from16(uint16_t h, bool bf16) {
    return bf16 ? dev_bf16_to_f32(h) : dev_f16_to_f32(h);
}

/* kernels/cpu/exp.h's exp_nonpositive, each step rounded as there (no fused
 * multiply-adds but the ones its polynomial is written with). */
__device__ __forceinline__ float dev_exp_nonpositive(float x) {
    x = x < -87.3f ? -87.3f : x;
    float n = __fadd_rn(__fmul_rn(x, 1.44269504f), 12582912.0f);
    n = __fsub_rn(n, 12582912.0f);
    float r = __fsub_rn(x, __fmul_rn(n, 0.693145752f));
    r = __fsub_rn(r, __fmul_rn(n, 1.42860677e-6f));
    float p = 1.0f / 5040.0f;
    p = __fmaf_rn(p, r, 1.0f / 720.0f);
    p = __fmaf_rn(p, r, 1.0f / 120.0f);
    p = __fmaf_rn(p, r, 1.0f / 24.0f);
    p = __fmaf_rn(p, r, 1.0f / 6.0f);
    p = __fmaf_rn(p, r, 0.5f);
    p = __fmaf_rn(p, r, 1.0f);
    p = __fmaf_rn(p, r, 1.0f);
    return __fmul_rn(p, __int_as_float(((int32_t)n + 127) << 23));
}

/* kernels/cpu/exp.h's sigmoid_fast. */
__device__ __forceinline__ float dev_sigmoid_fast(float x) {
    float t = dev_exp_nonpositive(x < 0 ? x : -x);
    float r = __fdiv_rn(1.0f, __fadd_rn(1.0f, t));
    return x >= 0 ? r : __fmul_rn(t, r);
}

/* splitmix64's finaliser (kernels/cpu/ops.c's mix64, base/dtype.c's counter_uniform). */
__device__ __forceinline__ uint64_t dev_mix64(uint64_t z) {
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* base/dtype.c's ht_convert_stochastic_at for one element: value x at index
 * i of a stream `seed` rounded to one of its two bf16/f16 neighbours. */
__device__ __forceinline__ uint16_t dev_round_stochastic(float x, bool bf16, uint64_t seed, uint64_t i) {
    uint16_t h = dev_to16(x, bf16);
    float v = dev_from16(h, bf16);
    if (v == x || !isfinite(x) || !isfinite(v)) return h;
    uint16_t lo = fabsf(v) > fabsf(x) ? (uint16_t)(h - 1) : h, hi = fabsf(v) > fabsf(x) ? h : (uint16_t)(h + 1);
    float flo = dev_from16(lo, bf16), fhi = dev_from16(hi, bf16);
    double p_hi =
        __ddiv_rn(__dsub_rn((double)fabsf(x), fabs((double)flo)), __dsub_rn(fabs((double)fhi), fabs((double)flo)));
    uint64_t z = seed + (i + 1) * 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    double u = (double)(z >> 11) * 0x1p-53;
    return u < p_hi ? hi : lo;
}

/* The sum of one float per thread over a block of blockDim.x threads (a
 * multiple of 32, at most 1024), in a fixed order: the same bits on every
 * run. Every thread gets the total. `shared` holds 32 floats. */
__device__ __forceinline__ float block_sum(float v, float *shared) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    __syncthreads(); /* shared may still be read by a previous call */
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = lane < warps ? shared[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ double block_sum_double(double v, double *shared) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = lane < warps ? shared[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
#endif

#endif
