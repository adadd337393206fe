/* The strict JSON reader that metadata.json and model.safetensors.index.json go through. */
#include "fuzz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    ht_json *js;
    ht_error err;
    if (ht_json_parse((const char *)data, size, "fuzz.json", &js, &err) == HT_OK) ht_json_free(js);
    return 0;
}
