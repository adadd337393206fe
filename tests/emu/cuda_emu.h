/* The CUDA a kernel source needs, run on the host: the real toolkit's
 * headers for the types and the 16-bit conversions, and, after them, a
 * block's threads as host threads (threadIdx thread-local, blockIdx one
 * block at a time, __syncthreads and __syncwarp barriers, warp shuffles
 * through a slot a lane), dynamic shared memory one buffer, and the
 * device's exact-rounding intrinsics. With mma.h beside it (WMMA as whole
 * 16 x 16 tiles), a kernel file compiles with g++ and runs its blocks here:
 * its indexing, masks, barriers and roundings tested where no GPU is,
 * against the CPU's kernels. Tensor-core summation order is not modelled
 * (each product sums in k order in FP32): what is tested is the kernel's
 * logic, not the hardware. */
#ifndef HT_TESTS_CUDA_EMU_H
#define HT_TESTS_CUDA_EMU_H
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cublasLt.h>

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#undef __device__
#undef __global__
#undef __host__
#undef __shared__
#define __device__
#define __global__
#define __host__
#define __shared__
#define __launch_bounds__(n)
#define __CUDACC__ 1
#define __CUDA_ARCH__ 900

namespace emu {
struct dim3v {
    unsigned x, y, z;
};
inline thread_local dim3v thread_idx;
inline dim3v block_idx, block_dim, grid_dim;
inline std::barrier<> *block_barrier;
inline std::barrier<> *warp_barrier[32];
inline float warp_slot[32][32]; /* (warp, lane): a shuffle's values */
} // namespace emu

#define threadIdx (emu::thread_idx)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)

inline void __syncthreads() { emu::block_barrier->arrive_and_wait(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    (void)mask;
    emu::warp_barrier[threadIdx.x / 32]->arrive_and_wait();
}
inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask) {
    const unsigned w = threadIdx.x / 32, lane = threadIdx.x % 32;
    emu::warp_slot[w][lane] = v;
    __syncwarp(mask);
    const float got = emu::warp_slot[w][lane ^ (unsigned)lane_mask];
    __syncwarp(mask);
    return got;
}

inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline unsigned __float_as_uint(float x) {
    unsigned u;
    std::memcpy(&u, &x, 4);
    return u;
}
inline int __float_as_int(float x) {
    int u;
    std::memcpy(&u, &x, 4);
    return u;
}
inline float __uint_as_float(unsigned u) {
    float x;
    std::memcpy(&x, &u, 4);
    return x;
}
inline float __int_as_float(int u) {
    float x;
    std::memcpy(&x, &u, 4);
    return x;
}
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
template <typename X, typename Better> inline X atomic_keep(X *p, X v, Better better) {
    X old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (better(v, old) && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return old;
}
inline int atomicMax(int *p, int v) {
    return atomic_keep(p, v, [](int a, int b) { return a > b; });
}
inline unsigned atomicMin(unsigned *p, unsigned v) {
    return atomic_keep(p, v, [](unsigned a, unsigned b) { return a < b; });
}

namespace emu {
/* Every block of grid, one after another, its threads as host threads;
 * the block's shared memory (the kernel file's extern array, defined by the
 * test) filled with 0xff bytes first (NaN in every float type), so that a
 * read before a write shows. */
inline void launch(dim3v grid, unsigned threads, unsigned char *shared, size_t shared_bytes,
                   const std::function<void()> &body) {
    grid_dim = grid, block_dim = {threads, 1, 1};
    std::barrier<> block((std::ptrdiff_t)threads);
    std::vector<std::barrier<> *> warps;
    for (unsigned w = 0; w < (threads + 31) / 32; w++) warps.push_back(warp_barrier[w] = new std::barrier<>(32));
    block_barrier = &block;
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                block_idx = {x, y, z};
                std::memset(shared, 0xff, shared_bytes);
                std::vector<std::thread> pool;
                for (unsigned t = 0; t < threads; t++)
                    pool.emplace_back([t, &body] {
                        thread_idx = {t, 0, 0};
                        body();
                    });
                for (auto &th : pool) th.join();
            }
    for (auto *w : warps) delete w;
}
} // namespace emu
#endif
