/* An example plugin, loaded by the tests through training.plugin: it adds a
 * dataset ("upper_text": text_bytes with letters upper-cased) and a model
 * ("plugin_llama": the built-in llama under another name) through the public
 * API alone, as a user's plugin would, without rebuilding hypertrain. */
#include <ctype.h>
#include <string.h>

#include "hypertrain/data.h"
#include "hypertrain/model.h"

static ht_status open_upper_text(const ht_data_config *cfg, ht_dataset *ds, ht_error *err) {
    ht_status s = ht_dataset_open_text_bytes(cfg, ds, err);
    if (s != HT_OK) return s;
    for (size_t i = 0; i < ds->n_tokens; i++) ds->tokens[i] = (uint16_t)toupper(ds->tokens[i]);
    return HT_OK;
}

static ht_status build_plugin_llama(const ht_model_config *cfg, ht_dtype dtype, ht_model **out, ht_error *err) {
    ht_model_config llama = *cfg;
    strcpy(llama.name, "llama");
    return ht_model_build(&llama, dtype, 0, out, err);
}

void hypertrain_plugin_init(void);
void hypertrain_plugin_init(void) {
    ht_dataset_register("upper_text", open_upper_text, NULL);
    ht_model_register("plugin_llama", build_plugin_llama, NULL);
}
