/* A checkpoint's metadata.json, past its self hash: the input is re-sealed
 * (its self_xxh64 made to match) before the checkpoint is opened, so that the
 * parser behind the hash is what gets exercised. The rank file it may name
 * does not exist or is empty. */
#include <inttypes.h>
#include <string.h>

#include "fuzz_common.h"
#include "hypertrain/ckpt.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *text = malloc(size + 1), path[512];
    if (!text) return 0;
    memcpy(text, data, size);
    text[size] = '\0';
    const char *marker = ",\n  \"self_xxh64\": \"";
    char *m = strlen(text) == size ? strstr(text, marker) : NULL;
    if (m && strlen(m + strlen(marker)) >= 16) {
        char hex[17];
        snprintf(hex, sizeof(hex), "%016" PRIx64, ht_xxh64(text, (size_t)(m - text), 0));
        memcpy(m + strlen(marker), hex, 16);
    }
    const char *dir = fuzz_file("metadata.json", (const uint8_t *)text, size, path, sizeof(path));
    free(text);
    fuzz_file("rank_00000.safetensors", (const uint8_t *)"", 0, path, sizeof(path));
    ht_checkpoint *ck;
    ht_error err;
    if (ht_ckpt_open(dir, &ck, &err) == HT_OK) ht_ckpt_close(ck);
    return 0;
}
