/* Shared helpers for the cmocka tests. */
#include "harness.h"

#include "hypertrain/config.h"
#include "hypertrain/model.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

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

void config_scratch_run(struct ht_config *cfg, const char *dir, const char *const *sets, size_t n) {
    ht_error err;
    char set[1400];
    assert_ht_ok(ht_config_load(NULL, 0, NULL, cfg, &err), &err);
    for (size_t i = 0; i < n; i++) assert_ht_ok(ht_config_set(cfg, sets[i], &err), &err);
    snprintf(set, sizeof(set), "data.path=%s/corpus.txt", dir);
    assert_ht_ok(ht_config_set(cfg, set, &err), &err);
    snprintf(set, sizeof(set), "checkpoint.output_dir=%s/run", dir);
    assert_ht_ok(ht_config_set(cfg, set, &err), &err);
}

bool use_gemm_kernel(ht_dtype dtype, ht_gemm_kernel kernel) {
    ht_gemm_choice choice;
    ht_error err;
    bool bf16 = dtype == HT_DTYPE_BF16;
    if (ht_gemm_choose(bf16 ? kernel : HT_GEMM_KERNEL_WIDENED, bf16 ? HT_GEMM_KERNEL_WIDENED : kernel, 64, 64, 64,
                       &choice, &err) != HT_OK) {
        printf("GEMM kernel %s not offered here: %s\n", ht_gemm_kernel_label(kernel), err.msg);
        return false;
    }
    ht_gemm_use(&choice);
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
