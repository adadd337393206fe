/* A param's whole tensor from the ranks' parts: its rows over a shard
 * group, and its tensor-parallel slices over a tensor-parallel group (what
 * Muon's whole matrices, the final weights and training.dump_state read). */
#include "hypertrain/param.h"

#include <stdlib.h>

#include "hypertrain/kernels.h"

void ht_param_gather_rows(const ht_param *p, ht_comm *comm, const void *rows, void *full, size_t elem_size) {
    int64_t bytes[comm->size];
    ht_param_row_bytes(p, comm->size, bytes, elem_size);
    ht_all_gather(comm, rows, full, bytes);
}

/* The bytes of each tensor-parallel rank's slice of p (elements of
 * elem_size): the global shape with dim tp_dim cut as ht_param_split cuts it. */
static void slice_bytes(const ht_param *p, int size, int64_t *bytes, size_t elem_size) {
    const int64_t whole = ht_param_global_numel(p), along = p->global_shape[p->tp_dim];
    for (int r = 0; r < size; r++) {
        int64_t first, end;
        ht_param_rows_of(along, r, size, &first, &end);
        bytes[r] = whole / along * (end - first) * (int64_t)elem_size;
    }
}

ht_status ht_param_gather_global(const ht_param *p, ht_comm *shard, ht_comm *tp, const void *rows, ht_dtype dtype,
                                 void *global, bool to_root, void *scratch, ht_error *err) {
    const size_t elem = ht_dtype_size(dtype);
    const bool split = tp && tp->size > 1 && p->tp_dim >= 0;
    int64_t bytes[shard->size > (tp ? tp->size : 1) ? shard->size : (tp ? tp->size : 1)];
    /* A param every place holds whole: the first place's rows are the tensor. */
    if (to_root && !split && tp && tp->size > 1 && tp->rank != 0) return HT_OK;
    void *slice = global, *stage = NULL, *owned = NULL;
    if (split) { /* the slice, then (dim 1) the slices side by side */
        owned = scratch ? NULL : malloc((size_t)(ht_param_numel(p) + ht_param_global_numel(p)) * elem + 1);
        if (!scratch && !owned)
            return ht_fail(err, HT_ERR_OOM, "cannot gather %s's %lld values", p->name,
                           (long long)ht_param_global_numel(p));
        slice = scratch ? scratch : owned;
        stage = p->tp_dim == 0 ? global : (char *)slice + (size_t)ht_param_numel(p) * elem;
    }
    ht_param_row_bytes(p, shard->size, bytes, elem);
    if (to_root)
        ht_gather(shard, rows, shard->rank == 0 ? slice : NULL, bytes, 0);
    else
        ht_all_gather(shard, rows, slice, bytes);
    /* The shard groups' first ranks of one data x context place are one
     * tensor-parallel group: they gather the slices. */
    const bool receives = !to_root || (shard->rank == 0 && (!split || tp->rank == 0));
    if (split && (!to_root || shard->rank == 0)) {
        slice_bytes(p, tp->size, bytes, elem);
        if (to_root)
            ht_gather(tp, slice, tp->rank == 0 ? stage : NULL, bytes, 0);
        else
            ht_all_gather(tp, slice, stage, bytes);
    }
    if (split && receives && stage != global) { /* slices of dim 1 side by side: each into its columns */
        const ht_kernel_ops *K = ht_kernels();
        if (K->owns(global)) { /* the kernels' memory (Muon's FP32 matrices): their row copies */
            if (p->ndim != 2 || dtype != HT_DTYPE_F32 || !K->owns(stage))
                return ht_fail(err, HT_ERR_INVALID, "cannot gather %s's slices in the %s backend's memory", p->name,
                               K->name);
            const int64_t rows = p->global_shape[0], cols = p->global_shape[1];
            const float *at = stage;
            for (int r = 0; r < tp->size; r++) {
                int64_t first, end;
                ht_param_rows_of(cols, r, tp->size, &first, &end);
                K->copy_rows((float *)global + first, cols, at, end - first, rows, end - first, false);
                at += rows * (end - first);
            }
            free(owned);
            return HT_OK;
        }
        ht_box whole = {{0}, {0}}, part = {{0}, {0}};
        for (int d = 0; d < p->ndim; d++) whole.length[d] = part.length[d] = p->global_shape[d];
        const char *at = stage;
        for (int r = 0; r < tp->size; r++) {
            int64_t first, end;
            ht_param_rows_of(p->global_shape[p->tp_dim], r, tp->size, &first, &end);
            part.offset[p->tp_dim] = first;
            part.length[p->tp_dim] = end - first;
            ht_box_copy(p->ndim, global, dtype, &whole, at, dtype, &part);
            at += (size_t)ht_box_numel(p->ndim, &part) * elem;
        }
    }
    free(owned);
    return HT_OK;
}
