/* The Qwen2/Llama decoder builder (internal to the model layer). */
#ifndef HT_MODEL_DECODER_H
#define HT_MODEL_DECODER_H

#include "hypertrain/model.h"

ht_status ht_decoder_build(const ht_model_config *cfg, ht_dtype dtype, ht_model **out, ht_error *err);

#endif
