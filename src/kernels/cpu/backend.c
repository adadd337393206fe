/* The CPU's entries of the kernel table (include/hypertrain/kernels.h): the
 * functions of kernels/ (and base's dtype conversions) as they are, and
 * host memory moved with memset and memcpy. */
#include "hypertrain/kernels.h"
#include "kernels/cpu/ops.h"

#include <stdint.h>
#include <string.h>

/* In pieces across the threads: main_grad, zeroed after every step, is
 * gigabytes on a 0.5B model. */
static void cpu_zero(void *dst, size_t bytes) {
    enum { PIECE = 1 << 20 };
    const int64_t pieces = (int64_t)((bytes + PIECE - 1) / PIECE);
#pragma omp parallel for if (pieces > 1) schedule(static)
    for (int64_t i = 0; i < pieces; i++) {
        const size_t off = (size_t)i * PIECE;
        memset((char *)dst + off, 0, bytes - off < PIECE ? bytes - off : PIECE);
    }
}
/* upload, download and copy alike: host memory to host memory */
static void cpu_copy(void *dst, const void *src, size_t bytes) {
    if (bytes) memcpy(dst, src, bytes);
}
static bool cpu_owns(const void *p) {
    (void)p;
    return false;
}
static size_t cpu_peak_bytes(void) { return 0; }
static ht_status cpu_synchronize(ht_error *err) { return ht_gemm_status(err); }

static const ht_kernel_ops cpu = {
    .name = "cpu",
    .host_memory = true,
    .lm_head_chunk_bytes = HT_CPU_LM_HEAD_CHUNK_BYTES,
    .alloc = ht_alloc,
    .free = ht_free,
    .owns = cpu_owns,
    .peak_bytes = cpu_peak_bytes,
    .zero = cpu_zero,
    .upload = cpu_copy,
    .download = cpu_copy,
    .copy = cpu_copy,
    .synchronize = cpu_synchronize,
    .gemm = ht_gemm,
    .gemm_ragged = ht_gemm_ragged,
    .gemm_batched = ht_gemm_batched,
    .convert = ht_convert,
    .round_to = ht_round_to,
    .rmsnorm_forward = ht_rmsnorm_forward,
    .rmsnorm_backward = ht_rmsnorm_backward,
    .add_bias = ht_add_bias,
    .bias_backward = ht_bias_backward,
    .rope_forward = ht_rope_forward,
    .rope_backward = ht_rope_backward,
    .swiglu_forward = ht_swiglu_forward,
    .swiglu_backward = ht_swiglu_backward,
    .cross_entropy_forward = ht_cross_entropy_forward,
    .cross_entropy_backward = ht_cross_entropy_backward,
    .softmax_partial = ht_softmax_partial,
    .attention_workspace_floats = ht_attention_workspace_floats,
    .attention_forward = ht_attention_forward,
    .attention_backward = ht_attention_backward,
    .attention_merge = ht_attention_merge,
    .embedding_forward = ht_embedding_forward,
    .embedding_backward = ht_embedding_backward,
    .gather_rows = ht_gather_rows,
    .scatter_rows = ht_scatter_rows,
    .moe_route = ht_moe_route,
    .moe_combine = ht_moe_combine,
    .moe_combine_backward = ht_moe_combine_backward,
    .moe_route_backward = ht_moe_route_backward,
    .moe_scatter_add = ht_moe_scatter_add,
    .moe_route_grouped = ht_moe_route_grouped,
    .moe_route_grouped_backward = ht_moe_route_grouped_backward,
    .dropout = ht_dropout,
    .sum_squares = ht_sum_squares,
    .sum_squares_each = ht_sum_squares_each,
    .add = ht_add,
    .accumulate = ht_accumulate,
    .copy_rows = ht_copy_rows,
    .scale = ht_scale,
    .adamw = ht_adamw_pass,
    .muon_momentum = ht_muon_momentum,
    .muon_apply = ht_muon_apply,
    .ns_workspace_floats = ht_ns_workspace_floats,
    .newton_schulz = ht_ns_iterate,
};

const ht_kernel_ops *ht_kernels_cpu(void) { return &cpu; }
