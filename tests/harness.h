/* Shared helpers for the cmocka tests: fixture paths, scratch directories,
 * tensor comparison against references. */
#ifndef HT_TEST_HARNESS_H
#define HT_TEST_HARNESS_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "hypertrain/base.h"
#include "hypertrain/kernels.h"

/* Absolute path of a file under tests/fixtures/ (static buffer, rotating x8). */
const char *fixture_path(const char *rel);
/* A fresh empty directory under the build tree for this test; returns its path. */
const char *scratch_dir(const char *name);
/* Writes `len` bytes to path; fails the test if it cannot. */
void write_file(const char *path, const void *data, size_t len);
/* Ends the test program with a message naming `what` if it is still running
 * `seconds` from now, so that a call that would block forever (a FIFO opened
 * for reading) fails instead of hanging; watchdog(0, NULL) disarms it. */
void watchdog(unsigned seconds, const char *what);
/* This process's peak resident memory so far, in MiB (getrusage). */
double peak_rss_mib(void);
/* max |a - b| / max |b| over n floats (0 when both are all zero). */
double rel_max_err(const float *a, const float *b, size_t n);
struct ht_config;
/* Defaults, then each "key=value" of `sets`, then data.path = dir/corpus.txt and
 * checkpoint.output_dir = dir/run: a small run in a scratch directory. */
void config_scratch_run(struct ht_config *cfg, const char *dir, const char *const *sets, size_t n);
/* Pins the GEMMs of `dtype` (bf16 or f16) to `kernel`, the other 16-bit
 * dtype's to widened; false, with a note, where this machine does not offer
 * the kernel (native without the ISA). */
bool use_gemm_kernel(ht_dtype dtype, ht_gemm_kernel kernel);
struct ht_model;
/* n tokens uniform in [0, vocab) from `seed`. */
void random_tokens(int32_t *t, int n, int vocab, uint64_t seed);
/* The mean loss of one forward of (B, T) inputs and targets; fails the test on an error. */
double model_loss(struct ht_model *m, const int32_t *in, const int32_t *tg, int B, int T);
/* Asserts an ht_status is HT_OK, printing the error message otherwise. */
#define assert_ht_ok(expr, errp)                                                                                       \
    do {                                                                                                               \
        ht_status s_ = (expr);                                                                                         \
        if (s_ != HT_OK) fail_msg("%s failed: %s", #expr, (errp)->msg);                                                \
    } while (0)

#endif
