/* The YAML config loader and the checks after it, on any bytes. */
#include "fuzz_common.h"
#include "hypertrain/config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static ht_config cfg;
    char path[512];
    fuzz_file("run.yaml", data, size, path, sizeof(path));
    ht_error err;
    if (ht_config_load(path, 0, NULL, &cfg, &err) == HT_OK) ht_config_validate(&cfg, 1, &err);
    return 0;
}
