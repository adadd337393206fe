/* What the checkpoint's parts share (checkpoint_internal.h): the key kinds
 * and names, paths and whole-file hashes. The save is save.c, the verified
 * open open.c, the load load.c, export and inspect export.c. */
#include "ckpt/checkpoint_internal.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

const char *const ht_ckpt_kind_names[KIND_COUNT] = {"model",      "fp32_main_param", "exp_avg",
                                                    "exp_avg_sq", "momentum_buffer", "step"};

void ht_ckpt_key_name(char *buf, key_kind kind, const char *fqn) {
    switch (kind) {
    case KIND_MODEL: snprintf(buf, HT_CKPT_KEY_MAX, "model.%s", fqn); break;
    case KIND_MAIN: snprintf(buf, HT_CKPT_KEY_MAX, MAIN_PREFIX "%s", fqn); break;
    default: snprintf(buf, HT_CKPT_KEY_MAX, OPT_PREFIX "%s.%s", fqn, ht_ckpt_kind_names[kind]); break;
    }
}

/* dir/name; a path that does not fit becomes "" (every later open then fails naming nothing worse). */
void ht_ckpt_join(char *buf, size_t n, const char *dir, const char *name) {
    if (snprintf(buf, n, "%s/%s", dir, name) >= (int)n) buf[0] = '\0';
}

/* Size and XXH64 of a whole file (through a read-only mapping). */
ht_status ht_ckpt_hash_file(const char *path, uint64_t *size, uint64_t *hash, ht_error *err) {
    int fd;
    size_t bytes;
    ht_status s = ht_open_file(path, &fd, &bytes, err); /* a FIFO listed in metadata.json must not block */
    if (s != HT_OK) return s;
    *size = (uint64_t)bytes;
    if (bytes == 0) {
        close(fd);
        *hash = ht_xxh64(NULL, 0, 0);
        return HT_OK;
    }
    void *map = mmap(NULL, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map == MAP_FAILED) return ht_fail(err, HT_ERR_IO, "%s: cannot map: %s", path, strerror(errno));
    madvise(map, bytes, MADV_SEQUENTIAL);
    *hash = ht_xxh64(map, bytes, 0);
    munmap(map, bytes);
    return HT_OK;
}

bool ht_ckpt_ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

/* A complete checkpoint's step from its directory name "step_XXXXXXXX", or -1. */
long long ht_ckpt_step_of(const char *name) {
    long long step;
    int used = 0;
    if (sscanf(name, "step_%lld%n", &step, &used) != 1 || name[used] != '\0' || strlen(name) != 13) return -1;
    return step;
}
