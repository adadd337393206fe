/* The process's kernel table: the CPU's unless ht_kernels_use chose another;
 * and what a build without the CUDA backend links in its place. */
#include "hypertrain/kernels.h"

#include <stddef.h>

static const ht_kernel_ops *in_use; /* NULL: the CPU's */
const ht_kernel_ops *ht_kernels(void) { return in_use ? in_use : ht_kernels_cpu(); }
void ht_kernels_use(const ht_kernel_ops *ops) { in_use = ops; }

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
int ht_kernels_cuda_device(void) { return -1; }
#endif
