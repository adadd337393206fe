/* What hf.c shares with the other Hugging Face formats of the ckpt layer (peft.c). */
#ifndef HT_CKPT_HF_INTERNAL_H
#define HT_CKPT_HF_INTERNAL_H

#include "hypertrain/ckpt.h"

/* Copies the param's local rows out of a tensor of the same shape, converting to the param's dtype. */
ht_status ht_hf_copy_rows(ht_param *p, const ht_st_tensor *t, const char *file, ht_error *err);
/* ht_hf_copy_rows into a param of `store`, staged through host memory where the store's is not the host's. */
ht_status ht_hf_copy_rows_into(const ht_param_store *store, ht_param *p, const ht_st_tensor *t, const char *file,
                               ht_error *err);
/* Writes text to path through path.tmp.<pid>, fsync and rename. */
ht_status ht_hf_write_text(const char *path, const char *text, size_t len, ht_error *err);
/* "[2, 3]" */
void ht_hf_format_dims(char *buf, size_t cap, int ndim, const int64_t *shape);

#endif
