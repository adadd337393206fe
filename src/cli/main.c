/* The hypertrain command: `train` runs a config, `plot` draws a metrics file,
 * `export` writes a checkpoint as a Hugging Face model, `inspect` describes one,
 * `generate` continues a prompt with one.
 * Only this file calls exit() (by returning from main). */
#include <errno.h>
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
#include "hypertrain/data.h"
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
               "      print a checkpoint's step, world size, keys by kind, sizes and hash check\n"
               "  hypertrain generate CKPT_OR_HF_DIR (--prompt TEXT | --prompt-ids 1,2,3) [--max-new-tokens N]\n"
               "                      [--temperature T] [--top-k K] [--top-p P] [--seed S]\n"
               "                      [--dtype float32|bfloat16|float16] [--tokenizer PATH]\n"
               "      continue a prompt with a training checkpoint (or a run's output_dir) or a Hugging Face\n"
               "      folder, one process, through a key/value cache; greedy at temperature 0 (the default);\n"
               "      defaults: 64 new tokens, top-k 0 and top-p 1 (off), seed 0, float32. Text through the\n"
               "      folder's tokenizer.json (or the run's data.tokenizer), bytes for a byte-level model;\n"
               "      --prompt-ids: ids in and out\n"
               "  hypertrain plan CONFIG.yaml [--world N] [--memory GIB] [--set section.key=value ...]\n"
               "      without MPI and without allocating the model: the mesh of N ranks (default 1) or the error\n"
               "      a launch would give, each rank's memory by category against GIB a rank (default this\n"
               "      machine's memory over N), the model FLOPs and FSDP's bytes a step. Exit status: 0 it fits,\n"
               "      1 an error, 3 it does not fit\n");
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

/* argv[*i] as an override (`--set KEY=VALUE` or `--set=KEY=VALUE`) into
 * overrides[*n]; *i steps past its value. False: not one. */
static bool take_set(int argc, char **argv, int *i, char **overrides, int *n) {
    if (strcmp(argv[*i], "--set") == 0 && *i + 1 < argc) {
        overrides[(*n)++] = argv[++*i];
        return true;
    }
    if (strncmp(argv[*i], "--set=", 6) == 0) {
        overrides[(*n)++] = argv[*i] + 6;
        return true;
    }
    return false;
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
        if (!take_set(argc, argv, &i, overrides, &n)) {
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

/* One rank's plan, and the ranks that share it. */
typedef struct rank_plan {
    ht_memory_plan m;
    double total;
    int first, last; /* ranks [first, last] (consecutive) plan alike */
} rank_plan;

/* FSDP's traffic a step on a rank, in bytes (docs/DESIGN.md, FSDP units): each
 * sharded param gathered whole in param_dtype once a micro-batch's forward and
 * again for its backward where the units reshard after forward, its gradient
 * reduce-scattered in reduce_dtype once a micro-batch, each receiving
 * (S - 1) / S of the whole; HSDP's replicas then all-reduce the shard's
 * gradients once a step (a ring: 2 (R - 1) / R of them). */
static void fsdp_bytes(const ht_trainer *t, double *gather, double *scatter, double *replicas) {
    const ht_config *c = &t->config;
    const int S = t->par.mesh.shard_group.size, R = t->par.mesh.replica_group.size;
    const ht_dtype reduce = c->fsdp.reduce_dtype == HT_CONFIG_DTYPE_NONE ? c->fsdp.param_dtype : c->fsdp.reduce_dtype;
    double whole = 0, grads = 0, local = 0;
    for (int i = 0; i < t->model->params.count; i++) {
        const ht_param *p = &t->model->params.items[i];
        whole += (double)ht_param_numel(p) * ht_dtype_size(c->fsdp.param_dtype);
        if (p->trainable) grads += (double)ht_param_numel(p) * ht_dtype_size(reduce);
        if (p->trainable) local += (double)ht_param_local_numel(p) * sizeof(float);
    }
    const double share = S > 1 ? (double)(S - 1) / S : 0.0;
    *gather = whole * share * t->grad_accum * (c->fsdp.reshard_after_forward ? 2 : 1);
    *scatter = grads * share * t->grad_accum;
    *replicas = R > 1 ? local * 2.0 * (R - 1) / R : 0.0;
}

static int cmd_plan(int argc, char **argv) {
    if (argc < 1) {
        usage(stderr);
        return 2;
    }
    const char *path = argv[0];
    char **overrides = malloc((size_t)argc * sizeof(char *));
    int n = 0, world = 1;
    double budget_gib = 0;
    for (int i = 1; i < argc; i++) {
        char *end = NULL;
        if (take_set(argc, argv, &i, overrides, &n)) continue;
        if (strcmp(argv[i], "--world") == 0 && i + 1 < argc) {
            long w = strtol(argv[++i], &end, 10);
            if (*end || w < 1 || w > 65536) {
                fprintf(stderr, "hypertrain: --world %s: expected a number of ranks from 1 to 65536\n", argv[i]);
                free(overrides);
                return 2;
            }
            world = (int)w;
        } else if (strcmp(argv[i], "--memory") == 0 && i + 1 < argc) {
            budget_gib = strtod(argv[++i], &end);
            if (*end || !(budget_gib > 0)) {
                fprintf(stderr, "hypertrain: --memory %s: expected GiB a rank, a number > 0\n", argv[i]);
                free(overrides);
                return 2;
            }
        } else {
            fprintf(stderr, "hypertrain: plan: unexpected argument '%s' (--world N, --memory GIB, --set key=value)\n",
                    argv[i]);
            free(overrides);
            return 2;
        }
    }
    ht_config *cfg = malloc(sizeof(ht_config));
    rank_plan *plans = calloc((size_t)world, sizeof(rank_plan));
    ht_trainer *t = malloc(sizeof(ht_trainer));
    ht_error err = {0};
    int rc = 0, count = 0, largest = 0;
    double flops = 0, gather = 0, scatter = 0, replicas = 0;
    const ht_log_level level = ht_log_get_level();
    if (ht_config_load(path, n, overrides, cfg, &err) != HT_OK) {
        rc = fail(&err);
        goto done;
    }
    /* The threads a rank of a launch on this node would have (set_threads): a rank's scratch depends on them. */
    if (!getenv("OMP_NUM_THREADS")) {
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        omp_set_num_threads(cores / world > 0 ? (int)(cores / world) : 1);
    }
    /* Each rank's decisions in turn, in this process, quietly: refusals are errors, the rest is the table below. */
    for (int r = 0; r < world; r++) {
        ht_comm *v = ht_comm_virtual(r, world);
        ht_log_set_level(HT_LOG_WARN);
        ht_log_set_rank(r);
        ht_status s = v ? ht_trainer_plan(t, cfg, v, &err) : ht_fail(&err, HT_ERR_OOM, "out of memory");
        ht_log_set_level(level);
        ht_log_set_rank(0);
        if (s != HT_OK) {
            fprintf(stderr, "hypertrain: error: rank %d of %d: %s\n", r, world, err.msg);
            ht_comm_free(v);
            rc = 1;
            goto done;
        }
        if (r == 0) {
            ht_log_set_level(HT_LOG_INFO);
            if (world > 1) ht_parallel_log(&t->par);
            ht_log_set_level(HT_LOG_WARN);
            flops = ht_model_flops_per_token(&t->model->config, t->T);
            fsdp_bytes(t, &gather, &scatter, &replicas);
        }
        ht_memory_plan m = t->memory_plan;
        /* one process plans every rank: the first plan's start is the process each rank starts as */
        if (r > 0) m.process = plans[0].m.process;
        ht_trainer_free(t);
        ht_comm_free(v);
        if (count && memcmp(&plans[count - 1].m, &m, sizeof(m)) == 0) {
            plans[count - 1].last = r;
        } else {
            plans[count++] = (rank_plan){.m = m, .total = ht_memory_plan_total(&m), .first = r, .last = r};
        }
        if (plans[count - 1].total > plans[largest].total) largest = count - 1;
    }
    const double mib = 1 << 20, gib = 1 << 30; /* --memory is in GiB */
    const double budget = budget_gib > 0 ? budget_gib * gib : (double)ht_physical_memory() / world;
    printf("Plan of %s on %d rank(s) of %d OpenMP thread(s) (OMP_NUM_THREADS, or this node's cores over the ranks), "
           "each rank's peak resident memory (MiB): the process at start (this one's%s), what each category "
           "allocates (FSDP's whole units, the collectives' buffers), the runtime's measured allowance:\n",
           path, world, omp_get_max_threads(), world > 1 ? ", and MPI's measured start" : "");
    printf("  %-10s %8s %8s %8s %9s %9s %8s %11s %11s %7s %8s %8s\n", "ranks", "process", "weights", "main",
           "main_grad", "optimizer", "units", "activations", "collectives", "corpus", "runtime", "total");
    for (int k = 0; k < count; k++) {
        const ht_memory_plan *m = &plans[k].m;
        char ranks[32];
        if (plans[k].first == plans[k].last)
            snprintf(ranks, sizeof(ranks), "%d", plans[k].first);
        else
            snprintf(ranks, sizeof(ranks), "%d-%d", plans[k].first, plans[k].last);
        printf("  %-10s %8.1f %8.1f %8.1f %9.1f %9.1f %8.1f %11.1f %11.1f %7.1f %8.1f %8.1f\n", ranks, m->process / mib,
               m->weights / mib, m->main / mib, m->grad / mib, m->optimizer / mib, m->units / mib, m->activations / mib,
               m->collectives / mib, m->corpus / mib, m->runtime / mib, plans[k].total / mib);
    }
    printf("Model: %.4g FLOPs a token (forward and backward), %.4g a step of %lld tokens\n", flops,
           flops * (double)cfg->training.global_batch_size * cfg->data.seq_len,
           (long long)cfg->training.global_batch_size * cfg->data.seq_len);
    printf("FSDP a step, rank 0: %.1f MiB gathered, %.1f MiB reduce-scattered, %.1f MiB over the replicas (HSDP); "
           "tensor, context and expert parallelism's exchanges not estimated\n",
           gather / mib, scatter / mib, replicas / mib);
    const bool fits = plans[largest].total <= budget;
    printf("%s: rank %d needs %.1f MiB, %s %.1f MiB a rank (%s)\n", fits ? "Fits" : "Does not fit",
           plans[largest].first, plans[largest].total / mib, fits ? "within" : "more than", budget / mib,
           budget_gib > 0 ? "--memory" : "this machine's memory over the ranks");
    rc = fits ? 0 : 3;
done:
    free(t);
    free(plans);
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

/* How generate reads and writes text: a tokenizer, bytes, or ids. */
typedef struct gen_text {
    ht_tokenizer *tok;
    bool bytes;
    int printed;
    double first; /* when the first new token was chosen */
} gen_text;

static void print_token(const gen_text *g, int32_t id, bool first) {
    char buf[1024];
    if (g->tok)
        fwrite(buf, 1, ht_tokenizer_decode(g->tok, id, buf, sizeof(buf)), stdout);
    else if (g->bytes)
        fputc((unsigned char)id, stdout);
    else
        printf("%s%d", first ? "" : ",", id);
}

static bool on_token(void *ctx, int32_t token, const float *logits, int64_t V) {
    (void)logits, (void)V;
    gen_text *g = ctx;
    if (g->printed++ == 0) g->first = ht_time_seconds();
    print_token(g, token, g->printed == 1);
    fflush(stdout);
    return true;
}

static bool parse_number(const char *flag, const char *s, double lo, double hi, double *out) {
    char *end;
    errno = 0;
    *out = strtod(s, &end);
    if (*s && !*end && errno == 0 && *out >= lo && *out <= hi) return true;
    fprintf(stderr, "hypertrain generate: %s %s: expected a number in [%g, %g]\n", flag, s, lo, hi);
    return false;
}

/* "1,2,3" -> ids (malloc'ed); false with a message where it is not a list of ids below V. */
static bool parse_ids(const char *s, int64_t V, int32_t **ids, int *n) {
    *n = 0;
    *ids = malloc((strlen(s) / 2 + 2) * sizeof(int32_t));
    for (const char *p = s; *ids && *p;) {
        char *end;
        errno = 0;
        long long v = strtoll(p, &end, 10);
        if (end == p || errno || v < 0 || v >= V || (*end && *end != ',')) {
            fprintf(stderr, "hypertrain generate: --prompt-ids %s: expected ids in [0, %lld) separated by commas\n", s,
                    (long long)V);
            free(*ids);
            *ids = NULL;
            return false;
        }
        (*ids)[(*n)++] = (int32_t)v;
        p = *end ? end + 1 : end;
    }
    return *ids != NULL;
}

/* hypertrain generate CKPT_OR_HF_DIR (--prompt TEXT | --prompt-ids IDS) [options] */
static int cmd_generate(int argc, char **argv) {
    if (argc < 1 || argv[0][0] == '-') {
        usage(stderr);
        return 2;
    }
    const char *prompt = NULL, *prompt_ids = NULL, *tokenizer = NULL;
    double max_new = 64, temperature = 0, top_k = 0, top_p = 1, seed = 0;
    ht_dtype dtype = HT_DTYPE_F32;
    for (int i = 1; i < argc; i += 2) { /* each flag with its value */
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        bool ok = v != NULL;
        if (ok && strcmp(a, "--prompt") == 0)
            prompt = v;
        else if (ok && strcmp(a, "--prompt-ids") == 0)
            prompt_ids = v;
        else if (ok && strcmp(a, "--tokenizer") == 0)
            tokenizer = v;
        else if (ok && strcmp(a, "--max-new-tokens") == 0)
            ok = parse_number(a, v, 0, 1 << 24, &max_new);
        else if (ok && strcmp(a, "--temperature") == 0)
            ok = parse_number(a, v, 0, 1e6, &temperature);
        else if (ok && strcmp(a, "--top-k") == 0)
            ok = parse_number(a, v, 0, 1 << 30, &top_k);
        else if (ok && strcmp(a, "--top-p") == 0)
            ok = parse_number(a, v, 0, 1, &top_p);
        else if (ok && strcmp(a, "--seed") == 0)
            ok = parse_number(a, v, 0, 9007199254740992.0, &seed);
        else if (ok && strcmp(a, "--dtype") == 0) {
            if (!ht_dtype_from_name(v, &dtype) || !ht_dtype_is_float(dtype)) {
                fprintf(stderr, "hypertrain generate: --dtype %s: expected float32, bfloat16 or float16\n", v);
                return 2;
            }
        } else {
            fprintf(stderr, "hypertrain generate: %s '%s'\n", v ? "unexpected argument" : "no value after", a);
            return 2;
        }
        if (!ok) return 2;
        if (max_new != (int)max_new || top_k != (int)top_k) {
            fprintf(stderr, "hypertrain generate: %s %s: expected a whole number\n", a, v);
            return 2;
        }
    }
    if (!prompt == !prompt_ids) {
        fprintf(stderr,
                "hypertrain generate: give the prompt as --prompt TEXT or as --prompt-ids 1,2,3 (one of them)\n");
        return 2;
    }
    ht_error err = {0};
    ht_model *m = NULL;
    ht_ckpt_model_info *info = malloc(sizeof(ht_ckpt_model_info));
    gen_text g = {0};
    int32_t *ids = NULL, *out = NULL;
    int n = 0, rc = 0, produced = 0;
    double t0 = ht_time_seconds();
    ht_status s =
        info ? ht_ckpt_load_model(argv[0], dtype, &m, info, &err) : ht_fail(&err, HT_ERR_OOM, "out of memory");
    if (s == HT_OK && dtype != HT_DTYPE_F32) s = ht_model_set_compute(m, dtype, &err);
    if (s == HT_OK && (tokenizer || info->tokenizer[0]))
        s = ht_tokenizer_load(tokenizer ? tokenizer : info->tokenizer, &g.tok, &err);
    if (s != HT_OK) goto done;
    const int64_t V = m->config.vocab_size;
    g.bytes = !g.tok && (info->bytes || V == 256);
    if (prompt_ids) { /* ids in, ids out */
        ht_tokenizer_free(g.tok);
        g.tok = NULL, g.bytes = false;
    }
    if (g.tok && ht_tokenizer_vocab(g.tok) > V) {
        s = ht_fail(&err, HT_ERR_INVALID, "the tokenizer has %d tokens, more than the model's vocabulary (%lld)",
                    ht_tokenizer_vocab(g.tok), (long long)V);
    } else if (prompt_ids) {
        if (!parse_ids(prompt_ids, V, &ids, &n)) {
            rc = 2;
            goto done;
        }
    } else if (g.tok) {
        s = ht_tokenizer_encode(g.tok, prompt, strlen(prompt), &ids, &n, &err);
    } else if (g.bytes) {
        n = (int)strlen(prompt);
        ids = malloc((size_t)(n + 1) * sizeof(int32_t));
        for (int i = 0; ids && i < n; i++) ids[i] = (unsigned char)prompt[i];
    } else {
        s = ht_fail(&err, HT_ERR_INVALID,
                    "%s has no tokenizer (no tokenizer.json; a checkpoint: no data.tokenizer) and its vocabulary "
                    "(%lld) is not bytes: give --tokenizer PATH, or the prompt as --prompt-ids 1,2,3",
                    info->dir, (long long)V);
    }
    if (s == HT_OK && !(out = malloc(((size_t)max_new + 1) * sizeof(int32_t))))
        s = ht_fail(&err, HT_ERR_OOM, "out of memory");
    if (s != HT_OK) goto done;
    int64_t numel = 0;
    for (int i = 0; i < m->params.count; i++) numel += ht_param_numel(&m->params.items[i]);
    ht_log_info("generate: %s (%s, %lld parameters in %s), loaded in %.2f s; the prompt is %d tokens", info->dir,
                m->config.name, (long long)numel, ht_dtype_name(dtype), ht_time_seconds() - t0, n);
    if (!prompt_ids && (g.tok || g.bytes)) fwrite(prompt, 1, strlen(prompt), stdout);
    const ht_sampling how = {temperature, (int)top_k, top_p, (uint64_t)seed};
    t0 = ht_time_seconds();
    s = ht_generate(m, ids, n, (int)max_new, &how, info->eos, info->eos_count, on_token, &g, out, &produced, &err);
    const double t1 = ht_time_seconds();
    fputc('\n', stdout);
    fflush(stdout);
    if (s == HT_OK && produced > 0)
        ht_log_info("generate: %d new tokens; the prompt's %d in %.3f s, then %.1f tokens/s", produced, n, g.first - t0,
                    produced > 1 ? (produced - 1) / (t1 - g.first) : 0.0);
done:
    if (s != HT_OK) rc = fail(&err);
    ht_tokenizer_free(g.tok);
    ht_model_free(m);
    free(info);
    free(ids);
    free(out);
    return rc;
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
    if (strcmp(argv[1], "generate") == 0) return cmd_generate(argc - 2, argv + 2);
    if (strcmp(argv[1], "plan") == 0) return cmd_plan(argc - 2, argv + 2);
    fprintf(stderr, "hypertrain: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}
