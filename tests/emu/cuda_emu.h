/* The CUDA a kernel source needs, run on the host (included first, with
 * HT_CUDA_EMU defined, by every .cu file of kernels/cuda/ compiled for the
 * emulator): the real toolkit's headers for the types and the 16-bit
 * conversions, and after them a block's threads as fibers on the calling
 * thread (cuda_emu_runtime.cpp): threadIdx and blockIdx set as each runs,
 * __syncthreads and __syncwarp as barriers the scheduler releases once
 * every live thread of the block (of the warp) waits at them, a deadlock
 * (threads waiting at different barriers) an abort, warp shuffles through
 * a slot a lane, `__shared__` arrays as statics (the blocks run one after
 * another), dynamic shared memory one buffer filled with 0xff bytes (NaN in
 * every float type) before each block, and the device's exact-rounding
 * intrinsics, and the tensor-core instructions kernels/cuda/tc.cuh names
 * (ldmatrix, mma.sync m16n8k16) with each lane's fragments as the PTX ISA
 * lays them out, the lanes trading registers through their warp's
 * exchange. So the backend's kernels run here against the CPU's: their indexing, masks,
 * barriers and roundings are tested where no GPU is. Not modelled: the
 * order of a tensor-core product's sum (k order in FP32 here), memory
 * ordering between threads other than at barriers, timing. */
#ifndef HT_TESTS_CUDA_EMU_H
#define HT_TESTS_CUDA_EMU_H
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cublasLt.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>

#undef __device__
#undef __global__
#undef __host__
#undef __shared__
#define __device__
#define __global__
#define __host__
#define __shared__ static
#define __launch_bounds__(n)
#ifndef __CUDACC__
#define __CUDACC__ 1
#endif
#define __CUDA_ARCH__ 900

namespace emu {
extern uint3 thread_idx, block_idx;
extern dim3 block_dim, grid_dim;
extern unsigned char *dynamic_shared; /* EMU_SHARED_BYTES, 128-byte aligned */
enum { SHARED_BYTES = 232448 };       /* an H100's or H200's most a block may have */
/* Runs every block of grid, one after another; a launch the device would
 * refuse (too many threads, too much shared memory) is cudaGetLastError's. */
void launch(dim3 grid, dim3 block, size_t shared_bytes, const std::function<void()> &body);
void block_barrier();
void warp_barrier();
/* this lane's slot of its warp, for the shuffles */
double *warp_slots();
/* this warp's WARP_EXCHANGE_BYTES, for the instructions whose lanes trade registers */
enum { WARP_EXCHANGE_BYTES = 32 * 64 };
unsigned char *warp_exchange();
} // namespace emu

#define threadIdx (emu::thread_idx)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)

inline void __syncthreads() { emu::block_barrier(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    (void)mask;
    emu::warp_barrier();
}
template <typename X> inline X emu_shuffle(X v, unsigned from_lane) {
    double *slots = emu::warp_slots();
    const unsigned lane = threadIdx.x % 32;
    std::memcpy(&slots[lane], &v, sizeof(X));
    __syncwarp();
    X got;
    std::memcpy(&got, &slots[from_lane % 32], sizeof(X));
    __syncwarp();
    return got;
}
template <typename X> inline X __shfl_xor_sync(unsigned mask, X v, int lane_mask) {
    (void)mask;
    return emu_shuffle(v, (threadIdx.x % 32) ^ (unsigned)lane_mask);
}
/* Whether pred holds in every lane of the warp (whole warps: the kernels that vote run blocks of them). */
inline int __all_sync(unsigned mask, int pred) {
    (void)mask;
    if ((blockDim.x * blockDim.y * blockDim.z) % 32 != 0) {
        std::fprintf(stderr, "cuda_emu: __all_sync in a block of %u threads, not whole warps\n",
                     blockDim.x * blockDim.y * blockDim.z);
        std::abort();
    }
    int all = 1;
    for (unsigned l = 0; l < 32; l++) all &= emu_shuffle(pred ? 1 : 0, l);
    return all;
}
template <typename X> inline X __shfl_down_sync(unsigned mask, X v, unsigned delta) {
    (void)mask;
    const unsigned lane = threadIdx.x % 32;
    return emu_shuffle(v, lane + delta < 32 ? lane + delta : lane);
}
template <typename X> inline X __shfl_sync(unsigned mask, X v, int src) {
    (void)mask;
    return emu_shuffle(v, (unsigned)src);
}

/* ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16: lanes 8j..8j+7 name the
 * rows (16 bytes each) of matrix j; r[j] is its (g, 2t..2t+1), g = lane / 4,
 * t = lane % 4, or with trans its transpose's: rows 2t and 2t + 1 at column g. */
inline void emu_ldmatrix_x4(uint32_t (&r)[4], const void *row, bool trans) {
    const unsigned char **rows = (const unsigned char **)(void *)emu::warp_exchange();
    const unsigned lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    rows[lane] = (const unsigned char *)row;
    __syncwarp();
    for (unsigned j = 0; j < 4; j++) {
        if (!trans) {
            std::memcpy(&r[j], rows[8 * j + g] + 4 * t, 4);
            continue;
        }
        uint16_t lo, hi;
        std::memcpy(&lo, rows[8 * j + 2 * t] + 2 * g, 2);
        std::memcpy(&hi, rows[8 * j + 2 * t + 1] + 2 * g, 2);
        r[j] = (uint32_t)lo | (uint32_t)hi << 16;
    }
    __syncwarp();
}

inline float emu_from16(uint16_t h, bool bf16) {
    if (bf16) {
        const uint32_t u = (uint32_t)h << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
    __half_raw r;
    r.x = h;
    return __half2float(__half(r));
}

/* mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32, D = A B + D
 * with each lane's fragments as the PTX ISA lays them out (kernels/cuda/tc.cuh):
 * the warp's A (16 x 16) and B (16 x 8) gathered from every lane, each of the
 * lane's four outputs summed in k order in FP32, then added to its D. */
inline void emu_mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, bool bf16) {
    struct regs {
        uint32_t a[4], b[2];
    };
    static_assert(32 * sizeof(regs) <= emu::WARP_EXCHANGE_BYTES, "the exchange holds a warp's fragments");
    regs *x = (regs *)(void *)emu::warp_exchange();
    const unsigned lane = threadIdx.x % 32;
    x[lane] = regs{{a[0], a[1], a[2], a[3]}, {b0, b1}};
    __syncwarp();
    float A[16][16], B[16][8];
    for (unsigned l = 0; l < 32; l++) {
        const unsigned g = l / 4, t = l % 4;
        for (unsigned i = 0; i < 8; i++) {
            const uint16_t h = (uint16_t)(x[l].a[i / 2] >> (16 * (i % 2)));
            A[g + 8 * ((i / 2) % 2)][2 * t + i % 2 + 8 * (i / 4)] = emu_from16(h, bf16);
        }
        for (unsigned i = 0; i < 4; i++) {
            const uint16_t h = (uint16_t)(x[l].b[i / 2] >> (16 * (i % 2)));
            B[2 * t + i % 2 + 8 * (i / 2)][g] = emu_from16(h, bf16);
        }
    }
    __syncwarp();
    const unsigned g = lane / 4, t = lane % 4;
    for (unsigned e = 0; e < 4; e++) {
        const unsigned row = g + 8 * (e / 2), col = 2 * t + e % 2;
        float s = 0.0f;
        for (unsigned k = 0; k < 16; k++) s += A[row][k] * B[k][col];
        d[e] = d[e] + s;
    }
}

inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
template <typename To, typename From> inline To emu_bits(From x) {
    To y;
    std::memcpy(&y, &x, sizeof(y));
    return y;
}
inline unsigned __float_as_uint(float x) { return emu_bits<unsigned>(x); }
inline int __float_as_int(float x) { return emu_bits<int>(x); }
inline float __uint_as_float(unsigned u) { return emu_bits<float>(u); }
inline float __int_as_float(int u) { return emu_bits<float>(u); }
inline long long __double_as_longlong(double x) { return emu_bits<long long>(x); }
inline double __longlong_as_double(long long x) { return emu_bits<double>(x); }
/* one thread runs at a time: atomics are plain read-modify-writes */
inline int atomicMax(int *p, int v) {
    int old = *p;
    *p = old > v ? old : v;
    return old;
}
inline unsigned atomicMin(unsigned *p, unsigned v) {
    unsigned old = *p;
    *p = old < v ? old : v;
    return old;
}
template <typename X> inline X atomicAdd(X *p, X v) {
    X old = *p;
    *p = old + v;
    return old;
}
#endif
