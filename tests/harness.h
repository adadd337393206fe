/* Shared helpers for the cmocka tests: fixture paths, scratch directories,
 * tensor comparison against references, the tiny model and corpus of the
 * end-to-end tests, and running the `hypertrain` command with its log. */
#ifndef HT_TEST_HARNESS_H
#define HT_TEST_HARNESS_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "hypertrain/base.h"
#include "hypertrain/kernels.h"
#include "hypertrain/param.h"

struct ht_model;
/* The model as Hugging Face weights (FP32) and its last forward's logits of `inputs` (B, T) as
 * hypertrain_logits.safetensors, in the build tree's scratch/export_<name>/ (returned):
 * tools/reference/check_hypertrain_exports.sh has transformers load it and compare the logits. */
const char *export_with_logits(const char *name, const struct ht_model *m, const int32_t *inputs, int B, int T);

/* Absolute path of a file under tests/fixtures/ (static buffer, rotating x8). */
const char *fixture_path(const char *rel);
/* A fresh empty directory under the build tree for this test; returns its path. */
const char *scratch_dir(const char *name);
/* Writes `len` bytes to path; fails the test if it cannot. */
void write_file(const char *path, const void *data, size_t len);
/* Writes `text` `repeat` times to path; fails the test if it cannot. */
void write_repeated(const char *path, const char *text, int repeat);
/* dir/run.yaml, the config of a test's `hypertrain train`: printf's `format` of the arguments. */
void write_run_yaml(const char *dir, const char *format, ...) __attribute__((format(printf, 2, 3)));
/* dir/corpus.txt: `text` `repeat` times (each test keeps the text and count its numbers were measured on). */
void harness_write_corpus(const char *dir, const char *text, int repeat);
/* The opening of A Tale of Two Cities, to "the epoch of incredulity.\n": the corpus of the checkpoint,
 * distributed and run-directory tests. */
extern const char two_cities[];
/* The whole of a file, NUL-terminated (malloc'ed); fails the test, with the reason, if it cannot be read. */
char *read_text(const char *path);
/* Whether path names a file or directory, through any symlinks (stat). */
bool path_exists(const char *path);
/* Whether path is a directory entry, a symlink counted as itself even where it dangles (lstat): for the tests
 * that plant symlinks and must see them, not what they point to. */
bool path_lexists(const char *path);
/* Ends the test program with a message naming `what` if it is still running
 * `seconds` from now, so that a call that would block forever (a FIFO opened
 * for reading) fails instead of hanging; watchdog(0, NULL) disarms it. */
void watchdog(unsigned seconds, const char *what);
/* This process's peak resident memory so far, in MiB (getrusage). */
double peak_rss_mib(void);
/* max |a - b| / max |b| over n floats (0 when both are all zero). */
double rel_max_err(const float *a, const float *b, size_t n);

/* ------------------------------------------------------------------ the tiny model of the end-to-end tests */

/* A byte-level model (vocabulary 256), hidden 32, 4 attention heads of dim 8 over 2 KV heads. The MLP width,
 * the depth and the positions are each test's own: the sizes its numbers and bounds were measured with. */
typedef struct tiny_model {
    int intermediate_size, num_hidden_layers, max_position_embeddings;
} tiny_model;
/* The model's sizes as lines of a YAML `model:` section, indented two spaces ("  vocab_size: 256\n..."),
 * in the order every test's file has them (static buffer, rotating x8). */
const char *tiny_model_yaml(tiny_model model);
struct ht_config;
/* Defaults, then the sizes of `model`, dir/corpus.txt's bytes (text_bytes) in sequences of seq_len with a
 * tenth for validation, then each "key=value" of `sets`, then data.path = dir/corpus.txt and
 * checkpoint.output_dir = dir/run: a small run in a scratch directory. */
void config_scratch_run(struct ht_config *cfg, const char *dir, tiny_model model, int seq_len, const char *const *sets,
                        size_t n);
struct ht_trainer;
/* A trainer of cfg (malloc'ed); fails the test on an error. */
struct ht_trainer *trainer_new(const struct ht_config *cfg);
/* Frees a trainer_new's trainer. */
void trainer_delete(struct ht_trainer *t);

/* ------------------------------------------------------------------ the hypertrain command */

/* Built with AddressSanitizer (make build-asan): its shadow memory, redzones and quarantine make a process's
 * resident memory no measure of what the program allocates, so tests of peak RSS skip there. */
#if defined(__SANITIZE_ADDRESS__)
#define HT_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define HT_UNDER_ASAN 1
#endif
#endif

/* The launcher as the tests run it, followed by "-np N " and the command. Under
 * the sanitizer build the ranks keep ASan and UBSan but not leak detection: Open
 * MPI never frees some of its allocations, and its components are unloaded
 * before LeakSanitizer can name them. The engine's own leaks are checked by
 * every single-process test. */
#define MPIRUN                                                                                                         \
    "env -u OMP_NUM_THREADS ASAN_OPTIONS=detect_leaks=0 timeout 300 mpirun --oversubscribe --allow-run-as-root --mca " \
    "btl self,tcp "

/* Runs the shell command `cmd`, which writes its output to log_path itself (it may read the log while it
 * grows); then, unless log is NULL, reads the log into *log (malloc'ed). Returns the exit status, -1 where the
 * shell did not exit (killed by a signal). */
int run_logged(const char *cmd, const char *log_path, char **log);
/* `launcher'$HT_BIN' args` (launcher: NULL, or a shell fragment in front: MPIRUN "-np 2 ", "env X=1 "), its
 * stdout and stderr into log_path, or with stderr_only stderr alone (stdout to /dev/null: for the tests that
 * read what the command tells its user); the exit status and *log as run_logged's. Fails the test if HT_BIN is
 * not set (the test was not run through ctest). */
int run_hypertrain(const char *launcher, const char *args, const char *log_path, bool stderr_only, char **log);
/* `MPIRUN -np ranks '$HT_BIN' args` in the background, from `dir` (NULL: here), its output into log_path; once
 * the log holds `text` (up to 150 s), the newest rank of this very mpirun (timeout's child's newest child:
 * never a process of another run on the machine) gets the signal `sig` ("TERM", "KILL"). The exit status of
 * the launcher and *log as run_logged's. */
int run_and_signal_a_rank(const char *dir, int ranks, const char *args, const char *log_path, const char *text,
                          const char *sig, char **log);

/* ------------------------------------------------------------------ safetensors files, tensor by tensor */

/* Compares, bit for bit, each tensor of file b whose name contains `part` ("": every tensor, and then a must
 * hold as many) with file a's of the same name; the test fails where a lacks one or holds it in another size.
 * Returns how many differ, naming them, space-separated, in `which` (n bytes; NULL: not wanted), and in
 * *compared (if not NULL) how many were compared. */
int tensors_differing(const char *a, const char *b, const char *part, int *compared, char *which, size_t n);
/* Every tensor of file a bit for bit the same in file b, which holds no other: fails naming those that differ. */
void assert_same_tensors(const char *a, const char *b);

/* Each tensor's error against a reference, by name: a run's, or the noise floor (the largest of runs that
 * differ from the reference only in rounding). */
enum { TENSOR_ERRORS_MAX = 128 };
typedef struct tensor_errors {
    int count;
    char name[TENSOR_ERRORS_MAX][HT_PARAM_NAME_MAX];
    double err[TENSOR_ERRORS_MAX];
} tensor_errors;
/* The error `x` holds for `name`; 0 if none (or x is NULL). */
double tensor_error_of(const tensor_errors *x, const char *name);
/* What max_tensor_error compares, and within what. In: the tensors of b whose names start with `prefix`
 * (NULL or "": all) and do not contain `skip` (NULL: none left out); the bound of each is `tol`, or with a
 * `floor`, max(tol, floor_factor x that tensor's error in it); `seen` (if not NULL) keeps each one's largest
 * error, across calls. Out: `differing`, the fraction of elements not equal; `tensors`, how many were compared. */
typedef struct tensor_check {
    const char *prefix, *skip;
    double tol;
    const tensor_errors *floor;
    double floor_factor;
    tensor_errors *seen;
    /* A training.dump_state file of the reference's first step (NULL: none): the elements whose
     * "main_grad.<name>" there (for a dump's "param.<name>" too) is nonzero but within UNDETERMINED_GRAD of that
     * tensor's largest are left out (`undetermined` counts them). The first-step contract holds main_grads to 1e-6 of
     * each tensor's largest, so such an element's sign and size are not determined, and AdamW's first step there, lr g
     * /
     * (|g| + eps), anywhere in (-lr, lr) (docs/NUMERICS.md, "Sharded runs against one process"). */
    const char *grads;
    double undetermined_grad; /* the threshold, of the tensor's largest main_grad (0: UNDETERMINED_GRAD) */
    /* The tensors AdamW updates (NULL: every one): a Muon matrix's step is its whole momentum's, orthogonalized,
     * which an element's undetermined gradient moves by no more than its own size, so none of it is left out. */
    bool (*undetermined_in)(const char *name, int ndim);
    int undetermined;
    double differing;
    int tensors;
} tensor_check;
#define UNDETERMINED_GRAD 1e-6
/* The float32 noise floor of a run: the same run with every gradient times each of these factors
 * (training.gradient_scaling_factor: 1 +- 2^-23, 2^-22, 2^-21, exact decimals). Muon's normalization, AdamW's
 * m / sqrt(v) and the clipping undo the factor (through their eps terms, by less than 1e-12 of an update),
 * while every product of backward rounds otherwise: these runs part from the reference by float32 rounding
 * carried through the steps, as another summation order does. The floor is, per tensor, the largest error of
 * the six; a run in another order may part by FLOOR_FACTOR times it (docs/NUMERICS.md, "Sharded runs against
 * one process"). */
enum { NOISE_FLOOR_RUNS = 6 };
extern const char *const noise_floor_factors[NOISE_FLOOR_RUNS];
#define FLOOR_FACTOR 2.0
/* Each tensor of file b that `c` selects against file a's of the same name, both as float32: its error, the
 * largest difference relative to its largest magnitude (rel_max_err), must be within its bound, or the test
 * fails naming it; a must hold each at the same size, and at least one element is compared. Returns the
 * largest error. */
double max_tensor_error(const char *a, const char *b, tensor_check *c);

/* ------------------------------------------------------------------ models and kernels */

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
