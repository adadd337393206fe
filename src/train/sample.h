/* training.sample_interval (src/train/sample.c): a sample of the model's
 * text during training, printed and written to output_dir/samples.jsonl. */
#ifndef HT_TRAIN_SAMPLE_H
#define HT_TRAIN_SAMPLE_H

#include "hypertrain/train.h"

/* Rank 0: continues training.sample_prompt by training.sample_tokens tokens
 * with the weights `whole` (every param whole, the trainer's model's names),
 * drawn at temperature 1 from the seed training.seed + step; logs it and
 * appends {"step", "prompt", "text", "tokens"} to samples.jsonl. */
ht_status ht_trainer_sample(ht_trainer *t, const ht_param_store *whole, ht_error *err);

#endif
