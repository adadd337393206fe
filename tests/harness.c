/* Shared helpers for the cmocka tests: what several tests would otherwise
 * each write again (files, the tiny model, the command and its log, tensor
 * files compared). */
#include "harness.h"

#include "hypertrain/ckpt.h"
#include "hypertrain/config.h"
#include "hypertrain/model.h"
#include "hypertrain/train.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* HT_TEST=pattern runs only the tests whose names match it (cmocka's
 * filter, * and ? wildcards): one test of a long file while working on it. */
__attribute__((constructor)) static void filter_tests(void) {
    const char *pattern = getenv("HT_TEST");
    if (pattern && pattern[0]) cmocka_set_test_filter(pattern);
}

const char *fixture_path(const char *rel) {
    static char bufs[8][1024];
    static int next = 0;
    char *b = bufs[next++ % 8];
    snprintf(b, sizeof(bufs[0]), "%s/tests/fixtures/%s", HT_SOURCE_DIR, rel);
    return b;
}

const char *scratch_dir(const char *name) {
    static char bufs[8][1024];
    static int next = 0;
    char *b = bufs[next++ % 8];
    char cwd[512];
    if (!getcwd(cwd, sizeof(cwd))) fail_msg("getcwd failed");
    snprintf(b, sizeof(bufs[0]), "%s/scratch/%s", cwd, name);
    char cmd[1200];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s' && mkdir -p '%s'", b, b);
    if (system(cmd) != 0) fail_msg("cannot create %s", b);
    return b;
}

void write_file(const char *path, const void *data, size_t len) {
    FILE *f = fopen(path, "wb");
    if (!f) fail_msg("cannot write %s: %s", path, strerror(errno));
    if (len && fwrite(data, 1, len, f) != len) fail_msg("short write to %s", path);
    fclose(f);
}

void write_run_yaml(const char *dir, const char *format, ...) {
    char path[1200];
    snprintf(path, sizeof(path), "%s/run.yaml", dir);
    va_list ap, again;
    va_start(ap, format);
    va_copy(again, ap);
    int len = vsnprintf(NULL, 0, format, ap);
    va_end(ap);
    if (len < 0) fail_msg("cannot format %s", path);
    char *text = malloc((size_t)len + 1);
    vsnprintf(text, (size_t)len + 1, format, again);
    va_end(again);
    write_file(path, text, (size_t)len);
    free(text);
}

void write_repeated(const char *path, const char *text, int repeat) {
    FILE *f = fopen(path, "w");
    if (!f) fail_msg("cannot write %s: %s", path, strerror(errno));
    for (int i = 0; i < repeat; i++) fputs(text, f);
    if (fclose(f) != 0) fail_msg("cannot write %s: %s", path, strerror(errno));
}

void harness_write_corpus(const char *dir, const char *text, int repeat) {
    char path[1200];
    snprintf(path, sizeof(path), "%s/corpus.txt", dir);
    write_repeated(path, text, repeat);
}

const char two_cities[] =
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age "
    "of foolishness, it was the epoch of belief, it was the epoch of incredulity.\n";

char *read_text(const char *path) {
    char *text = NULL;
    ht_error err;
    if (ht_read_file(path, &text, NULL, &err) != HT_OK) fail_msg("%s", err.msg);
    return text;
}

bool path_exists(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0;
}

bool path_lexists(const char *path) {
    struct stat sb;
    return lstat(path, &sb) == 0;
}

static const char *watched;

static void watchdog_fired(int sig) {
    (void)sig;
    static const char head[] = "\nwatchdog: still blocked, a failure: ";
    ssize_t n = write(STDERR_FILENO, head, sizeof(head) - 1);
    n += write(STDERR_FILENO, watched, strlen(watched));
    n += write(STDERR_FILENO, "\n", 1);
    _exit(n > 0 ? 1 : 2);
}

void watchdog(unsigned seconds, const char *what) {
    watched = what ? what : "?";
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = watchdog_fired;
    sigaction(SIGALRM, &sa, NULL);
    alarm(seconds);
}

double peak_rss_mib(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_maxrss / 1024.0; /* KiB on Linux */
}

double rel_max_err(const float *a, const float *b, size_t n) {
    double maxdiff = 0, maxref = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (d > maxdiff || isnan(d)) maxdiff = isnan(d) ? INFINITY : d;
        if (fabs((double)b[i]) > maxref) maxref = fabs((double)b[i]);
    }
    if (maxref == 0) return maxdiff;
    return maxdiff / maxref;
}

const char *tiny_model_yaml(tiny_model model) {
    static char bufs[8][512];
    static int next = 0;
    char *b = bufs[next++ % 8];
    snprintf(b, sizeof(bufs[0]),
             "  vocab_size: 256\n  hidden_size: 32\n  intermediate_size: %d\n  num_hidden_layers: %d\n"
             "  num_attention_heads: 4\n  num_key_value_heads: 2\n  max_position_embeddings: %d\n",
             model.intermediate_size, model.num_hidden_layers, model.max_position_embeddings);
    return b;
}

void config_scratch_run(struct ht_config *cfg, const char *dir, tiny_model model, int seq_len, const char *const *sets,
                        size_t n) {
    ht_error err;
    char set[1400];
    assert_ht_ok(ht_config_load(NULL, 0, NULL, cfg, &err), &err);
    const int sizes[] = {256, 32, model.intermediate_size,      model.num_hidden_layers,
                         4,   2,  model.max_position_embeddings};
    static const char *const keys[] = {
        "vocab_size",          "hidden_size",         "intermediate_size",      "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "max_position_embeddings"};
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
        snprintf(set, sizeof(set), "model.%s=%d", keys[i], sizes[i]);
        assert_ht_ok(ht_config_set(cfg, set, &err), &err);
    }
    snprintf(set, sizeof(set), "data.seq_len=%d", seq_len);
    const char *const data[] = {"data.dataset_type=text_bytes", set, "data.valid_fraction=0.1"};
    for (size_t i = 0; i < sizeof(data) / sizeof(data[0]); i++) assert_ht_ok(ht_config_set(cfg, data[i], &err), &err);
    for (size_t i = 0; i < n; i++) assert_ht_ok(ht_config_set(cfg, sets[i], &err), &err);
    snprintf(set, sizeof(set), "data.path=%s/corpus.txt", dir);
    assert_ht_ok(ht_config_set(cfg, set, &err), &err);
    snprintf(set, sizeof(set), "checkpoint.output_dir=%s/run", dir);
    assert_ht_ok(ht_config_set(cfg, set, &err), &err);
}

ht_trainer *trainer_new(const ht_config *cfg) {
    ht_trainer *t = malloc(sizeof(ht_trainer));
    ht_error err;
    assert_ht_ok(ht_trainer_init(t, cfg, &err), &err);
    return t;
}

void trainer_delete(ht_trainer *t) {
    ht_trainer_free(t);
    free(t);
}

int run_logged(const char *cmd, const char *log_path, char **log) {
    int rc = system(cmd);
    if (log) *log = read_text(log_path);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

static const char *hypertrain_bin(void) {
    const char *bin = getenv("HT_BIN");
    if (!bin) fail_msg("HT_BIN is not set (run the test through ctest)");
    return bin;
}

int run_hypertrain(const char *launcher, const char *args, const char *log_path, bool stderr_only, char **log) {
    char cmd[16384];
    int len = snprintf(cmd, sizeof(cmd), "%s'%s' %s %s '%s'%s", launcher ? launcher : "", hypertrain_bin(), args,
                       stderr_only ? "> /dev/null 2>" : ">", log_path, stderr_only ? "" : " 2>&1");
    if (len < 0 || (size_t)len >= sizeof(cmd)) fail_msg("command too long: %.200s...", cmd);
    return run_logged(cmd, log_path, log);
}

int run_and_signal_a_rank(const char *dir, int ranks, const char *args, const char *log_path, const char *text,
                          const char *sig, char **log) {
    char cmd[16384];
    int len = snprintf(cmd, sizeof(cmd),
                       "%s%s%s(" MPIRUN "-np %d '%s' %s > '%s' 2>&1 & "
                       "for i in $(seq 3000); do grep -q '%s' '%s' 2>/dev/null && break; sleep 0.05; done; "
                       "pkill -%s -n -P \"$(pgrep -P $! mpirun)\"; wait $!)",
                       dir ? "cd '" : "", dir ? dir : "", dir ? "' && " : "", ranks, hypertrain_bin(), args, log_path,
                       text, log_path, sig);
    if (len < 0 || (size_t)len >= sizeof(cmd)) fail_msg("command too long: %.200s...", cmd);
    return run_logged(cmd, log_path, log);
}

/* The tensors of file b whose names start with `prefix`, contain `part` and do not contain `skip` (each NULL
 * or "": no condition), each with file a's of that name (the test fails where a lacks it or holds it in
 * another size): visit(x, y, ctx) with a's x and b's y. Returns how many were visited. */
static int each_tensor_pair(const char *a, const char *b, const char *prefix, const char *part, const char *skip,
                            bool same_count, void (*visit)(const ht_st_tensor *, const ht_st_tensor *, void *),
                            void *ctx) {
    ht_safetensors *sa, *sb;
    ht_error err;
    assert_ht_ok(ht_safetensors_open(a, &sa, &err), &err);
    assert_ht_ok(ht_safetensors_open(b, &sb, &err), &err);
    if (same_count && ht_safetensors_count(sa) != ht_safetensors_count(sb))
        fail_msg("%s holds %d tensors, %s %d", a, ht_safetensors_count(sa), b, ht_safetensors_count(sb));
    int count = 0;
    for (int i = 0; i < ht_safetensors_count(sb); i++) {
        const ht_st_tensor *y = ht_safetensors_tensor(sb, i);
        if ((prefix && strncmp(y->name, prefix, strlen(prefix)) != 0) || (part && !strstr(y->name, part)) ||
            (skip && skip[0] && strstr(y->name, skip)))
            continue;
        const ht_st_tensor *x = ht_safetensors_find(sa, y->name);
        if (!x) fail_msg("%s has no %s (%s has)", a, y->name, b);
        if (x->nbytes != y->nbytes) fail_msg("%s: %zu bytes in %s, %zu in %s", y->name, x->nbytes, a, y->nbytes, b);
        visit(x, y, ctx);
        count++;
    }
    ht_safetensors_close(sa);
    ht_safetensors_close(sb);
    return count;
}

typedef struct differing_list {
    int differ;
    char *which;
    size_t n;
} differing_list;

static void list_if_differing(const ht_st_tensor *x, const ht_st_tensor *y, void *ctx) {
    differing_list *d = ctx;
    if (memcmp(x->data, y->data, x->nbytes) == 0) return;
    d->differ++;
    if (!d->which) return;
    size_t len = strlen(d->which);
    snprintf(d->which + len, d->n - len, "%s%s", len ? " " : "", y->name);
}

int tensors_differing(const char *a, const char *b, const char *part, int *compared, char *which, size_t n) {
    differing_list d = {.which = n ? which : NULL, .n = n};
    if (d.which) d.which[0] = '\0';
    int count = each_tensor_pair(a, b, NULL, part, NULL, !part || !part[0], list_if_differing, &d);
    if (compared) *compared = count;
    return d.differ;
}

void assert_same_tensors(const char *a, const char *b) {
    char which[4096];
    if (tensors_differing(a, b, "", NULL, which, sizeof(which)) != 0)
        fail_msg("%s differ between %s and %s", which, a, b);
}

static double *tensor_error_slot(tensor_errors *x, const char *name) {
    for (int i = 0; i < x->count; i++)
        if (strcmp(x->name[i], name) == 0) return &x->err[i];
    assert_true(x->count < TENSOR_ERRORS_MAX);
    snprintf(x->name[x->count], HT_PARAM_NAME_MAX, "%s", name);
    x->err[x->count] = 0.0;
    return &x->err[x->count++];
}

double tensor_error_of(const tensor_errors *x, const char *name) {
    for (int i = 0; x && i < x->count; i++)
        if (strcmp(x->name[i], name) == 0) return x->err[i];
    return 0.0;
}

typedef struct bounded_errors {
    const char *a, *b;
    tensor_check *c;
    ht_safetensors *grads; /* c->grads, open */
    double worst, total, unequal;
} bounded_errors;

/* c->grads' undetermined elements of tensor `name` (n elements) made equal in fa and fb; their count. */
static int leave_out_undetermined(const bounded_errors *e, const char *name, float *fa, const float *fb, size_t n) {
    char key[HT_PARAM_NAME_MAX + 16];
    if (strncmp(name, "param.", 6) == 0) name += 6; /* a dump's model values: their own params' gradients */
    snprintf(key, sizeof(key), "main_grad.%s", name);
    const ht_st_tensor *g = e->grads ? ht_safetensors_find(e->grads, key) : NULL;
    if (!g || g->nbytes / ht_dtype_size(g->dtype) != n) return 0;
    if (e->c->undetermined_in && !e->c->undetermined_in(name, g->ndim)) return 0;
    float *fg = malloc(n * sizeof(float));
    ht_convert(fg, HT_DTYPE_F32, g->data, g->dtype, n);
    double top = 0;
    for (size_t j = 0; j < n; j++) top = fmax(top, fabs(fg[j]));
    const double below = e->c->undetermined_grad > 0 ? e->c->undetermined_grad : UNDETERMINED_GRAD;
    int count = 0;
    for (size_t j = 0; j < n; j++)
        if (fg[j] != 0 && fabs(fg[j]) <= below * top) {
            fa[j] = fb[j];
            count++;
        }
    free(fg);
    return count;
}

static void check_within_bound(const ht_st_tensor *x, const ht_st_tensor *y, void *ctx) {
    bounded_errors *e = ctx;
    tensor_check *c = e->c;
    size_t n = x->nbytes / ht_dtype_size(x->dtype);
    float *fa = malloc(n * sizeof(float)), *fb = malloc(n * sizeof(float));
    ht_convert(fa, HT_DTYPE_F32, x->data, x->dtype, n);
    ht_convert(fb, HT_DTYPE_F32, y->data, y->dtype, n);
    c->undetermined += leave_out_undetermined(e, y->name, fa, fb, n);
    double err = rel_max_err(fa, fb, n);
    const double bound = c->floor ? fmax(c->tol, c->floor_factor * tensor_error_of(c->floor, y->name)) : c->tol;
    if (!(err <= bound))
        fail_msg("%s: %s differs from %s by %.3g (bound %.3g%s)", e->a, y->name, e->b, err, bound,
                 c->floor ? ": its noise floor's" : "");
    e->worst = fmax(e->worst, err);
    if (c->seen) {
        double *slot = tensor_error_slot(c->seen, y->name);
        *slot = fmax(*slot, err);
    }
    for (size_t j = 0; j < n; j++) e->unequal += fa[j] != fb[j];
    e->total += (double)n;
    free(fa);
    free(fb);
}

double max_tensor_error(const char *a, const char *b, tensor_check *c) {
    bounded_errors e = {.a = a, .b = b, .c = c};
    c->undetermined = 0;
    if (c->grads) {
        ht_error err;
        assert_ht_ok(ht_safetensors_open(c->grads, &e.grads, &err), &err);
    }
    c->tensors = each_tensor_pair(a, b, c->prefix, NULL, c->skip, false, check_within_bound, &e);
    ht_safetensors_close(e.grads);
    assert_true(e.total > 0);
    c->differing = e.unequal / e.total;
    return e.worst;
}

const char *const noise_floor_factors[NOISE_FLOOR_RUNS] = {
    "1.00000011920928955078125", "1.0000002384185791015625", "1.000000476837158203125",
    "0.99999988079071044921875", "0.9999997615814208984375", "0.999999523162841796875",
};

bool use_gemm_kernel(ht_dtype dtype, ht_gemm_kernel kernel) {
    ht_gemm_choice choice;
    ht_error err;
    bool bf16 = dtype == HT_DTYPE_BF16;
    if (ht_kernels_choose_gemm(bf16 ? kernel : HT_GEMM_KERNEL_WIDENED, bf16 ? HT_GEMM_KERNEL_WIDENED : kernel, 64, 64,
                               64, &choice, &err) != HT_OK) {
        printf("GEMM kernel %s not offered here: %s\n", ht_gemm_kernel_label(kernel), err.msg);
        return false;
    }
    ht_kernels_use_gemm(&choice);
    return true;
}

void random_tokens(int32_t *t, int n, int vocab, uint64_t seed) {
    ht_rng rng;
    ht_rng_seed(&rng, seed);
    for (int i = 0; i < n; i++) t[i] = (int32_t)ht_rng_below(&rng, (uint64_t)vocab);
}

double model_loss(ht_model *m, const int32_t *in, const int32_t *tg, int B, int T) {
    ht_error err;
    float loss;
    assert_ht_ok(ht_model_forward(m, in, tg, B, T, &loss, &err), &err);
    return loss;
}

const char *export_with_logits(const char *name, const ht_model *m, const int32_t *inputs, int B, int T) {
    char sub[128], path[1200];
    ht_error err;
    snprintf(sub, sizeof(sub), "export_%s", name);
    const char *dir = scratch_dir(sub);
    assert_ht_ok(ht_hf_save(dir, &m->config, &m->params, HT_DTYPE_F32, 0, &err), &err);
    ht_st_writer w = {0};
    int64_t in_shape[2] = {B, T}, lg_shape[3] = {B, T, m->config.vocab_size};
    assert_ht_ok(ht_st_writer_add(&w, "inputs", HT_DTYPE_I32, 2, in_shape, inputs, HT_DTYPE_I32, &err), &err);
    assert_ht_ok(ht_st_writer_add(&w, "logits", HT_DTYPE_F32, 3, lg_shape, m->logits, HT_DTYPE_F32, &err), &err);
    snprintf(path, sizeof(path), "%s/hypertrain_logits.safetensors", dir);
    assert_ht_ok(ht_st_writer_write(&w, path, &err), &err);
    ht_st_writer_free(&w);
    return dir;
}
