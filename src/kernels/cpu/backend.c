/* The CPU's entries of the kernel table (include/hypertrain/kernels.h): the
 * functions of kernels/cpu/ (and base's dtype conversions) as they are,
 * and host memory moved with memset and memcpy. */
#include "hypertrain/kernels.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/ops.h"

#include <stdint.h>
#include <string.h>

/* In pieces across the threads: main_grad, zeroed after every step, is
 * gigabytes on a 0.5B model. */
void ht_zero(void *dst, size_t bytes) {
    enum { PIECE = 1 << 20 };
    const int64_t pieces = (int64_t)((bytes + PIECE - 1) / PIECE);
#pragma omp parallel for if (pieces > 1) schedule(static)
    for (int64_t i = 0; i < pieces; i++) {
        const size_t off = (size_t)i * PIECE;
        memset((char *)dst + off, 0, bytes - off < PIECE ? bytes - off : PIECE);
    }
}
/* upload, download and copy alike: host memory to host memory */
void ht_copy(void *dst, const void *src, size_t bytes) {
    if (bytes) memcpy(dst, src, bytes);
}
void ht_upload(void *dst, const void *host_src, size_t bytes) { ht_copy(dst, host_src, bytes); }
void ht_download(void *host_dst, const void *src, size_t bytes) { ht_copy(host_dst, src, bytes); }

static bool cpu_owns(const void *p) {
    (void)p;
    return false;
}
static size_t cpu_peak_bytes(void) { return 0; }
static ht_status cpu_synchronize(ht_error *err) { return ht_gemm_status(err); }

#define SLOT(kind, type, name, params, args, arrays) SLOT_##kind(name)
#define SLOT_OWN(name) /* below */
#define SLOT_SIZE(name) .name = ht_##name,
#define SLOT_GEMM SLOT_SIZE
#define SLOT_RUN SLOT_SIZE
#define SLOT_GET SLOT_SIZE
static const ht_kernel_ops cpu = {.name = "cpu",
                                  .host_memory = true,
                                  .lm_head_chunk_bytes = HT_CPU_LM_HEAD_CHUNK_BYTES,
                                  .alloc = ht_alloc,
                                  .free = ht_free,
                                  .owns = cpu_owns,
                                  .peak_bytes = cpu_peak_bytes,
                                  .synchronize = cpu_synchronize,
                                  HT_KERNEL_ENTRIES(SLOT)};

const ht_kernel_ops *ht_kernels_cpu(void) { return &cpu; }
