/* Expert parallelism's all-to-all: the model's ht_expert_parallel.exchange
 * over the ranks that split the experts between them (one expert-parallel
 * group), on the same ordered collectives as FSDP's (ht_start_exchange). */
#include "hypertrain/parallel.h"
#include "hypertrain/model.h"

static void exchange(void *ctx, const void *send, const int64_t *send_bytes, void *recv, const int64_t *recv_bytes) {
    ht_comm *comm = ctx;
    const int P = comm->size;
    ht_span s[P], r[P];
    int first[P + 1];
    int64_t so = 0, ro = 0;
    for (int q = 0; q < P; q++) {
        s[q] = (ht_span){(char *)send + so, send_bytes[q]};
        r[q] = (ht_span){(char *)recv + ro, recv_bytes[q]};
        so += send_bytes[q];
        ro += recv_bytes[q];
        first[q] = q;
    }
    first[P] = P;
    ht_spans sp = {s, first}, rp = {r, first};
    ht_wait(comm, ht_start_exchange(comm, &sp, &rp), NULL);
}

void ht_expert_parallel_attach(ht_model *m, ht_comm *group) {
    m->experts = (ht_expert_parallel){.size = group->size, .rank = group->rank, .exchange = exchange, .ctx = group};
}
