/* Context parallelism's exchanges: the model's ht_context_parallel.all_to_all
 * over the Ulysses group and its ring steps over the ring group, on the
 * same ordered collectives as FSDP's and the experts' (ht_start_exchange). */
#include "hypertrain/model.h"
#include "hypertrain/parallel.h"

static void all_to_all(void *ctx, const void *send, void *recv, int64_t bytes) {
    ht_comm *comm = ctx;
    const int P = comm->size;
    ht_span s[P], r[P];
    int first[P + 1];
    for (int q = 0; q < P; q++) {
        s[q] = (ht_span){(char *)send + q * bytes, bytes};
        r[q] = (ht_span){(char *)recv + q * bytes, bytes};
        first[q] = q;
    }
    first[P] = P;
    ht_spans sp = {s, first}, rp = {r, first};
    ht_wait(comm, ht_start_exchange(comm, &sp, &rp), NULL);
}

static void *start_shift(void *ctx, const void *send, void *recv, int64_t bytes) {
    return ht_start_shift(ctx, send, recv, bytes, 1);
}

static void wait(void *ctx, void *request, double *seconds) { ht_wait(ctx, request, seconds); }

static void sum(void *ctx, double *buf, int64_t n) { ht_all_reduce_f64(ctx, buf, n, HT_REDUCE_SUM); }

ht_status ht_context_parallel_attach(ht_model *m, ht_comm *group, ht_comm *ulysses, ht_comm *ring, ht_error *err) {
    if (ulysses->size * ring->size > 1 && !m->context_capable)
        return ht_fail(err, HT_ERR_CONFIG,
                       "parallel.ulysses_parallel_size %d x parallel.ring_attention_size %d: model %s cannot split its "
                       "sequences (its builder does not declare context parallelism); expected 1 and 1",
                       ulysses->size, ring->size, m->config.name);
    m->context = (ht_context_parallel){.ulysses = ulysses->size,
                                       .ring = ring->size,
                                       .ulysses_rank = ulysses->rank,
                                       .ring_rank = ring->rank,
                                       .all_to_all = all_to_all,
                                       .ulysses_ctx = ulysses,
                                       .start_shift = start_shift,
                                       .wait = wait,
                                       .ring_ctx = ring,
                                       .sum = sum,
                                       .group_ctx = group};
    return HT_OK;
}
