/* A token_bin shard: its 1024-byte header (magic, version 1 or 2, token count,
 * vocabulary size) and the uint16 or uint32 tokens after it. */
#include <string.h>

#include "fuzz_common.h"
#include "hypertrain/data.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char path[512];
    fuzz_file("shard.bin", data, size, path, sizeof(path));
    ht_data_config cfg = {.seq_len = 8, .valid_fraction = 0.1};
    snprintf(cfg.dataset_type, sizeof(cfg.dataset_type), "token_bin");
    snprintf(cfg.path, sizeof(cfg.path), "%s", path);
    ht_dataset *ds;
    ht_error err;
    if (ht_dataset_open(&cfg, &ds, &err) == HT_OK) ht_dataset_free(ds);
    return 0;
}
