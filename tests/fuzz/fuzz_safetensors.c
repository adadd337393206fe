/* The safetensors reader: header, offsets, dtypes and shapes, on any bytes. */
#include "fuzz_common.h"
#include "hypertrain/ckpt.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char path[512];
    fuzz_file("model.safetensors", data, size, path, sizeof(path));
    ht_safetensors *st;
    ht_error err;
    if (ht_safetensors_open(path, &st, &err) != HT_OK) return 0;
    volatile uint8_t sink = 0; /* every tensor's bytes are read: the reader vouched for them */
    for (int i = 0; i < ht_safetensors_count(st); i++) {
        const ht_st_tensor *t = ht_safetensors_tensor(st, i);
        for (size_t b = 0; b < t->nbytes; b += 4096) sink ^= ((const uint8_t *)t->data)[b];
        if (t->nbytes) sink ^= ((const uint8_t *)t->data)[t->nbytes - 1];
        if (ht_safetensors_find(st, t->name) == NULL) abort();
    }
    (void)sink;
    ht_safetensors_close(st);
    return 0;
}
