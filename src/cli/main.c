/* The hypertrain command: `train` runs a config, `plot` draws a metrics file,
 * `export` writes a checkpoint as a Hugging Face model, `inspect` describes one.
 * Only this file calls exit() (by returning from main). */
#include <omp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/launch.h"
#include "hypertrain/ckpt.h"
#include "hypertrain/config.h"
#include "hypertrain/comm.h"
#include "hypertrain/train.h"

/* The exit status of a run stopped by a signal after saving its checkpoint:
 * sysexits.h's EX_TEMPFAIL, "try again later", as the same command resumes. */
#define HT_EXIT_STOPPED 75

static void usage(FILE *f) {
    fprintf(f, "usage:\n"
               "  hypertrain train CONFIG.yaml [--set section.key=value ...]\n"
               "      train as the YAML file says; --set overrides any key. Exit status: 0 done, 1 an error,\n"
               "      75 stopped by SIGTERM/SIGINT/SIGHUP after saving a checkpoint (run it again to resume)\n"
               "  hypertrain launch [--grace SECONDS] -- mpirun -np N hypertrain train CONFIG.yaml ...\n"
               "      run a training command so that SIGTERM/SIGINT/SIGHUP reach its ranks, not mpirun: they\n"
               "      save a checkpoint and stop within SECONDS (default 120); exit status theirs (75)\n"
               "  hypertrain plot METRICS.jsonl [OUT.svg]\n"
               "      draw the loss curve of a run (default OUT: next to METRICS, loss.svg)\n"
               "  hypertrain export CKPT OUT_DIR [--dtype bfloat16|float16|float32] [--max-shard-mb N] [--adapter]\n"
               "      write a checkpoint's model as Hugging Face config.json + model.safetensors\n"
               "      (sharded with model.safetensors.index.json above N MiB, default 2048), LoRA\n"
               "      adapters merged into the weights; --adapter: the LoRA adapters alone, as PEFT's\n"
               "      adapter_config.json + adapter_model.safetensors (default dtype float32)\n"
               "  hypertrain inspect CKPT\n"
               "      print a checkpoint's step, world size, keys by kind, sizes and hash check\n");
}

static int fail(const ht_error *err) {
    fprintf(stderr, "hypertrain: error: %s\n", err->msg);
    return 1;
}

/* A rank's error once the ranks work together. One that every rank holds
 * alike (err->everywhere: they agreed on it in a collective) is reported
 * once, by rank 0, and every rank stops by itself. Any other may leave its
 * peers waiting in a collective for it, so the whole world ends with it
 * instead of hanging. */
static int fail_rank(ht_comm *comm, const ht_error *err) {
    if (comm->size == 1) return fail(err);
    if (err->everywhere) return comm->rank == 0 ? fail(err) : 1;
    fprintf(stderr, "hypertrain: error on rank %d of %d: %s\n", comm->rank, comm->size, err->msg);
    fflush(stderr);
    ht_comm_abort(comm, 1);
    return 1;
}

/* The configuration, loaded and validated by every rank on its own (no
 * collective can hang on a rank that failed); then every rank learns which
 * ranks failed and why, and all stop together, within the time it takes to
 * read the file. Rank 0 says each distinct error once, with the ranks that
 * hit it (every rank of a job usually fails alike: one sentence, not one a
 * rank). */
static int load_config(ht_comm *comm, const char *path, int n, char **overrides, ht_config *cfg) {
    ht_error err = {0};
    ht_status s = ht_config_load(path, n, overrides, cfg, &err);
    if (s == HT_OK) s = ht_config_validate(cfg, comm->size, &err);
    if (comm->size == 1) return s == HT_OK ? 0 : fail(&err);
    const int P = comm->size;
    int32_t mine = s != HT_OK, failed[P];
    int64_t bytes[P];
    for (int r = 0; r < P; r++) bytes[r] = sizeof(int32_t);
    ht_all_gather(comm, &mine, failed, bytes);
    char ranks[256] = "";
    int count = 0;
    for (int r = 0; r < P; r++) {
        if (!failed[r]) continue;
        size_t at = strlen(ranks);
        if (count++ < 16) snprintf(ranks + at, sizeof(ranks) - at, "%s%d", at ? ", " : "", r);
    }
    if (count == 0) return 0;
    /* The failed ranks' messages to rank 0 (a message a rank, in rank order). */
    char *all = comm->rank == 0 ? calloc((size_t)P, sizeof(err.msg)) : NULL;
    for (int r = 0; r < P; r++) bytes[r] = sizeof(err.msg);
    if (comm->rank == 0 && !all) {
        fprintf(stderr,
                "hypertrain: error: %d of %d ranks (%s) could not load or validate the configuration (rank "
                "0 has no memory to gather why): every rank stops\n",
                count, P, ranks);
        ht_comm_abort(comm, 1);
    }
    ht_gather(comm, err.msg, all, bytes, 0);
    if (comm->rank != 0) return 1;
    for (int r = 0; all && r < P; r++) {
        const char *msg = all + (size_t)r * sizeof(err.msg);
        bool said = false;
        for (int q = 0; q < r && !said; q++) said = failed[q] && strcmp(msg, all + (size_t)q * sizeof(err.msg)) == 0;
        if (!failed[r] || said) continue;
        char alike[256] = "";
        int same = 0;
        for (int q = r; q < P; q++) {
            if (!failed[q] || strcmp(msg, all + (size_t)q * sizeof(err.msg)) != 0) continue;
            size_t at = strlen(alike);
            if (same++ < 16) snprintf(alike + at, sizeof(alike) - at, "%s%d", at ? ", " : "", q);
        }
        fprintf(stderr, "hypertrain: error on rank%s %s%s of %d: %s\n", same > 1 ? "s" : "", alike,
                same > 16 ? ", ..." : "", P, msg);
    }
    free(all);
    fprintf(stderr,
            "hypertrain: error: %d of %d ranks (%s%s) could not load or validate the configuration, as said above: "
            "every rank stops\n",
            count, P, ranks, count > 16 ? ", ..." : "");
    return 1;
}

/* Preemption (Slurm's and Kubernetes' SIGTERM, SIGINT, SIGHUP): the first
 * signal asks the trainer to stop at the next step boundary, saving a
 * checkpoint first (ht_trainer.stop_request); a second one ends the process
 * at once, by that signal. The flag is the CLI's, as is the policy. */
static volatile sig_atomic_t stop_signal = 0;

static void on_stop_signal(int sig) {
    if (stop_signal) {
        static const char now[] = "hypertrain: a second signal: stopping at once, without saving\n";
        ssize_t ignored = write(STDERR_FILENO, now, sizeof(now) - 1);
        (void)ignored;
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    stop_signal = sig;
    static const char first[] = "hypertrain: signal received: finishing the step, saving a checkpoint, then stopping "
                                "(a second signal stops at once)\n";
    ssize_t ignored = write(STDERR_FILENO, first, sizeof(first) - 1);
    (void)ignored;
}

static void catch_stop_signals(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_stop_signal;
    sa.sa_flags = SA_RESTART; /* the system calls it interrupts go on */
    sigemptyset(&sa.sa_mask);
    const int signals[] = {SIGTERM, SIGINT, SIGHUP};
    sigset_t stop;
    sigemptyset(&stop);
    for (size_t i = 0; i < sizeof(signals) / sizeof(signals[0]); i++) {
        sigaction(signals[i], &sa, NULL);
        sigaddset(&stop, signals[i]);
    }
    /* A launcher that started us with them blocked would hide every
     * preemption; one already pending is taken now: a stop before step 1. */
    sigprocmask(SIG_UNBLOCK, &stop, NULL);
    /* `hypertrain train ... | tee log`: a terminal's Ctrl-C reaches tee too,
     * and the next log line would end the run by SIGPIPE before its stop
     * checkpoint. Ignored, a closed log is a write that fails (EPIPE): the
     * log is lost from then on, never the run. */
    signal(SIGPIPE, SIG_IGN);
}

/* OpenMP threads per rank: the node's cores shared by its ranks, unless
 * OMP_NUM_THREADS says otherwise. More threads than cores across the ranks
 * would have OpenMP's spinning threads take turns on the cores. */
static void set_threads(const ht_comm *comm) {
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    if (!getenv("OMP_NUM_THREADS")) {
        long per_rank = cores / (comm->local_size > 0 ? comm->local_size : 1);
        omp_set_num_threads(per_rank > 0 ? (int)per_rank : 1);
    }
    ht_log_info("Processes: %d rank(s) (%s), %d on this node of %ld cores; %d OpenMP thread(s) per rank%s; idle "
                "threads: %s",
                comm->size, comm->name, comm->local_size, cores, omp_get_max_threads(),
                getenv("OMP_NUM_THREADS") ? " (OMP_NUM_THREADS)" : "", ht_openmp_wait());
}

static int cmd_train(int argc, char **argv) {
    if (argc < 1) {
        usage(stderr);
        return 2;
    }
    const char *path = argv[0];
    char **overrides = malloc((size_t)argc * sizeof(char *));
    int n = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--set") == 0 && i + 1 < argc) {
            overrides[n++] = argv[++i];
        } else if (strncmp(argv[i], "--set=", 6) == 0) {
            overrides[n++] = argv[i] + 6;
        } else {
            fprintf(stderr, "hypertrain: unexpected argument '%s' (overrides are --set section.key=value)\n", argv[i]);
            free(overrides);
            return 2;
        }
    }
    ht_config *cfg = malloc(sizeof(ht_config));
    ht_error err = {0};
    int rc = 0;
    ht_comm *comm = NULL;
    if (ht_comm_init(NULL, NULL, &comm, &err) != HT_OK) {
        rc = fail(&err);
        goto done;
    }
    ht_log_set_rank(comm->rank);
    catch_stop_signals();
    if ((rc = load_config(comm, path, n, overrides, cfg)) != 0) goto done;
    set_threads(comm); /* the trainer logs the config in force (with model.from_pretrained's architecture) */
    int stopped_by = 0;
    if (ht_train(cfg, comm, &stop_signal, &stopped_by, &err) != HT_OK)
        rc = fail_rank(comm, &err);
    else if (stopped_by)
        rc = HT_EXIT_STOPPED;
done:
    ht_comm_free(comm);
    free(cfg);
    free(overrides);
    return rc;
}

static int cmd_plot(int argc, char **argv) {
    if (argc < 1) {
        usage(stderr);
        return 2;
    }
    char out[4096];
    if (argc >= 2) {
        snprintf(out, sizeof(out), "%s", argv[1]);
    } else {
        snprintf(out, sizeof(out), "%s", argv[0]);
        char *slash = strrchr(out, '/');
        snprintf(slash ? slash + 1 : out, sizeof(out) - (size_t)(slash ? slash + 1 - out : 0), "loss.svg");
    }
    ht_error err = {0};
    if (ht_plot_metrics(argv[0], out, &err) != HT_OK) return fail(&err);
    printf("%s\n", out);
    return 0;
}

/* hypertrain export CKPT OUT_DIR [--dtype D] [--max-shard-mb N] [--adapter] */
static int cmd_export(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    ht_dtype dtype = HT_DTYPE_COUNT; /* the checkpoint's */
    long long shard_mb = 2048;
    bool adapter = false, sharded = false;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--adapter") == 0) {
            adapter = true;
        } else if (strcmp(a, "--dtype") == 0 && i + 1 < argc) {
            a = argv[++i];
            if (!ht_dtype_from_name(a, &dtype) || !ht_dtype_is_float(dtype)) {
                fprintf(stderr, "hypertrain export: --dtype %s: expected bfloat16, float16 or float32\n", a);
                return 2;
            }
        } else if (strcmp(a, "--max-shard-mb") == 0 && i + 1 < argc) {
            char *end;
            shard_mb = strtoll(argv[++i], &end, 10);
            sharded = true;
            if (*end || shard_mb < 0) {
                fprintf(stderr, "hypertrain export: --max-shard-mb %s: expected a size in MiB\n", argv[i]);
                return 2;
            }
        } else {
            fprintf(stderr, "hypertrain export: unexpected argument '%s'\n", a);
            return 2;
        }
    }
    if (adapter && sharded) {
        fprintf(stderr, "hypertrain export: --adapter writes one adapter_model.safetensors; --max-shard-mb does not "
                        "apply\n");
        return 2;
    }
    ht_error err = {0};
    ht_status s = adapter ? ht_ckpt_export_adapter(argv[0], argv[1], dtype, &err)
                          : ht_ckpt_export(argv[0], argv[1], dtype, (size_t)shard_mb << 20, &err);
    if (s != HT_OK) return fail(&err);
    printf("%s\n", argv[1]);
    return 0;
}

static int cmd_inspect(int argc, char **argv) {
    if (argc != 1) {
        usage(stderr);
        return 2;
    }
    ht_error err = {0};
    if (ht_ckpt_inspect(argv[0], stdout, &err) != HT_OK) return fail(&err);
    return 0;
}

int main(int argc, char **argv) {
    ht_openmp_settle(argv);
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "help") == 0) {
        usage(stdout);
        return 0;
    }
    if (strcmp(argv[1], "train") == 0) return cmd_train(argc - 2, argv + 2);
    if (strcmp(argv[1], "launch") == 0) return cmd_launch(argc - 2, argv + 2);
    if (strcmp(argv[1], "plot") == 0) return cmd_plot(argc - 2, argv + 2);
    if (strcmp(argv[1], "export") == 0) return cmd_export(argc - 2, argv + 2);
    if (strcmp(argv[1], "inspect") == 0) return cmd_inspect(argc - 2, argv + 2);
    fprintf(stderr, "hypertrain: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}
