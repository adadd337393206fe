/* A param's shard as a box of its global tensor: its tensor-parallel slice,
 * setting a rank's rows or box, the bytes of each rank's rows, and the N-D box arithmetic that copies
 * the overlap of two boxes (the checkpoint's load planner reads any box from
 * whatever saved boxes overlap it). */
#include "hypertrain/param.h"

void ht_param_set_rows(ht_param *p, int64_t row0, int64_t row1) {
    ht_box box = {{0}, {0}};
    for (int d = 0; d < p->ndim; d++) {
        box.offset[d] = d == p->tp_dim ? p->tp_offset : 0;
        box.length[d] = p->shape[d];
    }
    box.offset[0] += row0;
    box.length[0] = row1 - row0;
    ht_param_set_box(p, &box);
}

void ht_param_set_box(ht_param *p, const ht_box *box) {
    p->box = (ht_box){{0}, {0}};
    for (int d = 0; d < p->ndim; d++) {
        p->box.offset[d] = box->offset[d];
        p->box.length[d] = box->length[d];
    }
    p->row0 = box->offset[0] - (p->tp_dim == 0 ? p->tp_offset : 0);
    p->row1 = p->row0 + box->length[0];
}

void ht_param_split(ht_param *p, int dim, int rank, int size) {
    int64_t first, end;
    ht_param_rows_of(p->global_shape[dim], rank, size, &first, &end);
    p->tp_dim = dim;
    p->tp_offset = first;
    p->shape[dim] = end - first;
    ht_param_set_rows(p, 0, p->shape[0]);
}

void ht_param_row_bytes(const ht_param *p, int world, int64_t *bytes, size_t elem_size) {
    int64_t row = ht_param_row_numel(p);
    for (int r = 0; r < world; r++) {
        int64_t r0, r1;
        ht_param_rows_of(p->shape[0], r, world, &r0, &r1);
        bytes[r] = (r1 - r0) * row * (int64_t)elem_size;
    }
}

int64_t ht_box_numel(int ndim, const ht_box *box) {
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) n *= box->length[d];
    return n;
}

bool ht_box_intersect(int ndim, const ht_box *a, const ht_box *b, ht_box *out) {
    for (int d = 0; d < ndim; d++) {
        int64_t lo = a->offset[d] > b->offset[d] ? a->offset[d] : b->offset[d];
        int64_t ae = a->offset[d] + a->length[d], be = b->offset[d] + b->length[d];
        int64_t hi = ae < be ? ae : be;
        if (lo >= hi) return false;
        out->offset[d] = lo;
        out->length[d] = hi - lo;
    }
    return true;
}

int64_t ht_box_copy(int ndim, void *dst, ht_dtype dst_dtype, const ht_box *dst_box, const void *src, ht_dtype src_dtype,
                    const ht_box *src_box) {
    ht_box o;
    if (!ht_box_intersect(ndim, dst_box, src_box, &o)) return 0;
    /* The innermost dims that the overlap holds whole in both boxes, and the
     * one outside them, are one contiguous run: rows of whole rows are one
     * copy. The dims before `inner` are walked. */
    int inner = ndim;
    int64_t run = 1;
    while (inner > 0) {
        int d = --inner;
        run *= o.length[d];
        if (o.length[d] != dst_box->length[d] || o.length[d] != src_box->length[d]) break;
    }
    int64_t dst_stride[HT_PARAM_MAX_DIMS], src_stride[HT_PARAM_MAX_DIMS], ds = 1, ss = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        dst_stride[d] = ds;
        src_stride[d] = ss;
        ds *= dst_box->length[d];
        ss *= src_box->length[d];
    }
    size_t dsize = ht_dtype_size(dst_dtype), ssize = ht_dtype_size(src_dtype);
    int64_t idx[HT_PARAM_MAX_DIMS] = {0};
    for (;;) {
        int64_t doff = 0, soff = 0;
        for (int d = 0; d < ndim; d++) {
            int64_t at = o.offset[d] + (d < inner ? idx[d] : 0); /* global index of the run's first element */
            doff += (at - dst_box->offset[d]) * dst_stride[d];
            soff += (at - src_box->offset[d]) * src_stride[d];
        }
        ht_convert((char *)dst + (size_t)doff * dsize, dst_dtype, (const char *)src + (size_t)soff * ssize, src_dtype,
                   (size_t)run);
        int d = inner - 1;
        while (d >= 0 && ++idx[d] == o.length[d]) idx[d--] = 0;
        if (d < 0) break;
    }
    return ht_box_numel(ndim, &o);
}
