/* The trainer: builds the model, data and optimizer from a config, runs the
 * loop (micro-batches, accumulation, clipping, the optimizer step, the LR
 * schedule), logs progress and metrics, evaluates, and saves the weights. */
#ifndef HYPERTRAIN_TRAIN_H
#define HYPERTRAIN_TRAIN_H

#include <signal.h>
#include <stdio.h>

#include "hypertrain/base.h"
#include "hypertrain/ckpt.h"
#include "hypertrain/config.h"
#include "hypertrain/data.h"
#include "hypertrain/parallel.h"
#include "hypertrain/model.h"
#include "hypertrain/optimizer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ht_step_stats {
    int64_t step;         /* 1-based index of the step just taken */
    double loss;          /* mean training loss over the step's micro-batches */
    double lr;            /* the AdamW learning rate of the step */
    double muon_lr;       /* the Muon learning rate of the step */
    double loss_scale;    /* the fp16 loss scale the step ran with (1 otherwise) */
    bool skipped;         /* fp16 overflow: the step did not update */
    int qk_clipped_heads; /* heads QK-clip rescaled after this step */
    double qk_max_logit;  /* QK-clip on: the step's largest attention logit over every head (its S_h); else NAN */
    /* A model with experts: over the sparse layers, the most and the fewest
     * tokens of the global batch an expert was routed, over its layer's mean
     * (1: balanced; 0: an expert got none); NAN without experts. */
    double expert_load_max, expert_load_min;
    double grad_norm; /* before clipping */
    double tokens_per_s;
    /* Model FLOP utilization: model FLOPs (ht_model_flops_per_token) a second
     * per rank, over the GEMM rate measured at start for the compute dtype's
     * kernel; 0 where no rate is known. */
    double mfu;
    /* The same with this rank's Newton-Schulz FLOPs (ht_optimizer_ns_flops) counted as work done: how busy the
     * step kept the GEMMs; 0 without Muon or without a measured rate. */
    double mfu_with_ns;
    double seconds;
} ht_step_stats;

/* The bytes a rank takes, by category, planned from the declared model
 * before any of it is allocated (setup's plan_memory) and printed beside
 * what each category measured at the end (the memory profile). The training
 * state's categories are the bytes their allocations take (the optimizer's
 * with Muon's workspace, deredundancy's matrices and tensor parallelism's
 * gather; the activations with the experts' and context parallelism's
 * buffers); FSDP's units are the pool a dry run of a step's hooks fills;
 * the collectives' the comm layer's buffers by its formula. The process and
 * the runtime are measured: the process as it stood when the trainer began
 * (hypertrain plan: its own, and MPI's measured start under mpirun), the
 * runtime as allowances measured on this project's runs (docs/DESIGN.md,
 * The memory plan). */
typedef struct ht_memory_plan {
    double process; /* resident before the trainer: the program, its libraries mapped, MPI's start, the config */
    double weights; /* the model's dtype, and compute copies in param_dtype where it differs */
    double main, grad, optimizer, units, activations, collectives, corpus;
    double runtime; /* what the libraries take as a step runs: code paged in, oneDNN's JIT and scratchpads,
                     * OpenMP's threads, the heap, MPI's buffers */
} ht_memory_plan;

/* Every category of m, summed: the rank's planned peak. */
double ht_memory_plan_total(const ht_memory_plan *m);

typedef struct ht_trainer {
    ht_config config;
    ht_comm *comm; /* the ranks training together (data parallel); ht_comm_single() for one process */
    /* The group the caller gave: comm itself, or, where the kernels' memory
     * is not the host's, the group inside comm (a staged group over it,
     * ht_comm_staged), as are the groups split from comm. */
    ht_comm *world;
    ht_parallel par;  /* the mesh and every group of it (docs/DESIGN.md, The mesh), split from comm */
    ht_pipeline pipe; /* the order a step's micro-batches run in on this rank's pipeline stage (one stage: in turn) */
    ht_model *model;
    /* Pipeline parallelism: the whole model declared, without storage (every
     * stage's params' names, shapes and dtypes: what a checkpoint holds and
     * the final weights gather); NULL with one stage. */
    ht_model *whole;
    ht_fsdp *fsdp; /* the model's FSDP units over shard_comm */
    ht_dataset *data;
    ht_loader train_loader;
    ht_loader valid_loader;
    ht_optimizer optimizer;
    ht_optimizer_config optimizer_config;  /* what the optimizer is built with, known before the params' storage */
    ht_memory_plan memory_plan;            /* this rank's, made before anything it counts was allocated */
    ht_qk_layer *qk_layers;                /* (L) when QK-clip is on, else NULL */
    const char *no_wd[HT_CONFIG_LIST_MAX]; /* config strings, as the optimizer takes them */
    const char
        *adamw_include[HT_CONFIG_LIST_MAX + 4]; /* and the adapters' names when LoRA goes to AdamW, the routers' */
    const char *wd_include[HT_CONFIG_LIST_MAX], *wd_exclude[HT_CONFIG_LIST_MAX];
    int64_t step;                          /* optimizer steps taken */
    char resumed_from[4096];               /* the checkpoint restored from another directory than output_dir, or "" */
    int grad_accum;                        /* micro-batches per step */
    int B, T;                              /* local micro-batch: B sequences of T tokens (data.seq_len) */
    int Tc;                                /* the tokens of each this rank holds: T / cp_size */
    int eval_B;                            /* validation windows a forward takes (B); 0: no evaluation */
    int32_t *batch;                        /* (B, T+1) */
    int32_t *micro_tokens;                 /* (micro-batches, B, T+1): a step's tokens, each kept for its chunks */
    int32_t *inputs, *targets;             /* (B, T) */
    int32_t *share_inputs, *share_targets; /* (B, Tc) this rank's tokens of them (context parallelism; else NULL) */
    FILE *metrics;                         /* output_dir/metrics.jsonl */
    struct ht_events *events;              /* training.tensorboard: rank 0's event file (train/events.h); else NULL */
    FILE *trace;                           /* training.trace: this rank's trace_rank{r}.json once a step is traced */
    FILE *samples;                         /* training.sample_interval: rank 0's output_dir/samples.jsonl */
    bool new_lineage;
    bool planning;
    /* ht_trainer_plan: nothing is allocated, nothing logged but refusals */ /* rank 0: output_dir's history is not
                                                                                this run's own (it starts from step
                                                                                0 or another's) */
    ht_tokenizer *sample_tokenizer; /* and data.tokenizer's, for their text (NULL: bytes) */
    double last_eval_loss;
    double rss_at_start; /* bytes resident when the trainer began: libraries, MPI, the config */
    double gemm_gflops;  /* the measured GEMM rate of the compute dtype's kernel (the MFU's peak); 0: unknown */
    /* Seconds spent in each phase of the steps since the run began. */
    double forward_backward_seconds, sync_seconds, optimizer_seconds;
    double all_to_all_seconds; /* expert parallelism: the part of forward + backward in the experts' all-to-all */
    /* Pipeline parallelism: of the steps' micro-batch schedules (pipeline_seconds), the time this stage spent
     * in its forwards and backwards (busy) and in the exchanges between stages; the rest waited (the bubble). */
    double pipeline_seconds, pipeline_busy_seconds, pipeline_exchange_seconds;
    double forward_seconds, checkpoint_seconds, eval_seconds; /* tools.profile's phases (forward is in the first) */
    /* A stop asked for from outside the loop (the CLI's signal handler sets
     * it non-zero; NULL: never). ht_trainer_run checks it between steps;
     * once any rank has it, every rank finishes the step, the run saves a
     * checkpoint (unless checkpoint.save_interval is 0) and returns HT_OK
     * with stopped_by set to the value. */
    volatile sig_atomic_t *stop_request;
    int stopped_by; /* the stop_request value that ended the run early; 0: it ran to training.steps */
} ht_trainer;

/* The schedule a leaf with base lr `base_lr` follows under config `c` (docs/NUMERICS.md,
 * learning-rate schedules): the derived counts resolved (W, D, S, lr_end2) as the trainer
 * runs them; hypertrain.lr_scheduler builds its schedules through it. */
void ht_train_lr_schedule(ht_lr_schedule *sc, const ht_config *c, double base_lr);

/* Validates the config, builds or loads the model, applies model_init_dtype,
 * opens the data, creates the FP32 main params and the optimizer. */
ht_status ht_trainer_init(ht_trainer *t, const ht_config *cfg, ht_error *err);
/* The same on the ranks of `comm`: each trains on its share of every global
 * batch, and the FP32 gradients are summed over the ranks before each step.
 * Every rank of comm calls it (and everything after it) together. */
ht_status ht_trainer_init_on(ht_trainer *t, const ht_config *cfg, ht_comm *comm, ht_error *err);
/* What ht_trainer_init_on decides before it allocates, for rank world->rank
 * of world->size (a virtual world: `hypertrain plan`): every refusal a launch
 * would give, the groups, the declared model, the data, the optimizer's
 * routing and t->memory_plan, never refused for the memory itself. Free it
 * with ht_trainer_free. */
ht_status ht_trainer_plan(ht_trainer *t, const ht_config *cfg, ht_comm *world, ht_error *err);
/* One optimizer step over grad_accum micro-batches. */
ht_status ht_trainer_step(ht_trainer *t, ht_step_stats *stats, ht_error *err);
/* Mean loss over the first training.eval_batches x B windows of the
 * validation split (all of them if it holds fewer): the same windows, in
 * the same forwards, whatever the rank count. */
ht_status ht_trainer_evaluate(ht_trainer *t, double *loss, ht_error *err);
/* The whole run: steps with progress, evaluation, metrics, final weights and the loss plot. */
ht_status ht_trainer_run(ht_trainer *t, ht_error *err);
void ht_trainer_free(ht_trainer *t);

/* Checkpoints (ckpt.h). The trainer as a checkpoint sees it: rank 0 of 1. */
void ht_trainer_checkpoint_view(ht_trainer *t, ht_ckpt_view *view);
/* Saves output_dir/step_X (checkpoint.save_optimizer, keep_last); ht_trainer_run
 * calls it every checkpoint.save_interval steps and at the end. */
ht_status ht_trainer_save_checkpoint(ht_trainer *t, ht_error *err);
/* Loads restore_from ("latest" or a directory); with restore_optimizer also
 * the optimizer, the step, the loader positions and the loss scaler.
 * ht_trainer_init calls it when checkpoint.restore_from is set. */
ht_status ht_trainer_restore(ht_trainer *t, const char *restore_from, bool restore_optimizer, ht_error *err);

/* The run directory (checkpoint.output_dir) is one run's own for its whole
 * life: `hypertrain train` takes its lock before anything else, and a
 * second run into the same directory is refused at once. Rank 0 of comm
 * takes an exclusive flock on output_dir/hypertrain.lock (making the
 * directory if need be) and writes its pid, host and start time into it;
 * every rank learns the outcome. Never in the root, nor in an existing
 * directory no run has used (no lock file, no checkpoint) that holds names a
 * run replaces (latest, loss.svg, final, metrics.jsonl), unless overwrite.
 * A directory another live run holds is
 * an error naming that run, on every rank alike (err->everywhere). The
 * kernel drops the lock when the process ends, however it ends. */
typedef struct ht_run_lock {
    int fd;           /* rank 0: the lock's descriptor; -1 elsewhere, or where the file system has no locks */
    bool created_dir; /* taking it made output_dir */
    char dir[HT_CONFIG_STR_MAX];
} ht_run_lock;
ht_status ht_run_lock_take(ht_run_lock *lock, const char *output_dir, bool overwrite, ht_comm *comm, ht_error *err);
/* remove_created: the run wrote nothing (it failed to start), so a
 * directory taking the lock made is removed with the lock file. */
void ht_run_lock_release(ht_run_lock *lock, bool remove_created);

/* A whole run of a loaded and validated config on the ranks of comm, as
 * `hypertrain train` and hypertrain.train() run it: the run lock taken
 * before anything in output_dir is read or written, training.plugin's
 * libraries loaded, the trainer built and run (stop_request as
 * ht_trainer's), the lock released (with the directory, where taking the
 * lock made it and the run failed before writing). *stopped_by: the
 * stop_request value that ended the run early, else 0. */
ht_status ht_train(const ht_config *cfg, ht_comm *comm, volatile sig_atomic_t *stop_request, int *stopped_by,
                   ht_error *err);

/* Draws the train and validation loss of a metrics.jsonl file as an SVG picture. */
ht_status ht_plot_metrics(const char *metrics_path, const char *svg_path, ht_error *err);

#ifdef __cplusplus
}
#endif
#endif
