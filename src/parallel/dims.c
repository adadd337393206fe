/* The one owner of the mesh (docs/DESIGN.md, The mesh): the groups of every
 * axis, split once from the world by ht_mesh_of's colors, and freed once. */
#include "hypertrain/parallel.h"

#include <string.h>

#include "hypertrain/model.h"

void ht_parallel_single(ht_parallel *par, ht_comm *world) {
    memset(par, 0, sizeof(*par));
    par->world = world;
    par->sizes = (ht_mesh_sizes){.world = 1, .tp = 1, .ulysses = 1, .ring = 1, .ep = 1, .shard = 1, .pp = 1};
    ht_mesh_of(&par->sizes, 0, &par->mesh);
    par->shard = par->replica = par->cp = par->ulysses = par->ring = par->tp = par->model = par->pp = par->tied =
        ht_comm_single();
    par->dp_size = par->cp_size = par->tp_size = par->pp_size = 1;
}

/* A virtual world's groups are virtual too: their rank and size are the mesh's. */
static ht_status split(ht_comm *world, ht_mesh_group g, ht_comm **out, ht_error *err) {
    if (!ht_comm_is_virtual(world)) return ht_comm_split(world, g.color, g.key, out, err);
    if (!(*out = ht_comm_virtual(g.key, g.size))) return ht_fail(err, HT_ERR_OOM, "out of memory for a virtual group");
    return HT_OK;
}

ht_status ht_parallel_init(ht_parallel *par, const ht_mesh_sizes *sizes, ht_comm *world, ht_error *err) {
    ht_parallel_single(par, world);
    par->sizes = *sizes;
    ht_mesh *m = &par->mesh;
    ht_mesh_of(sizes, world->rank, m);
    par->cp_size = m->cp_size;
    par->dp_size = m->dp_size;
    par->dp_rank = m->dp;
    par->tp_size = m->tp_group.size;
    par->pp_size = m->pp_size;
    par->pp_rank = m->pp;
    par->sharded = m->shard_group.size > 1;
    /* Each split replaces a single group: a failure leaves the rest single, and ht_parallel_free frees them all. */
    ht_status s = split(world, m->shard_group, &par->shard, err);
    if (s == HT_OK) s = split(world, m->replica_group, &par->replica, err);
    if (s == HT_OK) s = split(world, m->cp_group, &par->cp, err);
    if (s == HT_OK) s = split(world, m->ulysses_group, &par->ulysses, err);
    if (s == HT_OK) s = split(world, m->ring_group, &par->ring, err);
    if (s == HT_OK) s = split(world, m->tp_group, &par->tp, err);
    if (s == HT_OK) s = split(world, m->model_group, &par->model, err);
    if (s == HT_OK) s = split(world, m->pp_group, &par->pp, err);
    if (s == HT_OK) s = split(world, m->tied_group, &par->tied, err);
    if (s == HT_OK && m->ep_group.size > 1) s = split(world, m->expert_group, &par->expert, err);
    if (s == HT_OK && m->ep_group.size > 1) s = split(world, m->ep_group, &par->ep, err);
    return s;
}

void ht_parallel_free(ht_parallel *par) {
    ht_comm *groups[] = {par->tied, par->pp, par->ring,   par->tp,      par->model, par->ulysses,
                         par->cp,   par->ep, par->expert, par->replica, par->shard};
    for (size_t i = 0; i < sizeof(groups) / sizeof(groups[0]); i++)
        if (groups[i]) ht_comm_free(groups[i]);
    ht_comm *world = par->world;
    memset(par, 0, sizeof(*par));
    par->world = world;
}

void ht_parallel_log(const ht_parallel *par) {
    const ht_mesh *m = &par->mesh;
    const int W = par->sizes.world;
    ht_log_info("Mesh: %d ranks = pipeline stages %d x data parallel %d x context parallel %d (Ulysses %d x ring %d) x "
                "tensor parallel %d; expert parallel %d over data x context; FSDP shard groups of %d, %d replica(s)",
                W, m->pp_size, m->dp_size, m->cp_size, m->ulysses_group.size, m->ring_group.size, m->tp_group.size,
                m->ep_group.size, m->shard_group.size, m->replica_group.size);
    const int shown = W < 64 ? W : 64;
    for (int q = 0; q < shown; q++) {
        ht_mesh o;
        ht_mesh_of(&par->sizes, q, &o);
        ht_log_info(
            "  rank %d: stage %d, dp %d, cp %d (ulysses %d, ring %d), tp %d, ep %d; shard group %d (rank %d of %d)", q,
            o.pp, o.dp, o.cp, o.ulysses, o.ring, o.tp, o.ep, o.shard_group.color, o.shard_group.key,
            o.shard_group.size);
    }
    if (shown < W) ht_log_info("  ... and %d more ranks, by the same rule", W - shown);
}

void ht_parallel_finish_grads(const ht_parallel *par, ht_fsdp *fsdp, ht_param_store *params, bool sequence_parallel) {
    ht_fsdp_finish_backward(fsdp);
    ht_fsdp_reduce_replicas(fsdp, par->replica, params->grad_block, (int64_t)(params->grad_bytes / sizeof(float)));
    /* A tied embedding: the first stage's gradient plus the last's (its LM head's), on both. */
    for (int i = 0; par->tied->size > 1 && i < params->count; i++) {
        ht_param *p = &params->items[i];
        if (p->stage_tied && p->trainable && p->main_grad)
            ht_all_reduce_f32(par->tied, p->main_grad, ht_param_local_numel(p), HT_REDUCE_SUM);
    }
    if (par->tp_size <= 1 || !sequence_parallel) return;
    for (int i = 0; i < params->count; i++) {
        ht_param *p = &params->items[i];
        if (p->trainable && p->main_grad && p->tp_dim < 0)
            ht_all_reduce_f32(par->tp, p->main_grad, ht_param_local_numel(p), HT_REDUCE_SUM);
    }
}

void ht_parallel_max_logits(const ht_parallel *par, float *max_logit, int64_t n) {
    ht_all_reduce_f32(par->shard, max_logit, n, HT_REDUCE_MAX);
    ht_all_reduce_f32(par->replica, max_logit, n, HT_REDUCE_MAX);
}

const int32_t *ht_parallel_token_share(const ht_parallel *par, const ht_context_parallel *cp, const int32_t *in, int B,
                                       int T, int Tc, int32_t *out) {
    if (par->cp_size <= 1) return in;
    for (int b = 0; b < B; b++)
        for (int i = 0; i < Tc; i++) out[(int64_t)b * Tc + i] = in[(int64_t)b * T + ht_context_position(cp, Tc, i)];
    return out;
}
