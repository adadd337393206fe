/* Crash safety of checkpoint saves: a child process saves over and over
 * (keep_last 2, so pruning runs too) and is killed with SIGKILL at a random
 * moment; after every kill `latest` must load, pass every hash check, and
 * hold exactly one of the saves that completed (its contents are a function
 * of its step, and the step never goes back). HT_CRASH_TRIALS sets the trial
 * count (default 50; the long run uses more). */
#include "harness.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "hypertrain/ckpt.h"

/* A bf16 matrix and an FP32 vector with main params and AdamW state. */
typedef struct world {
    ht_param_store ps;
    ht_optimizer opt;
    ht_adamw adamw;
    ht_adamw_slot slots[2];
    float *state;
} world;

static void world_init(world *w) {
    memset(w, 0, sizeof(*w));
    ht_error err;
    int64_t ws[2] = {192, 256}, bs[1] = {256};
    ht_params_add(&w->ps, "model.layers.0.mlp.up_proj.weight", 2, ws, HT_DTYPE_BF16);
    ht_params_add(&w->ps, "model.norm.weight", 1, bs, HT_DTYPE_F32);
    assert_ht_ok(ht_params_allocate(&w->ps, &err), &err);
    assert_ht_ok(ht_params_create_main(&w->ps, HT_MAIN_COPY, &err), &err);
    size_t n0 = (size_t)ht_param_local_numel(&w->ps.items[0]), n1 = (size_t)ht_param_local_numel(&w->ps.items[1]);
    w->state = ht_alloc(2 * (n0 + n1) * sizeof(float));
    w->slots[0] = (ht_adamw_slot){.param = &w->ps.items[0], .exp_avg = w->state, .exp_avg_sq = w->state + n0};
    w->slots[1] =
        (ht_adamw_slot){.param = &w->ps.items[1], .exp_avg = w->state + 2 * n0, .exp_avg_sq = w->state + 2 * n0 + n1};
    w->adamw.slots = w->slots;
    w->adamw.count = 2;
    w->opt.params = &w->ps;
    w->opt.adamw = &w->adamw;
}

static void world_free(world *w) {
    ht_free(w->state);
    ht_params_free(&w->ps);
}

/* Element i of buffer `buf` of save number `step`. Only exact products (by a
 * power of two), so FMA contraction cannot make two call sites disagree. */
static float value(int64_t step, int buf, int64_t i) {
    return (float)(step * 4 + buf) + (float)(i & 1023) * (1.0f / 1024.0f);
}

/* The contents of save number `step`. */
static void world_fill(world *w, int64_t step) {
    for (int p = 0; p < 2; p++) {
        ht_param *q = &w->ps.items[p];
        int64_t n = ht_param_local_numel(q);
        for (int64_t i = 0; i < n; i++) {
            q->main_param[i] = value(step, 0, i);
            w->slots[p].exp_avg[i] = value(step, 1, i);
            w->slots[p].exp_avg_sq[i] = value(step, 2, i);
        }
        if ((void *)q->main_param != q->data) ht_convert(q->data, q->dtype, q->main_param, HT_DTYPE_F32, (size_t)n);
        w->slots[p].step = step;
    }
}

/* True when w holds exactly save number `step`. */
static bool world_is(const world *w, int64_t step) {
    for (int p = 0; p < 2; p++) {
        const ht_param *q = &w->ps.items[p];
        int64_t n = ht_param_local_numel(q);
        if (w->slots[p].step != step) {
            fprintf(stderr, "param %d: slot step %lld\n", p, (long long)w->slots[p].step);
            return false;
        }
        for (int64_t i = 0; i < n; i++) {
            if (q->main_param[i] != value(step, 0, i) || w->slots[p].exp_avg[i] != value(step, 1, i) ||
                w->slots[p].exp_avg_sq[i] != value(step, 2, i)) {
                fprintf(stderr, "param %d elem %lld: %g %g %g\n", p, (long long)i, q->main_param[i],
                        w->slots[p].exp_avg[i], w->slots[p].exp_avg_sq[i]);
                return false;
            }
            if (q->dtype == HT_DTYPE_BF16 && ((const uint16_t *)q->data)[i] != ht_f32_to_bf16(value(step, 0, i)))
                return false;
        }
    }
    return true;
}

static ht_ckpt_view view_of(world *w, int64_t step) {
    ht_ckpt_view v = {.params = &w->ps, .optimizer = &w->opt};
    v.state.step = step;
    v.state.schedule_step = step;
    v.state.train_pos.index = (uint64_t)step * 8;
    return v;
}

/* The child: saves step, step + 1, ... until it is killed. */
static void save_forever(const char *out, int64_t step) {
    world w;
    world_init(&w);
    ht_ckpt_save_options o = {.save_optimizer = true, .keep_last = 2};
    ht_log_set_level(HT_LOG_WARN);
    for (;; step++) {
        world_fill(&w, step);
        ht_ckpt_view v = view_of(&w, step);
        ht_error err;
        if (ht_ckpt_save(out, &v, &o, NULL, 0, &err) != HT_OK) {
            fprintf(stderr, "child: save failed: %s\n", err.msg);
            _exit(3);
        }
    }
}

static bool has_tmp_dir(const char *out) {
    char cmd[1400];
    snprintf(cmd, sizeof(cmd), "ls -d '%s'/step_*.tmp >/dev/null 2>&1", out);
    return system(cmd) == 0;
}

static void test_sigkill_during_saves_leaves_latest_loadable(void **state) {
    (void)state;
    const char *dir = scratch_dir("crash");
    char out[1200];
    snprintf(out, sizeof(out), "%s/run", dir);
    const char *env = getenv("HT_CRASH_TRIALS");
    int trials = env ? atoi(env) : 50;
    ht_rng rng;
    ht_rng_seed(&rng, (uint64_t)time(NULL));
    world w;
    world_init(&w);
    int64_t last = 0;
    int mid_save = 0, none_yet = 0, loaded = 0, saves = 0;
    for (int trial = 0; trial < trials; trial++) {
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) save_forever(out, (int64_t)(trial + 1) * 1000);
        /* A save of this size takes ~10-30 ms here (most of it fsync): kill anywhere in the first few saves. */
        usleep((useconds_t)(1000 + ht_rng_below(&rng, 150000)));
        kill(pid, SIGKILL);
        int status;
        waitpid(pid, &status, 0);
        if (!WIFSIGNALED(status)) fail_msg("trial %d: the child exited by itself (status %d)", trial, status);
        mid_save += has_tmp_dir(out);

        ht_error err;
        char ck_dir[HT_CKPT_PATH_MAX];
        assert_ht_ok(ht_ckpt_resolve("latest", out, ck_dir, sizeof(ck_dir), &err), &err);
        if (!ck_dir[0]) {
            /* Only before the first save ever completed. */
            if (last != 0) fail_msg("trial %d: `latest` disappeared after step %lld", trial, (long long)last);
            none_yet++;
            continue;
        }
        ht_checkpoint *ck;
        if (ht_ckpt_open(ck_dir, &ck, &err) != HT_OK) fail_msg("trial %d: latest does not open: %s", trial, err.msg);
        int64_t step = ht_ckpt_step(ck);
        ht_ckpt_view v = view_of(&w, 0);
        memset(w.state, 0xff, 64); /* poison: the load must overwrite */
        assert_ht_ok(ht_ckpt_load(ck, &v, true, &err), &err);
        if (!world_is(&w, step))
            fail_msg("trial %d: latest (step %lld) is not that save's content", trial, (long long)step);
        if (v.state.train_pos.index != (uint64_t)step * 8) fail_msg("trial %d: trainer state of another save", trial);
        if (step < last)
            fail_msg("trial %d: latest went back from %lld to %lld", trial, (long long)last, (long long)step);
        last = step;
        saves += (int)(step % 1000) + 1; /* saves this child completed, as far as latest shows */
        loaded++;
        ht_ckpt_close(ck);
    }
    printf("crash test: %d trials, %d killed in the middle of a save (a .tmp left behind), %d before any save "
           "completed, %d loads of latest all equal to a completed save (%d saves completed in all)\n",
           trials, mid_save, none_yet, loaded, saves);
    if (loaded < trials / 2)
        fail_msg("only %d of %d trials found a checkpoint to load (%d before any save completed): the saves were "
                 "slower than the kills",
                 loaded, trials, none_yet);
    world_free(&w);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sigkill_during_saves_leaves_latest_loadable),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
