/* The loader: deals the windows of one split to data-parallel ranks in a
 * per-epoch order that depends only on (seed, epoch), so any position can be
 * restored exactly. It reads the dataset's tokens in place. */
#include "hypertrain/data.h"

#include <stdlib.h>
#include <string.h>

/* The order of an epoch is rebuilt from the identity every time, never from
 * the previous epoch, so that a resumed loader sees the same permutation. */
static void shuffle_epoch(ht_loader *l) {
    if (!l->shuffle) return;
    for (size_t i = 0; i < l->n_windows; i++) l->perm[i] = (uint32_t)i;
    uint64_t key[2] = {l->seed, l->pos.epoch};
    ht_rng rng;
    ht_rng_seed(&rng, ht_fnv1a64(key, sizeof(key), HT_FNV64_INIT));
    for (size_t i = l->n_windows - 1; i > 0; i--) {
        size_t j = (size_t)ht_rng_below(&rng, (uint64_t)i + 1);
        uint32_t t = l->perm[i];
        l->perm[i] = l->perm[j];
        l->perm[j] = t;
    }
}

static size_t global_batch(const ht_loader *l) { return (size_t)l->world * (size_t)l->B; }

ht_status ht_loader_init(ht_loader *l, const ht_dataset *ds, ht_split split, int B, int T, int rank, int world,
                         uint64_t seed, bool shuffle, ht_error *err) {
    memset(l, 0, sizeof(*l));
    if (B < 1 || T < 1 || world < 1 || rank < 0 || rank >= world)
        return ht_fail(err, HT_ERR_INVALID,
                       "loader: need B >= 1, T >= 1, 0 <= rank < world; got B %d, T %d, rank %d, world %d", B, T, rank,
                       world);
    const char *name = split == HT_SPLIT_TRAIN ? "train" : "validation";
    size_t n = ds->split_count[split];
    size_t windows = n > 0 ? (n - 1) / (size_t)T : 0;
    if (windows < (size_t)world * (size_t)B)
        return ht_fail(err, HT_ERR_CONFIG,
                       "%s: the %s split has %zu tokens, %zu windows of T+1 = %d tokens; one global batch needs "
                       "world %d x B %d = %d windows",
                       ds->type, name, n, windows, T + 1, world, B, world * B);
    if (shuffle && windows > UINT32_MAX)
        return ht_fail(err, HT_ERR_CONFIG, "%s: the %s split has %zu windows, more than a shuffle can index", ds->type,
                       name, windows);
    l->tokens = ds->tokens + ds->split_start[split];
    l->B = B;
    l->T = T;
    l->rank = rank;
    l->world = world;
    l->seed = seed;
    l->shuffle = shuffle;
    l->n_windows = windows;
    if (shuffle && !(l->perm = malloc(windows * sizeof(uint32_t))))
        return ht_fail(err, HT_ERR_OOM, "loader: cannot allocate the order of %zu windows", windows);
    shuffle_epoch(l);
    return HT_OK;
}

void ht_loader_next(ht_loader *l, int32_t *tokens) {
    if (l->pos.index + global_batch(l) > l->n_windows) {
        l->pos.epoch++;
        l->pos.index = 0;
        shuffle_epoch(l);
    }
    size_t first = l->pos.index + (size_t)l->rank * (size_t)l->B;
    size_t row = (size_t)l->T + 1;
    for (int b = 0; b < l->B; b++) {
        size_t w = l->perm ? l->perm[first + (size_t)b] : first + (size_t)b;
        const uint32_t *src = l->tokens + w * (size_t)l->T;
        int32_t *dst = tokens + (size_t)b * row; // (T+1,)
        /* The ids are below the model's vocab_size (ht_dataset_check_vocab), so they fit int32. */
        for (size_t t = 0; t < row; t++) dst[t] = (int32_t)src[t];
    }
    l->pos.index += global_batch(l);
}

ht_status ht_loader_resume(ht_loader *l, ht_loader_pos pos, ht_error *err) {
    if (pos.index > l->n_windows)
        return ht_fail(err, HT_ERR_INVALID,
                       "loader: cannot resume at window %llu of epoch %llu: the split has only %zu windows "
                       "(a position saved on another dataset or seq_len?)",
                       (unsigned long long)pos.index, (unsigned long long)pos.epoch, l->n_windows);
    bool new_epoch = pos.epoch != l->pos.epoch;
    l->pos = pos;
    if (new_epoch) shuffle_epoch(l);
    return HT_OK;
}

void ht_loader_reset(ht_loader *l) {
    ht_loader_pos start = {0, 0};
    ht_loader_resume(l, start, NULL);
}

void ht_loader_free(ht_loader *l) {
    free(l->perm);
    l->perm = NULL;
}

void ht_batch_split(const int32_t *tokens, int B, int T, int32_t *inputs, int32_t *targets) {
    for (int b = 0; b < B; b++) {
        const int32_t *row = tokens + (size_t)b * (size_t)(T + 1);
        memcpy(inputs + (size_t)b * (size_t)T, row, (size_t)T * sizeof(int32_t));
        memcpy(targets + (size_t)b * (size_t)T, row + 1, (size_t)T * sizeof(int32_t));
    }
}
