/* What every fuzz target shares: the input written to a file of its own in a
 * scratch directory of this process (the readers take paths, as the engine
 * uses them), and a quiet log. */
#ifndef HT_FUZZ_COMMON_H
#define HT_FUZZ_COMMON_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "hypertrain/base.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* dir/<name> holding data; dir is made once per process under /dev/shm (or /tmp). */
static inline const char *fuzz_file(const char *name, const uint8_t *data, size_t size, char *path, size_t n) {
    static char dir[256];
    if (!dir[0]) {
        ht_log_set_level((ht_log_level)(HT_LOG_ERROR + 1));
        const char *base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
        snprintf(dir, sizeof(dir), "%s/ht_fuzz_%ld", base, (long)getpid());
        mkdir(dir, 0755);
    }
    snprintf(path, n, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) abort();
    if (size && fwrite(data, 1, size, f) != size) abort();
    fclose(f);
    return dir;
}

#endif
