/* Fault injection (tests/faults/fail_io.c, preloaded): a short run that
 * checkpoints twice, writes its metrics, final weights and plot, is run
 * once per write-side call under its output directory with that one call
 * failing (ENOSPC, EIO and EACCES in turn). Every such run must stop with an
 * error that names a file there and the system's reason, and leave every
 * checkpoint directory it completed loadable (`hypertrain inspect`: every
 * file's size and hash), `latest` naming one of them or absent. */
#include "harness.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *corpus = "It was the best of times, it was the worst of times, it was the age of wisdom.\n";

/* The run of dir/run.yaml with write-side call `fail_at` under dir/out failing with `errno_name` (0: none), the
 * calls counted into dir/count.txt; the exit status, and the log. */
static int run(const char *dir, long fail_at, const char *errno_name, char **log) {
    char env[4096], args[1300], out[1200], count[1200];
    snprintf(out, sizeof(out), "%s/out", dir);
    snprintf(count, sizeof(count), "%s/count.txt", dir);
    snprintf(env, sizeof(env),
             "rm -rf '%s' && ASAN_OPTIONS=detect_leaks=0:verify_asan_link_order=0 LD_PRELOAD='%s' HT_FAULT_DIR='%s' "
             "HT_FAULT_AT=%ld HT_FAULT_ERRNO=%s HT_FAULT_COUNT='%s' ",
             out, getenv("HT_FAIL_IO"), out, fail_at, errno_name, count);
    snprintf(args, sizeof(args), "train '%s/run.yaml'", dir);
    snprintf(out, sizeof(out), "%s/log.txt", dir);
    return run_hypertrain(env, args, out, false, log);
}

static long counted(const char *dir) {
    char path[1200];
    snprintf(path, sizeof(path), "%s/count.txt", dir);
    FILE *f = fopen(path, "r");
    long n = -1;
    if (f && fscanf(f, "%ld", &n) != 1) n = -1;
    if (f) fclose(f);
    return n;
}

/* Every completed step_XXXXXXXX directory passes `hypertrain inspect`; `latest`, if there, names one. */
static int check_checkpoints(const char *out, char *why, size_t n) {
    DIR *d = opendir(out);
    if (!d) return 0;
    struct dirent *e;
    int checked = 0;
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, "step_", 5) != 0 || strlen(e->d_name) != 13) continue;
        char cmd[4096];
        snprintf(cmd, sizeof(cmd), "'%s' inspect '%s/%s' > /dev/null 2>&1", getenv("HT_BIN"), out, e->d_name);
        if (system(cmd) != 0) {
            snprintf(why, n, "%s/%s does not load", out, e->d_name);
            closedir(d);
            return -1;
        }
        checked++;
    }
    closedir(d);
    char latest[1200], name[64] = "";
    snprintf(latest, sizeof(latest), "%s/latest", out);
    FILE *f = fopen(latest, "r");
    if (f) {
        if (!fgets(name, sizeof(name), f)) name[0] = '\0';
        fclose(f);
        name[strcspn(name, "\n")] = '\0';
        char target[1300];
        snprintf(target, sizeof(target), "%s/%s/metadata.json", out, name);
        if (access(target, R_OK) != 0) {
            snprintf(why, n, "latest names \"%s\", which is not a complete checkpoint", name);
            return -1;
        }
    }
    return checked;
}

static void test_every_write_failing_in_turn(void **state) {
    (void)state;
    if (!getenv("HT_FAIL_IO")) fail_msg("HT_FAIL_IO is not set (run the test through ctest)");
    const char *dir = scratch_dir("faults");
    char path[1200];
    harness_write_corpus(dir, corpus, 40);
    write_run_yaml(
        dir,
        "model: {name: llama, vocab_size: 256, hidden_size: 16, intermediate_size: 16, num_hidden_layers: 1,\n"
        "        num_attention_heads: 2, num_key_value_heads: 1, max_position_embeddings: 16}\n"
        "model_init_dtype: bfloat16\n"
        "data: {path: %s/corpus.txt, seq_len: 8, valid_fraction: 0.1}\n"
        "training: {steps: 2, local_batch_size: 2, global_batch_size: 2, eval_interval: 0, eval_batches: 1,\n"
        "           log_interval: 1}\n"
        "kernels: {bf16_gemm: fp32_rounded}\n"
        "checkpoint: {output_dir: %s/out, save_interval: 1, keep_last: 1}\n",
        dir, dir);
    char why[1600] = "", *log;
    /* Nothing failing: the run passes, and its count is the number of calls to fail in turn. */
    int rc = run(dir, 0, "ENOSPC", &log);
    if (rc != 0) fail_msg("the run without faults failed:\n%s", log);
    free(log);
    long calls = counted(dir);
    assert_true(calls > 20);
    snprintf(path, sizeof(path), "%s/out", dir);
    int whole = check_checkpoints(path, why, sizeof(why));
    if (whole != 1) fail_msg("the run without faults left %d loadable checkpoints (keep_last 1): %s", whole, why);
    static const char *const names[] = {"ENOSPC", "EIO", "EACCES"};
    static const char *const says[] = {"No space left on device", "Input/output error", "Permission denied"};
    int loadable = 0;
    for (long k = 1; k <= calls; k++) {
        int e = (int)(k % 3);
        rc = run(dir, k, names[e], &log);
        snprintf(path, sizeof(path), "%s/out", dir);
        if (rc == 0) fail_msg("call %ld failing with %s: the run succeeded anyway:\n%s", k, names[e], log);
        if (rc != 1) fail_msg("call %ld failing with %s: exit %d, not an error:\n%s", k, names[e], rc, log);
        if (!strstr(log, path) || !strstr(log, says[e]))
            fail_msg("call %ld failing with %s: the error names no file under %s, or not \"%s\":\n%s", k, names[e],
                     path, says[e], log);
        int n = check_checkpoints(path, why, sizeof(why));
        if (n < 0) fail_msg("call %ld failing with %s: %s\n%s", k, names[e], why, log);
        loadable += n > 0;
        free(log);
    }
    printf("fault injection: %ld write-side calls of a 2-step run with 2 checkpoints, each failed in turn "
           "(ENOSPC, EIO, EACCES): every run stopped with an error naming the file; %d runs left a loadable "
           "checkpoint behind, none an unloadable one\n",
           calls, loadable);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_write_failing_in_turn),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
