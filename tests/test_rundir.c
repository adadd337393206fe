/* The run directory as the `hypertrain` command treats it, end to end:
 * nothing outside it is deleted or written through a symlink, one run owns
 * it at a time, a run stopped by a signal saves first and resumes bitwise
 * (one process and under mpirun, during a save too), a run stopped before
 * its first checkpoint restarts with the same command, and a rank whose
 * configuration fails says so and ends the world at once. */
#include "harness.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

/* dir/corpus.txt and dir/run.yaml: a tiny Qwen2 on it, 8 sequences a step
 * (1, 2 and 4 ranks split them evenly), `steps` steps, writing into dir/out. */
static void write_run(const char *dir, int steps, int save_interval) {
    harness_write_corpus(dir, two_cities, 40);
    write_run_yaml(
        dir,
        "model:\n%s"
        "data:\n  dataset_type: text_bytes\n  path: %s/corpus.txt\n  seq_len: 16\n  valid_fraction: 0.1\n"
        "training:\n  steps: %d\n  local_batch_size: 2\n  global_batch_size: 8\n  eval_batches: 2\n"
        "  eval_interval: 0\n  log_interval: 1\n  deterministic: true\n"
        "checkpoint:\n  output_dir: %s/out\n  save_interval: %d\n  restore_from: latest\n",
        tiny_model_yaml((tiny_model){.intermediate_size = 64, .num_hidden_layers = 2, .max_position_embeddings = 64}),
        dir, steps, dir, save_interval);
}

/* `hypertrain train dir/run.yaml extra` (or `launcher` in front of it, a
 * shell fragment), stdout and stderr into dir/name.log; the exit status
 * (-1 when killed by a signal) and the log. */
static int run(const char *dir, const char *name, const char *launcher, const char *extra, char **log) {
    char args[4000], out[1300];
    snprintf(out, sizeof(out), "%s/%s.log", dir, name);
    snprintf(args, sizeof(args), "train '%s/run.yaml' %s", dir, extra ? extra : "");
    return run_hypertrain(launcher, args, out, false, log);
}

/* The same, started in the background: its pid (the hypertrain process itself). */
static pid_t start(const char *dir, const char *name, const char *env, const char *extra) {
    char cmd[6000];
    snprintf(cmd, sizeof(cmd), "exec env %s '%s' train '%s/run.yaml' %s > '%s/%s.log' 2>&1", env ? env : "",
             getenv("HT_BIN"), dir, extra ? extra : "", dir, name);
    char *argv[] = {"/bin/sh", "-c", cmd, NULL};
    pid_t pid;
    if (posix_spawn(&pid, "/bin/sh", NULL, NULL, argv, environ) != 0) fail_msg("cannot start %s", cmd);
    return pid;
}

/* Waits (up to 120 s) until dir/name.log holds `text`; false if the process ended first. */
static bool wait_for(const char *dir, const char *name, pid_t pid, const char *text) {
    char path[1300];
    snprintf(path, sizeof(path), "%s/%s.log", dir, name);
    for (int i = 0; i < 12000; i++) {
        char *log = NULL;
        size_t len;
        if (ht_read_file(path, &log, &len, NULL) == HT_OK) {
            bool found = strstr(log, text) != NULL;
            free(log);
            if (found) return true;
        }
        if (waitpid(pid, NULL, WNOHANG) == pid) return false;
        usleep(10000);
    }
    return false;
}

static int finish(pid_t pid) {
    int status;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) continue;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* A directory outside the run with a file in it, and a symlink in out/ named `link` pointing at it. */
static void plant_link(const char *dir, const char *target, const char *link) {
    char cmd[4000];
    snprintf(cmd, sizeof(cmd), "mkdir -p '%s/%s' '%s/out' && echo keep > '%s/%s/precious' && ln -s '%s/%s' '%s/out/%s'",
             dir, target, dir, dir, target, dir, target, dir, link);
    assert_int_equal(system(cmd), 0);
}

static void assert_precious(const char *dir, const char *target) {
    char path[1300];
    snprintf(path, sizeof(path), "%s/%s/precious", dir, target);
    if (!path_lexists(path)) fail_msg("%s was deleted through a symlink", path);
    char *text = read_text(path);
    assert_string_equal(text, "keep\n");
    free(text);
}

/* ------------------------------------------------------------------ symlinks */

/* A checkpoint name this run will save, as a symlink: refused before the
 * first step, naming it; nothing behind it touched. */
static void test_symlink_where_a_checkpoint_goes(void **state) {
    (void)state;
    const char *dir = scratch_dir("rundir_link_ahead");
    write_run(dir, 2, 1);
    plant_link(dir, "f", "step_00000001");
    char *log;
    assert_int_equal(run(dir, "run", NULL, NULL, &log), 1);
    assert_non_null(strstr(log, "out/step_00000001 is a symbolic link"));
    assert_non_null(strstr(log, "may save step 1 there"));
    assert_null(strstr(log, "step     1/"));
    free(log);
    assert_precious(dir, "f");
    /* The same for the .tmp a save of step 2 would write through. */
    const char *dir2 = scratch_dir("rundir_link_tmp_ahead");
    write_run(dir2, 2, 1);
    plant_link(dir2, "f", "step_00000002.tmp");
    assert_int_equal(run(dir2, "run", NULL, NULL, &log), 1);
    assert_non_null(strstr(log, "out/step_00000002.tmp is a symbolic link"));
    free(log);
    assert_precious(dir2, "f");
}

/* Symlinks and foreign directories named like checkpoints the run does not
 * save, with keep_last 1 and the default 3: left alone, never counted, never
 * deleted through; the run's own old checkpoints are pruned as ever. */
static void test_pruning_leaves_what_is_not_ours(void **state) {
    (void)state;
    for (int keep = 1; keep <= 3; keep += 2) {
        const char *dir = scratch_dir(keep == 1 ? "rundir_prune_1" : "rundir_prune_3");
        write_run(dir, 5, 1);
        plant_link(dir, "f", "step_00000000");
        plant_link(dir, "g", "step_00000009.tmp");
        plant_link(dir, "h", "step_00000007");
        char cmd[1500], path[1300];
        snprintf(cmd, sizeof(cmd), "mkdir '%s/out/step_00000006' && echo mine > '%s/out/step_00000006/notes.txt'", dir,
                 dir);
        assert_int_equal(system(cmd), 0);
        snprintf(cmd, sizeof(cmd), "--set checkpoint.keep_last=%d", keep);
        char *log;
        assert_int_equal(run(dir, "run", NULL, cmd, &log), 0);
        assert_non_null(strstr(log, "out/step_00000000 is a symbolic link"));
        assert_non_null(strstr(log, "out/step_00000006 holds notes.txt, which no checkpoint writes"));
        free(log);
        assert_precious(dir, "f");
        assert_precious(dir, "g");
        assert_precious(dir, "h");
        snprintf(path, sizeof(path), "%s/out/step_00000006/notes.txt", dir);
        assert_true(path_lexists(path));
        for (int step = 1; step <= 5; step++) { /* the run's own: the newest `keep` remain */
            snprintf(path, sizeof(path), "%s/out/step_%08d/metadata.json", dir, step);
            assert_int_equal(path_lexists(path), step > 5 - keep);
        }
    }
}

/* A checkpoint resumed through a symlink (reading is allowed) by a run that
 * ends where it began: nothing is saved over it; a run that would replace
 * that step (checkpoint.overwrite from step 0) is refused. */
static void test_resume_through_a_symlink(void **state) {
    (void)state;
    const char *dir = scratch_dir("rundir_resume_link");
    write_run(dir, 2, 2);
    char *log, cmd[4000], path[1300];
    assert_int_equal(run(dir, "first", NULL, NULL, &log), 0);
    free(log);
    snprintf(cmd, sizeof(cmd), "mv '%s/out/step_00000002' '%s/kept' && ln -s '%s/kept' '%s/out/step_00000002'", dir,
             dir, dir, dir);
    assert_int_equal(system(cmd), 0);
    snprintf(path, sizeof(path), "%s/kept/metadata.json", dir);
    char *before = read_text(path);
    assert_int_equal(run(dir, "again", NULL, NULL, &log), 0);
    assert_non_null(strstr(log, "restored")); /* it did read it */
    free(log);
    char *after = read_text(path);
    assert_string_equal(before, after);
    free(after);
    assert_int_equal(run(dir, "over", NULL, "--set checkpoint.overwrite=true --set checkpoint.restore_from=null", &log),
                     1);
    assert_non_null(strstr(log, "out/step_00000002 is a symbolic link"));
    free(log);
    after = read_text(path);
    assert_string_equal(before, after);
    free(before);
    free(after);
}

/* Files the run writes, as symlinks out of the directory: refused before
 * anything is written; the targets unchanged. */
static void test_no_write_through_a_symlink(void **state) {
    (void)state;
    static const char *const names[] = {"metrics.jsonl", "loss.svg.tmp", "final"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        char name[64], cmd[4000];
        snprintf(name, sizeof(name), "rundir_write_link_%zu", i);
        const char *dir = scratch_dir(name);
        write_run(dir, 2, 1);
        bool is_dir = strcmp(names[i], "final") == 0;
        if (is_dir)
            plant_link(dir, "f", names[i]);
        else {
            snprintf(cmd, sizeof(cmd),
                     "mkdir -p '%s/f' '%s/out' && echo keep > '%s/f/precious' && ln -s '%s/f/precious' '%s/out/%s'",
                     dir, dir, dir, dir, dir, names[i]);
            assert_int_equal(system(cmd), 0);
        }
        char *log;
        assert_int_equal(run(dir, "run", NULL, NULL, &log), 1);
        assert_non_null(strstr(log, "is a symbolic link, where this run writes"));
        assert_null(strstr(log, "step     1/"));
        free(log);
        assert_precious(dir, "f");
    }
}

/* ------------------------------------------------------------------ one run at a time */

/* A second run into a directory a live run holds is refused at once, naming
 * the first one's pid; the first goes on untouched. Once that one is killed,
 * its lock goes with it and the same command resumes. */
static void test_one_run_per_directory(void **state) {
    (void)state;
    const char *dir = scratch_dir("rundir_lock");
    write_run(dir, 100000, 5);
    pid_t first = start(dir, "first", NULL, NULL);
    assert_true(wait_for(dir, "first", first, "saved checkpoint"));
    char *log, expected[128];
    double t0 = ht_time_seconds();
    assert_int_equal(run(dir, "second", NULL, NULL, &log), 1);
    assert_true(ht_time_seconds() - t0 < 30);
    snprintf(expected, sizeof(expected), "is in use by another run (pid %ld on host ", (long)first);
    assert_non_null(strstr(log, expected));
    assert_null(strstr(log, "step     1/"));
    free(log);
    assert_int_equal(waitpid(first, NULL, WNOHANG), 0); /* still training */
    kill(first, SIGKILL);
    assert_int_equal(finish(first), 128 + SIGKILL);
    char resume[64];
    snprintf(resume, sizeof(resume), "--set training.steps=%d", 12);
    assert_int_equal(run(dir, "third", NULL, resume, &log), 0);
    assert_non_null(strstr(log, "step    12/"));
    free(log);
}

/* ------------------------------------------------------------------ restart */

/* A run that saved no checkpoint left only metrics.jsonl: the same command
 * starts again from step 0, the old metrics kept aside. */
static void test_restart_before_the_first_checkpoint(void **state) {
    (void)state;
    const char *dir = scratch_dir("rundir_restart");
    write_run(dir, 3, 0);
    char *log, path[1300];
    assert_int_equal(run(dir, "first", NULL, NULL, &log), 0);
    free(log);
    snprintf(path, sizeof(path), "%s/out/metrics.jsonl", dir);
    char *old = read_text(path);
    assert_int_equal(run(dir, "again", NULL, NULL, &log), 0);
    assert_non_null(strstr(log, "holds the metrics of a run that saved no checkpoint: kept as"));
    assert_non_null(strstr(log, "step     1/"));
    free(log);
    char cmd[1500], *aside;
    snprintf(cmd, sizeof(cmd), "ls '%s'/out/metrics.jsonl.2* > '%s/aside.txt'", dir, dir);
    assert_int_equal(system(cmd), 0);
    snprintf(path, sizeof(path), "%s/aside.txt", dir);
    aside = read_text(path);
    aside[strcspn(aside, "\n")] = '\0';
    char *kept = read_text(aside);
    assert_string_equal(kept, old);
    free(kept);
    free(aside);
    free(old);
}

/* output_dir as a user may mistype it: the root is refused outright (nothing
 * written there); a directory of the user's own (their home, say) that holds
 * latest, loss.svg, final/ or metrics.jsonl that no run wrote is refused
 * before anything in it is touched, naming them, unless checkpoint.overwrite;
 * one with only other files of theirs is used; a run's directory copied
 * without its lock file resumes (its checkpoints say it is a run's). */
static void test_output_dir_that_is_not_a_runs(void **state) {
    (void)state;
    const char *dir = scratch_dir("rundir_foreign");
    write_run(dir, 2, 1);
    char *log, path[1300], cmd[4000];
    struct stat sb;
    bool root_lock = lstat("/hypertrain.lock", &sb) == 0, root_metrics = lstat("/metrics.jsonl", &sb) == 0;
    assert_int_equal(run(dir, "root", NULL, "--set checkpoint.output_dir=/", &log), 1);
    assert_non_null(strstr(log, "checkpoint.output_dir / is the root of the file system"));
    free(log);
    assert_int_equal(run(dir, "root2", NULL, "--set checkpoint.output_dir=/tmp/../", &log), 1);
    assert_non_null(strstr(log, "is the root of the file system"));
    free(log);
    assert_int_equal(lstat("/hypertrain.lock", &sb) == 0, root_lock);
    assert_int_equal(lstat("/metrics.jsonl", &sb) == 0, root_metrics);
    /* A home directory with the user's own latest, loss.svg, final/ and metrics.jsonl. */
    snprintf(cmd, sizeof(cmd),
             "mkdir -p '%s/home/final' && echo mine > '%s/home/latest' && echo mine > '%s/home/loss.svg' && "
             "echo mine > '%s/home/final/notes' && echo mine > '%s/home/metrics.jsonl'",
             dir, dir, dir, dir, dir);
    assert_int_equal(system(cmd), 0);
    char set[1400];
    snprintf(set, sizeof(set), "--set 'checkpoint.output_dir=%s/home'", dir);
    assert_int_equal(run(dir, "home", NULL, set, &log), 1);
    assert_non_null(strstr(log, "/home holds latest, loss.svg, final, metrics.jsonl, which no run of this engine "
                                "wrote"));
    assert_non_null(strstr(log, "checkpoint.overwrite: true"));
    free(log);
    const char *const mine[] = {"latest", "loss.svg", "final/notes", "metrics.jsonl"};
    for (int i = 0; i < 4; i++) {
        snprintf(path, sizeof(path), "%s/home/%s", dir, mine[i]);
        char *text = read_text(path);
        assert_string_equal(text, "mine\n");
        free(text);
    }
    snprintf(path, sizeof(path), "%s/home/hypertrain.lock", dir);
    assert_false(path_lexists(path));
    /* With checkpoint.overwrite the user said so: it runs, warning. */
    snprintf(set, sizeof(set),
             "--set 'checkpoint.output_dir=%s/home' --set checkpoint.overwrite=true --set checkpoint.restore_from=null",
             dir);
    assert_int_equal(run(dir, "home_overwrite", NULL, set, &log), 0);
    assert_non_null(strstr(log, "which no run of this engine wrote"));
    free(log);
    /* Other files of the user's are no obstacle. */
    snprintf(cmd, sizeof(cmd), "mkdir -p '%s/mine' && echo mine > '%s/mine/notes.txt'", dir, dir);
    assert_int_equal(system(cmd), 0);
    snprintf(set, sizeof(set), "--set 'checkpoint.output_dir=%s/mine'", dir);
    assert_int_equal(run(dir, "mine", NULL, set, &log), 0);
    free(log);
    /* A run's directory copied without its lock: its checkpoints make it a run's; it resumes. */
    snprintf(cmd, sizeof(cmd), "rm '%s/mine/hypertrain.lock'", dir);
    assert_int_equal(system(cmd), 0);
    snprintf(set, sizeof(set), "--set 'checkpoint.output_dir=%s/mine' --set training.steps=3", dir);
    assert_int_equal(run(dir, "copied", NULL, set, &log), 0);
    assert_non_null(strstr(log, "step     3/"));
    assert_null(strstr(log, "step     1/"));
    free(log);
}

/* A resume with a key changed that says what the model computes or what
 * data it reads: an error naming the key, the checkpoint's value and this
 * run's, before a step; with checkpoint.allow_changes naming it, the run goes
 * on and says so. The same file spelled another way is no change, and a key
 * allow_changes cannot mean is refused at validation. */
static void test_resume_with_the_model_or_data_changed(void **state) {
    (void)state;
    const char *dir = scratch_dir("rundir_changed");
    write_run(dir, 2, 1);
    char *log, set[2000];
    assert_int_equal(run(dir, "first", NULL, NULL, &log), 0);
    free(log);
    static const struct {
        const char *set, *says;
    } changes[] = {
        {"--set model.rope_theta=5000", "model.rope_theta: 10000.0 in the checkpoint, 5000.0 in this run"},
        {"--set model.rms_norm_eps=1e-5", "model.rms_norm_eps: 1.0e-06 in the checkpoint, 1.0e-05 in this run"},
        {"--set model.max_position_embeddings=128",
         "model.max_position_embeddings: 64 in the checkpoint, 128 in this run"},
        {"--set data.seq_len=8", "data.seq_len: 16 in the checkpoint, 8 in this run"},
        {"--set data.valid_fraction=0.2", "data.valid_fraction: 0.1 in the checkpoint, 0.2 in this run"},
    };
    for (size_t i = 0; i < sizeof(changes) / sizeof(changes[0]); i++) {
        snprintf(set, sizeof(set), "--set training.steps=3 %s", changes[i].set);
        assert_int_equal(run(dir, "changed", NULL, set, &log), 1);
        if (!strstr(log, changes[i].says))
            fail_msg("%s: expected \"%s\" in:\n%s", changes[i].set, changes[i].says, log);
        assert_non_null(strstr(log, "checkpoint.allow_changes: ["));
        assert_null(strstr(log, "step     3/"));
        free(log);
    }
    /* Two at once: both named. */
    assert_int_equal(
        run(dir, "changed2", NULL, "--set training.steps=3 --set model.rope_theta=5000 --set data.seq_len=8", &log), 1);
    assert_non_null(strstr(log, "2 keys that say what"));
    assert_non_null(strstr(log, "checkpoint.allow_changes: [model.rope_theta, data.seq_len]"));
    free(log);
    /* Another corpus: refused; the same corpus through a symlink: the same file, no change. */
    char other[1300], link[1300], cmd[4000];
    snprintf(other, sizeof(other), "%s/other.txt", dir);
    snprintf(link, sizeof(link), "%s/link.txt", dir);
    snprintf(cmd, sizeof(cmd), "cp '%s/corpus.txt' '%s' && ln -s corpus.txt '%s'", dir, other, link);
    assert_int_equal(system(cmd), 0);
    snprintf(set, sizeof(set), "--set training.steps=3 --set 'data.path=%s'", other);
    assert_int_equal(run(dir, "other_corpus", NULL, set, &log), 1);
    assert_non_null(strstr(log, "data.path: "));
    free(log);
    /* A deliberate seq_len change, allowed by name: the run goes on, saying so. */
    assert_int_equal(run(dir, "allowed", NULL,
                         "--set training.steps=3 --set data.seq_len=8 --set 'checkpoint.allow_changes=[data.seq_len]'",
                         &log),
                     0);
    assert_non_null(strstr(log, "resume: data.seq_len was 16"));
    assert_non_null(strstr(log, "checkpoint.allow_changes names it"));
    assert_non_null(strstr(log, "step     3/"));
    free(log);
    snprintf(set, sizeof(set), "--set training.steps=4 --set data.seq_len=8 --set 'data.path=%s'", link);
    assert_int_equal(run(dir, "same_file", NULL, set, &log), 0);
    assert_non_null(strstr(log, "step     4/"));
    free(log);
    /* What allow_changes cannot mean. */
    assert_int_equal(run(dir, "bad_allow", NULL, "--set 'checkpoint.allow_changes=[optimizer.lr]'", &log), 1);
    assert_non_null(strstr(log, "optimizer.lr, is not a key a resume refuses to change"));
    free(log);
}

/* ------------------------------------------------------------------ signals */

/* The final weights of an uninterrupted run of `steps` (on `launcher`), for comparison. */
static void continuous(const char *dir, int steps, const char *launcher) {
    write_run(dir, steps, 1000);
    char *log;
    assert_int_equal(run(dir, "continuous", launcher, NULL, &log), 0);
    free(log);
}

/* The same command again (`launcher` in front) finishes the run in dir: its final weights bit for bit those of
 * ref's, never stopped. */
static void assert_resumes_as(const char *ref, const char *dir, const char *launcher) {
    char *log, pa[1300], pb[1300];
    assert_int_equal(run(dir, "resumed", launcher, NULL, &log), 0);
    free(log);
    snprintf(pa, sizeof(pa), "%s/out/final/model.safetensors", ref);
    snprintf(pb, sizeof(pb), "%s/out/final/model.safetensors", dir);
    assert_same_tensors(pa, pb);
}

/* SIGTERM mid-run (one process): the step finishes, a checkpoint is saved,
 * the exit status is 75; the same command finishes the run, bitwise as one
 * that was never stopped. SIGINT and SIGHUP alike. */
static void test_signal_saves_then_stops(void **state) {
    (void)state;
    const char *ref = scratch_dir("rundir_sig_ref");
    continuous(ref, 200, NULL);
    const int signals[] = {SIGTERM, SIGINT, SIGHUP};
    for (int i = 0; i < 3; i++) {
        char name[64];
        snprintf(name, sizeof(name), "rundir_sig_%d", signals[i]);
        const char *dir = scratch_dir(name);
        write_run(dir, 200, 1000);
        pid_t pid = start(dir, "stopped", NULL, NULL);
        assert_true(wait_for(dir, "stopped", pid, "step     4/"));
        kill(pid, signals[i]);
        assert_int_equal(finish(pid), 75);
        char path[1300], *log;
        snprintf(path, sizeof(path), "%s/stopped.log", dir);
        log = read_text(path);
        assert_non_null(strstr(log, "saving a checkpoint and stopping"));
        assert_null(strstr(log, "step   200/"));
        free(log);
        snprintf(path, sizeof(path), "%s/out/latest", dir);
        char *latest = read_text(path);
        long long step = -1;
        assert_int_equal(sscanf(latest, "step_%lld", &step), 1);
        assert_true(step >= 4 && step < 200);
        free(latest);
        assert_resumes_as(ref, dir, NULL);
    }
}

/* `hypertrain train ... 2>&1 | tee log` in a terminal: Ctrl-C (or a
 * SIGTERM, SIGHUP to the process group) reaches tee as well, which dies;
 * the next log line writes into a closed pipe. The run still finishes its
 * step, saves and exits 75 (logging to the closed pipe stops, never the
 * run), and the same command resumes it bitwise. */
static void test_signal_through_a_pipe(void **state) {
    (void)state;
    const char *ref = scratch_dir("rundir_pipe_ref");
    continuous(ref, 200, NULL);
    const int signals[] = {SIGINT, SIGTERM, SIGHUP};
    for (int i = 0; i < 3; i++) {
        char name[64], log_path[1300], config[1300];
        snprintf(name, sizeof(name), "rundir_pipe_%d", signals[i]);
        const char *dir = scratch_dir(name);
        write_run(dir, 200, 1000);
        snprintf(log_path, sizeof(log_path), "%s/stopped.log", dir);
        snprintf(config, sizeof(config), "%s/run.yaml", dir);
        int pipe_fds[2];
        assert_int_equal(pipe(pipe_fds), 0);
        /* tee first, leading a process group of its own (the terminal's foreground job) */
        posix_spawn_file_actions_t tee_io, run_io;
        posix_spawnattr_t group;
        posix_spawn_file_actions_init(&tee_io);
        posix_spawn_file_actions_adddup2(&tee_io, pipe_fds[0], STDIN_FILENO);
        posix_spawn_file_actions_addopen(&tee_io, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
        posix_spawn_file_actions_addclose(&tee_io, pipe_fds[0]);
        posix_spawn_file_actions_addclose(&tee_io, pipe_fds[1]);
        posix_spawnattr_init(&group);
        posix_spawnattr_setflags(&group, POSIX_SPAWN_SETPGROUP);
        posix_spawnattr_setpgroup(&group, 0);
        char *tee_argv[] = {"tee", log_path, NULL};
        pid_t tee;
        assert_int_equal(posix_spawnp(&tee, "tee", &tee_io, &group, tee_argv, environ), 0);
        posix_spawnattr_setpgroup(&group, tee);
        posix_spawn_file_actions_init(&run_io);
        posix_spawn_file_actions_adddup2(&run_io, pipe_fds[1], STDOUT_FILENO);
        posix_spawn_file_actions_adddup2(&run_io, pipe_fds[1], STDERR_FILENO);
        posix_spawn_file_actions_addclose(&run_io, pipe_fds[0]);
        posix_spawn_file_actions_addclose(&run_io, pipe_fds[1]);
        char *run_argv[] = {getenv("HT_BIN"), "train", config, NULL};
        pid_t pid;
        assert_int_equal(posix_spawn(&pid, run_argv[0], &run_io, &group, run_argv, environ), 0);
        close(pipe_fds[0]);
        close(pipe_fds[1]);
        posix_spawn_file_actions_destroy(&tee_io);
        posix_spawn_file_actions_destroy(&run_io);
        posix_spawnattr_destroy(&group);
        assert_true(wait_for(dir, "stopped", pid, "step     4/"));
        kill(-tee, signals[i]);
        assert_int_equal(finish(tee), 128 + signals[i]);
        int rc = finish(pid);
        if (rc != 75) fail_msg("%s through a pipe whose reader it killed: exit %d, not 75", strsignal(signals[i]), rc);
        char path[1300];
        snprintf(path, sizeof(path), "%s/out/latest", dir);
        char *latest = read_text(path);
        long long step = -1;
        assert_int_equal(sscanf(latest, "step_%lld", &step), 1);
        assert_true(step >= 4 && step < 200);
        free(latest);
        assert_resumes_as(ref, dir, NULL);
    }
}

/* `hypertrain train dir/run.yaml extra` started with SIGTERM blocked and
 * already pending (a launcher that blocks it, a signal that came first): its
 * exit status, the log in dir/name.log. */
static int run_with_a_pending_stop(const char *dir, const char *name, const char *extra, char **log) {
    char cmd[4000], log_path[1300];
    snprintf(log_path, sizeof(log_path), "%s/%s.log", dir, name);
    snprintf(cmd, sizeof(cmd), "kill -TERM $$; exec '%s' train '%s/run.yaml' %s > '%s' 2>&1", getenv("HT_BIN"), dir,
             extra ? extra : "", log_path);
    posix_spawnattr_t attr;
    sigset_t term;
    sigemptyset(&term);
    sigaddset(&term, SIGTERM);
    posix_spawnattr_init(&attr);
    posix_spawnattr_setsigmask(&attr, &term);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK);
    char *argv[] = {"/bin/sh", "-c", cmd, NULL};
    pid_t pid;
    assert_int_equal(posix_spawn(&pid, "/bin/sh", NULL, &attr, argv, environ), 0);
    posix_spawnattr_destroy(&attr);
    int rc = finish(pid);
    *log = read_text(log_path);
    return rc;
}

/* A stop before step 1 says what was and was not saved: nothing trained, no
 * checkpoint, and the same command starts the run; a stop of a resumed run
 * before its first step names the checkpoint that holds it and saves none
 * again. A signal pending while blocked at the start is taken, not lost. */
static void test_stop_before_the_first_step(void **state) {
    (void)state;
    const char *dir = scratch_dir("rundir_stop_at_0");
    write_run(dir, 2, 1);
    char *log, path[1300];
    assert_int_equal(run_with_a_pending_stop(dir, "stopped", NULL, &log), 75);
    assert_non_null(strstr(log, "stopped before step 1: nothing was trained, so no checkpoint was saved"));
    assert_null(strstr(log, "step_00000000"));
    assert_null(strstr(log, "step     1/"));
    free(log);
    snprintf(path, sizeof(path), "%s/out/latest", dir);
    assert_false(path_lexists(path));
    assert_int_equal(run(dir, "again", NULL, NULL, &log), 0);
    assert_non_null(strstr(log, "step     2/"));
    free(log);
    assert_int_equal(run_with_a_pending_stop(dir, "resumed", "--set training.steps=4", &log), 75);
    assert_non_null(strstr(log, "stopped at step 2 with checkpoint"));
    assert_non_null(strstr(log, "(resumed, nothing trained since: not saved again)"));
    assert_null(strstr(log, "step     3/"));
    free(log);
    char *latest = read_text(path);
    assert_string_equal(latest, "step_00000002\n");
    free(latest);
}

/* SIGTERM while a checkpoint is being written (fsyncs slowed to 300 ms by
 * the fault shim): that save completes and is the one resumed; a second
 * signal during the save ends the process at once, by the signal, and the
 * checkpoint before it is intact. Both resume bitwise. */
static void test_signal_during_a_save(void **state) {
    (void)state;
    const char *ref = scratch_dir("rundir_save_sig_ref");
    continuous(ref, 6, NULL);
    for (int twice = 0; twice < 2; twice++) {
        const char *dir = scratch_dir(twice ? "rundir_save_sig_twice" : "rundir_save_sig_once");
        write_run(dir, 6, 1);
        char env[1600];
        snprintf(env, sizeof(env),
                 "ASAN_OPTIONS=detect_leaks=0:verify_asan_link_order=0 LD_PRELOAD='%s' HT_FAULT_DIR='%s/out' "
                 "HT_FAULT_SLOW_FSYNC_MS=300",
                 getenv("HT_FAIL_IO"), dir);
        pid_t pid = start(dir, "stopped", env, NULL);
        assert_true(wait_for(dir, "stopped", pid, "step     3/")); /* logged before step 3's save */
        kill(pid, SIGTERM);
        if (twice) {
            usleep(100000);
            kill(pid, SIGTERM);
        }
        assert_int_equal(finish(pid), twice ? 128 + SIGTERM : 75);
        char path[1300];
        snprintf(path, sizeof(path), "%s/out/latest", dir);
        char *latest = read_text(path);
        assert_string_equal(latest, twice ? "step_00000002\n" : "step_00000003\n");
        free(latest);
        snprintf(path, sizeof(path), "%s/out/step_00000004", dir);
        assert_false(path_lexists(path));
        assert_resumes_as(ref, dir, NULL);
    }
}

/* Under mpirun: SIGTERM to one rank (as a scheduler may signal any of
 * them): every rank finishes the step, they save together and all exit 75;
 * the same command resumes, bitwise as a 2-rank run never stopped. */
static void test_signal_one_rank_under_mpirun(void **state) {
    (void)state;
    const char *ref = scratch_dir("rundir_mpi_sig_ref");
    continuous(ref, 200, MPIRUN "-np 2 ");
    const char *dir = scratch_dir("rundir_mpi_sig");
    write_run(dir, 200, 1000);
    char args[1500], log_path[1300], *log;
    snprintf(log_path, sizeof(log_path), "%s/stopped.log", dir);
    snprintf(args, sizeof(args), "train '%s/run.yaml'", dir);
    int rc = run_and_signal_a_rank(NULL, 2, args, log_path, "step     4/", "TERM", &log);
    if (rc != 75) fail_msg("exit %d:\n%s", rc, log);
    assert_non_null(strstr(log, "(2 rank files)"));
    assert_null(strstr(log, "step   200/"));
    free(log);
    assert_resumes_as(ref, dir, MPIRUN "-np 2 ");
}

/* `hypertrain launch --grace G -- mpirun -np 2 hypertrain train ...` in the
 * background, its output into dir/name.log (env: a prefix for the ranks,
 * e.g. the fault shim); the launcher's pid. */
static pid_t start_launched(const char *dir, const char *name, const char *grace, const char *env) {
    char cmd[6000];
    const char *bin = getenv("HT_BIN");
    snprintf(cmd, sizeof(cmd),
             "exec '%s' launch --grace %s -- " MPIRUN "-np 2 %s '%s' train '%s/run.yaml' > '%s/%s.log' 2>&1", bin,
             grace, env ? env : "", bin, dir, dir, name);
    char *argv[] = {"/bin/sh", "-c", cmd, NULL};
    pid_t pid;
    if (posix_spawn(&pid, "/bin/sh", NULL, NULL, argv, environ) != 0) fail_msg("cannot start %s", cmd);
    return pid;
}

/* What a scheduler does to a job under mpirun: SIGTERM to the process it
 * started. Under `hypertrain launch` the ranks get it, not mpirun (which
 * would kill them a second later): they finish the step, save, and the
 * launcher exits 75; the same command resumes bitwise. A save that outlasts
 * the grace period is ended, saying so, without a hang. */
static void test_launch_under_mpirun(void **state) {
    (void)state;
    const char *ref = scratch_dir("rundir_launch_ref");
    continuous(ref, 200, MPIRUN "-np 2 ");
    const char *dir = scratch_dir("rundir_launch");
    write_run(dir, 200, 1000);
    pid_t pid = start_launched(dir, "stopped", "60", NULL);
    assert_true(wait_for(dir, "stopped", pid, "step     4/"));
    kill(pid, SIGTERM);
    int rc = finish(pid);
    char path[1300];
    snprintf(path, sizeof(path), "%s/stopped.log", dir);
    char *log = read_text(path);
    if (rc != 75) fail_msg("exit %d, not 75:\n%s", rc, log);
    assert_non_null(strstr(log, "passed to the training processes"));
    assert_non_null(strstr(log, "(2 rank files)"));
    assert_null(strstr(log, "step   200/"));
    free(log);
    assert_resumes_as(ref, dir, MPIRUN "-np 2 ");
    /* fsyncs slowed to 4 s: the stop checkpoint cannot finish within a grace period of 1 s */
    const char *slow = scratch_dir("rundir_launch_grace");
    write_run(slow, 200, 1000);
    char env[1600];
    snprintf(env, sizeof(env),
             "env ASAN_OPTIONS=detect_leaks=0:verify_asan_link_order=0 LD_PRELOAD='%s' HT_FAULT_DIR='%s/out' "
             "HT_FAULT_SLOW_FSYNC_MS=4000",
             getenv("HT_FAIL_IO"), slow);
    pid = start_launched(slow, "stopped", "1", env);
    assert_true(wait_for(slow, "stopped", pid, "step     4/"));
    double t0 = ht_time_seconds();
    kill(pid, SIGTERM);
    rc = finish(pid);
    double dt = ht_time_seconds() - t0;
    snprintf(path, sizeof(path), "%s/stopped.log", slow);
    log = read_text(path);
    if (rc == 75 || rc == 0 || dt > 30) fail_msg("exit %d after %.1f s:\n%s", rc, dt, log);
    assert_non_null(strstr(log, "the grace period of 1 s ended before the run stopped"));
    free(log);
}

/* ------------------------------------------------------------------ a rank's bad configuration */

/* mpirun's MPMD form, one rank given a file that does not exist, or one with
 * an unknown key: that rank prints its own error, naming itself, and every
 * rank stops within seconds, not at the collectives' timeout. */
static void test_bad_config_on_one_rank(void **state) {
    (void)state;
    const char *dir = scratch_dir("rundir_mpmd");
    write_run(dir, 2, 1);
    char bad[1300], cmd[6000], log_path[1300];
    snprintf(bad, sizeof(bad), "%s/bad.yaml", dir);
    write_file(bad, "training:\n  stepz: 3\n", 21);
    snprintf(log_path, sizeof(log_path), "%s/mpmd.log", dir);
    const char *bin = getenv("HT_BIN");
    for (int c = 0; c < 2; c++) {
        if (c == 0)
            snprintf(cmd, sizeof(cmd),
                     MPIRUN "-np 1 '%s' train '%s/run.yaml' : -np 1 '%s' train '%s/missing.yaml' > '%s' 2>&1", bin, dir,
                     bin, dir, log_path);
        else
            snprintf(cmd, sizeof(cmd), MPIRUN "-np 3 '%s' train '%s/run.yaml' : -np 1 '%s' train '%s' > '%s' 2>&1", bin,
                     dir, bin, bad, log_path);
        char *log;
        double t0 = ht_time_seconds();
        int rc = run_logged(cmd, log_path, &log);
        double dt = ht_time_seconds() - t0;
        printf("%s: exit %d after %.1f s\n", c ? "unknown key on rank 3 of 4" : "missing file on rank 1 of 2", rc, dt);
        if (rc <= 0 || rc == 124 || dt > 60) fail_msg("exit %d after %.0f s:\n%s", rc, dt, log);
        assert_non_null(strstr(log, c ? "error on rank 3 of 4: " : "error on rank 1 of 2: "));
        assert_non_null(strstr(log, c ? "stepz" : "missing.yaml"));
        assert_non_null(strstr(log, c ? "1 of 4 ranks (3) could not load" : "1 of 2 ranks (1) could not load"));
        free(log);
    }
    /* Every rank of 4 failing alike: the error said once, naming the four. */
    snprintf(cmd, sizeof(cmd), MPIRUN "-np 4 '%s' train '%s' > '%s' 2>&1", bin, bad, log_path);
    char *log;
    int rc = run_logged(cmd, log_path, &log);
    if (rc <= 0 || rc == 124) fail_msg("exit %d:\n%s", rc, log);
    assert_non_null(strstr(log, "error on ranks 0, 1, 2, 3 of 4: "));
    assert_non_null(strstr(log, "4 of 4 ranks (0, 1, 2, 3) could not load"));
    int said = 0;
    for (const char *at = strstr(log, "unknown key"); at; at = strstr(at + 1, "unknown key")) said++;
    if (said != 1) fail_msg("the error said %d times, not once:\n%s", said, log);
    free(log);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_symlink_where_a_checkpoint_goes),
        cmocka_unit_test(test_pruning_leaves_what_is_not_ours),
        cmocka_unit_test(test_resume_through_a_symlink),
        cmocka_unit_test(test_no_write_through_a_symlink),
        cmocka_unit_test(test_one_run_per_directory),
        cmocka_unit_test(test_restart_before_the_first_checkpoint),
        cmocka_unit_test(test_output_dir_that_is_not_a_runs),
        cmocka_unit_test(test_resume_with_the_model_or_data_changed),
        cmocka_unit_test(test_signal_saves_then_stops),
        cmocka_unit_test(test_signal_through_a_pipe),
        cmocka_unit_test(test_stop_before_the_first_step),
        cmocka_unit_test(test_signal_during_a_save),
        cmocka_unit_test(test_signal_one_rank_under_mpirun),
        cmocka_unit_test(test_launch_under_mpirun),
        cmocka_unit_test(test_bad_config_on_one_rank),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
