/* The mesh (docs/DESIGN.md, The mesh): a rank's coordinates on every axis
 * and the ht_comm_split of every group it joins, from the sizes alone. */
#include "hypertrain/parallel.h"

void ht_mesh_of(const ht_mesh_sizes *s, int rank, ht_mesh *m) {
    const int T = s->tp > 0 ? s->tp : 1, U = s->ulysses > 0 ? s->ulysses : 1, R = s->ring > 0 ? s->ring : 1;
    /* Pipeline stages outermost: a stage's W ranks are consecutive, and
     * inside a stage the axes below are laid out as in a world of W. */
    const int PP = s->pp > 1 ? s->pp : 1, W = s->world / PP, stage = rank / W;
    rank %= W;
    const int CP = U * R, X = W / T; /* the data x context ranks of one tensor-parallel place */
    const int S = s->shard > 0 ? s->shard : X, P = s->ep > 1 ? s->ep : 1, D = X / P;
    const int x = rank / T, tp = rank % T;
    *m = (ht_mesh){.tp = tp,
                   .dp = x / CP,
                   .cp = x % CP,
                   .ulysses = x % U,
                   .ring = x % CP / U,
                   .ep = x / D,
                   .pp = stage,
                   .dp_size = X / CP,
                   .cp_size = CP,
                   .pp_size = PP};
    /* A group of ranks with the same tensor-parallel place: colors
     * interleave the places, so no two places share a color; each stage's
     * colors are its own (below W, then offset by the stage). */
#define GROUP(c, k, n) ((ht_mesh_group){.color = stage * W + (c)*T + tp, .key = (k), .size = (n)})
    m->tp_group = (ht_mesh_group){.color = stage * W + x, .key = tp, .size = T};
    m->cp_group = GROUP(x / CP, x % CP, CP);
    m->ulysses_group = GROUP(x / U, x % U, U);
    m->ring_group = GROUP(x / CP * U + x % U, x % CP / U, R);
    m->shard_group = GROUP(x / S, x % S, S);
    m->replica_group = GROUP(x % S, x / S, X / S);
    m->expert_group = GROUP(x / D, x % D, D);
    m->ep_group = GROUP(x % D, x / D, P);
#undef GROUP
    /* One replica's ranks of every stage: the model once, over the stages in order. */
    m->model_group = (ht_mesh_group){.color = x / S, .key = (stage * S + x % S) * T + tp, .size = S * T * PP};
    m->pp_group = (ht_mesh_group){.color = rank, .key = stage, .size = PP};
    const bool end = stage == 0 || stage == PP - 1;
    m->tied_group =
        (ht_mesh_group){.color = end ? rank : (stage + 1) * W + rank, .key = stage, .size = end && PP > 1 ? 2 : 1};
}
