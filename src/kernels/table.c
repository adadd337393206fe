/* The process's kernel table: the CPU's unless ht_kernels_use chose another;
 * the products' policy the layers above ask (the CPU's, for every backend
 * today); and what a build without the CUDA backend links in its place. */
#include "hypertrain/kernels.h"
#include "kernels/cpu/gemm.h"

#include <stddef.h>
#include <stdio.h>

static const ht_kernel_ops *in_use; /* NULL: the CPU's */
const ht_kernel_ops *ht_kernels(void) { return in_use ? in_use : ht_kernels_cpu(); }
void ht_kernels_use(const ht_kernel_ops *ops) { in_use = ops; }

ht_status ht_kernels_choose_gemm(ht_gemm_kernel bf16, ht_gemm_kernel f16, int64_t M, int64_t N, int64_t K,
                                 ht_gemm_choice *out, ht_error *err) {
    return ht_gemm_choose(bf16, f16, M, N, K, out, err);
}
void ht_kernels_use_gemm(const ht_gemm_choice *choice) { ht_gemm_use(choice); }
void ht_kernels_describe_gemm(const ht_gemm_choice *choice, char *buf, size_t n) { ht_gemm_describe(choice, buf, n); }
ht_gemm_kernel ht_kernels_gemm_kernel(ht_dtype dtype) { return ht_gemm_kernel_of(dtype); }
const char *ht_kernels_gemm_name(ht_dtype dtype) { return ht_gemm_kernel_name(dtype); }
double ht_kernels_gemm_rate(ht_dtype dtype, int64_t M, int64_t N, int64_t K) {
    return ht_gemm_rate(dtype, ht_gemm_kernel_of(dtype), M, N, K);
}
ht_dtype ht_kernels_storage(ht_dtype precision) { return ht_gemm_storage(precision); }

#ifndef HT_CUDA
/* A build without the CUDA backend (kernels/cuda/backend.cu defines it otherwise). */
const ht_kernel_ops *ht_kernels_cuda(ht_error *err) {
    ht_fail(err, HT_ERR_INVALID, "this build has no CUDA backend (cmake -DHT_CUDA=ON, make build-cuda)");
    return NULL;
}
void *ht_kernels_cuda_stream(void *stream) {
    (void)stream;
    return NULL;
}
void *ht_kernels_cuda_current_stream(void) { return NULL; }
int ht_kernels_cuda_device(void) { return -1; }
ht_cuda_attention ht_kernels_cuda_set_attention(ht_cuda_attention how) {
    (void)how;
    return HT_CUDA_ATTENTION_AUTO;
}
bool ht_kernels_cuda_cudnn(char *about, size_t n) {
    if (n) snprintf(about, n, "this build has no CUDA backend");
    return false;
}
int64_t ht_kernels_cuda_cudnn_calls(void) { return 0; }
ht_cuda_gemm ht_kernels_cuda_set_gemm(ht_cuda_gemm how) {
    (void)how;
    return HT_CUDA_GEMM_TIMED;
}
void ht_kernels_cuda_gemm_choices(int64_t *timed, int64_t *not_first) { *timed = *not_first = 0; }
void *ht_kernels_cuda_workspace(size_t bytes) {
    (void)bytes;
    return NULL;
}
void ht_kernels_cuda_free_workspaces(void) {}
int64_t ht_kernels_cuda_allocations(void) { return 0; }
int64_t ht_kernels_cuda_waits(void) { return 0; }
#endif
