/* Sharded parameters over a process group: each rank holds rows [row0, row1)
 * of every parameter's data, FP32 main param, main_grad and optimizer state;
 * forward and backward read the whole tensors (the compute copies, gathered
 * after every update) and accumulate whole gradients, which are summed over
 * the ranks into each rank's rows. */
#include "hypertrain/dist.h"

#include <stdlib.h>

void ht_fsdp_row_bytes(const ht_param *p, int world, int64_t *counts, size_t elem_size) {
    int64_t row = ht_param_row_numel(p);
    for (int r = 0; r < world; r++) {
        int64_t r0, r1;
        ht_param_rows_of(p->shape[0], r, world, &r0, &r1);
        counts[r] = (r1 - r0) * row * (int64_t)elem_size;
    }
}

void ht_fsdp_reduce_grads(ht_param_store *store, ht_comm *comm) {
    int64_t counts[comm->size];
    for (int i = 0; i < store->count; i++) {
        ht_param *p = &store->items[i];
        if (!p->trainable || p->grad == p->main_grad) continue;
        ht_fsdp_row_bytes(p, comm->size, counts, 1);
        ht_reduce_scatter_f32(comm, p->grad, p->main_grad, counts);
    }
}

void ht_fsdp_gather_rows(const ht_param *p, ht_comm *comm, const void *rows, void *full, size_t elem_size) {
    int64_t bytes[comm->size];
    ht_fsdp_row_bytes(p, comm->size, bytes, elem_size);
    ht_all_gather(comm, rows, full, bytes);
}

void ht_fsdp_refresh_compute(ht_param_store *store, ht_comm *comm) {
    ht_params_refresh_compute(store);
    for (int i = 0; i < store->count; i++) {
        ht_param *p = &store->items[i];
        if (!ht_param_is_sharded(p)) continue;
        size_t es = ht_dtype_size(p->compute_dtype);
        const char *mine = (const char *)p->compute + (size_t)(p->row0 * ht_param_row_numel(p)) * es;
        ht_fsdp_gather_rows(p, comm, mine, p->compute, es);
    }
}
