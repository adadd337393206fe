/* A Hugging Face folder's model.safetensors.index.json (which shard holds
 * which tensor), loading into a store of two small tensors; the shards it
 * may name exist, one of them holding those tensors. */
#include <string.h>

#include "fuzz_common.h"
#include "hypertrain/ckpt.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static const char shard[] = "{\"a.weight\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]},"
                                "\"b.bias\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[16,24]}}  ";
    static uint8_t file[8 + sizeof(shard) - 1 + 24];
    uint64_t header = sizeof(shard) - 1;
    memcpy(file, &header, 8);
    memcpy(file + 8, shard, header);
    char path[512];
    const char *dir = fuzz_file("model.safetensors.index.json", data, size, path, sizeof(path));
    fuzz_file("model-00001-of-00002.safetensors", file, sizeof(file), path, sizeof(path));
    fuzz_file("model-00002-of-00002.safetensors", file, sizeof(file), path, sizeof(path));
    ht_param_store store = {0};
    int64_t a[2] = {2, 2}, b[1] = {2};
    ht_error err;
    if (ht_params_add(&store, "a.weight", 2, a, HT_DTYPE_F32) && ht_params_add(&store, "b.bias", 1, b, HT_DTYPE_F32) &&
        ht_params_allocate(&store, &err) == HT_OK)
        ht_hf_load_weights(dir, &store, &err);
    ht_params_free(&store);
    return 0;
}
