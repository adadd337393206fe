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
 * intrinsics. With mma.h beside it (WMMA as whole 16 x 16 tiles) the
 * backend's kernels run here against the CPU's: their indexing, masks,
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
