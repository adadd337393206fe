/* The parallel strategies over the process group (comm.h): FSDP units
 * (a param's rows sharded over a group, gathered for compute, gradients
 * reduce-scattered into main_grad; docs/DESIGN.md, FSDP units and expert
 * parallelism) and expert parallelism's row exchange. */
#ifndef HYPERTRAIN_PARALLEL_H
#define HYPERTRAIN_PARALLEL_H

#include "hypertrain/base.h"
#include "hypertrain/comm.h"
#include "hypertrain/param.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ht_model ht_model;

/* How a model's params group into FSDP units. */
typedef struct ht_fsdp_options {
    /* Module patterns (parallel.fsdp_plan.apply_modules): each module they
     * match is a unit; "{*}" (or "*") stands for one dotted component, as in
     * "model.layers.{*}". The params no unit holds, and those read by modules
     * of two units (tied embeddings), form the root unit. */
    const char *const *apply_modules;
    int apply_count;
    /* A unit's gathered weights are dropped after its forward and gathered
     * again for its backward (false: kept until its backward). The root
     * unit keeps them from its first forward to the end of backward. */
    bool reshard_after_forward;
    /* The next module's units are gathered while the current one computes. */
    bool prefetch;
    /* Expert parallelism: the 3-D params under the modules expert_modules
     * match (parallel.ep_plan.apply_modules; none given: every
     * "model.layers.{*}.mlp.experts") form units of their own, one per
     * module, gathered and reduced over expert_group (the consecutive ranks
     * that hold the same experts, the first of them expert_first in the
     * group's numbering) instead of the whole group: a rank's gathered
     * tensors hold its group's experts only. NULL: no expert parallelism. */
    ht_comm *expert_group;
    int expert_first;
    const char *const *expert_modules;
    int expert_count;
    /* The precision gradients travel in (fsdp_config.mix_precision.
     * reduce_dtype): F32, or BF16 / F16, where each rank's FP32 gradient is
     * rounded to it before it is sent (half the bytes, as FSDP2's reduce_dtype)
     * and the receiving rank sums the contributions in FP32 in rank order,
     * into FP32 main_grad. FSDP2 sums in the 16-bit dtype and rounds the sum
     * to the gradient's dtype; this rounds each contribution once, nothing
     * else. */
    ht_dtype reduce_dtype;
} ht_fsdp_options;

/* What the collectives cost, summed since the last ht_fsdp_stats_reset. */
typedef struct ht_fsdp_stats {
    int64_t gathers, reduce_scatters;
    double gathered_bytes, reduced_bytes;
    double in_flight_seconds; /* the collectives' time from start to completion */
    double waited_seconds;    /* the part of it compute stood waiting: the rest was hidden */
    double pool_peak_bytes;   /* the largest memory of gathered weights and unit gradients held at once */
    double pool_bytes;        /* the buffers the pool holds for them (allocated, each reused): what is resident */
    ht_dtype reduce_dtype;    /* what the gradients travel in (reduced_bytes counts them so) */
} ht_fsdp_stats;

typedef struct ht_fsdp ht_fsdp;

/* Groups the model's params into units and hooks the model, so that each
 * unit's whole weights exist only around its modules' forward and backward
 * (one all-gather of every rank's compute_rows), and its whole FP32
 * gradient only from its backward until one reduce-scatter adds each rank's
 * rows into main_grad (FP32, in rank order, += across micro-batches). A
 * store that is not sharded (one rank, or shard_size 1) has nothing to
 * gather: the same hooks run and move nothing. */
ht_status ht_fsdp_create(ht_model *m, ht_comm *comm, const ht_fsdp_options *opt, ht_fsdp **out, ht_error *err);
/* The bytes the pool of ht_fsdp_create(m, comm, opt) comes to hold (pool_bytes) over a run, before any
 * storage: the units planned on the declared model, and the hooks run over them with each buffer counted, not
 * allocated, in the run's order: an evaluation's forwards (where `evaluates`), `micro` micro-batches' forward
 * then backward, HSDP's reduction of grad_floats floats over `replicas`, the update; the weights in the dtype
 * ht_params_set_compute(compute, precision) gives each. -1 (err set) on failure. */
double ht_fsdp_plan_bytes(ht_model *m, ht_comm *comm, const ht_fsdp_options *opt, ht_dtype compute, ht_dtype precision,
                          ht_comm *replicas, int64_t grad_floats, int micro, bool evaluates, ht_error *err);
/* One log line per unit kind and the plan in force. */
void ht_fsdp_log_plan(const ht_fsdp *f);
/* After the last micro-batch's backward: every reduce-scatter complete, every
 * rank's main_grad rows final. */
void ht_fsdp_finish_backward(ht_fsdp *f);
/* HSDP: block (n floats, each rank's main_grad rows) ← its sum over the
 * replicas `c`, in rank order, every replica getting the same bits. In
 * FP32, an all-reduce; with a 16-bit reduce_dtype each replica's block is
 * rounded to it before it is sent, as in the reduce-scatter, and the FP32
 * sums come back. Every rank of c calls it. */
void ht_fsdp_reduce_replicas(ht_fsdp *f, ht_comm *c, float *block, int64_t n);
/* After the weights changed (an update, a load): gathered copies are stale
 * and dropped; the compute_rows are refreshed from data. */
void ht_fsdp_weights_changed(ht_fsdp *f);
/* Whether the model's module `module` is an FSDP unit of its own (not the root). */
bool ht_fsdp_module_is_unit(const ht_fsdp *f, int module);
const ht_fsdp_stats *ht_fsdp_stats_get(const ht_fsdp *f);
void ht_fsdp_stats_reset(ht_fsdp *f);
void ht_fsdp_free(ht_fsdp *f);

/* Expert parallelism: the model's sparse layers exchange their rows over
 * `group` (the ranks that split the experts: group rank q computes experts
 * [q·E/size, (q + 1)·E/size)). The group must outlive the model's use of it. */
void ht_expert_parallel_attach(ht_model *m, ht_comm *group);

/* The mesh (docs/DESIGN.md, The mesh): world = PP x DP x CP x TP in Megatron's
 * order, tensor parallel innermost (consecutive ranks), pipeline stages
 * outermost (each stage laid out as a world of its own), then the CP =
 * ulysses x ring ranks of a context-parallel group (Ulysses innermost), then
 * data parallel. FSDP shards over DP x CP (groups of `shard` of those
 * ranks, 0: all of them; the rest replicate: HSDP), and the expert-parallel
 * groups are carved out of DP x CP: `ep` groups of DP·CP / ep consecutive
 * ones hold the same experts. */
typedef struct ht_mesh_sizes {
    int world, tp, ulysses, ring, ep, shard;
    int pp; /* pipeline stages: the outermost axis, world / pp consecutive ranks a stage (0 or 1: one) */
} ht_mesh_sizes;

/* One group of the mesh as ht_comm_split makes it: the ranks of the same
 * color, ordered by key; `size` of them. */
typedef struct ht_mesh_group {
    int color, key, size;
} ht_mesh_group;

typedef struct ht_mesh {
    int dp, cp, tp, ulysses, ring, ep, pp; /* this rank's coordinates (pp: its pipeline stage) */
    int dp_size, cp_size, pp_size;
    ht_mesh_group tp_group, cp_group, ulysses_group, ring_group;
    ht_mesh_group shard_group, replica_group; /* FSDP's, over DP x CP */
    ht_mesh_group expert_group;               /* the ranks holding the same experts (FSDP over them) */
    ht_mesh_group ep_group;                   /* the ranks splitting the experts (the tokens' all-to-all) */
    /* One replica's ranks over every tensor-parallel place (color: the
     * replica): together they hold the model once, each rank a box of its
     * own (the ranks that write a checkpoint, the first of them world ranks
     * 0 .. shard x TP - 1). */
    ht_mesh_group model_group;
    /* The ranks of the same place in every pipeline stage, in stage order:
     * activations go forward and gradients back between neighbours in it. */
    ht_mesh_group pp_group;
    /* The first and the last stage's ranks of this place (a tied embedding's
     * two holders); a rank of a middle stage alone. */
    ht_mesh_group tied_group;
} ht_mesh;

/* Rank `rank`'s place in a mesh of valid sizes (each divides what it must). */
void ht_mesh_of(const ht_mesh_sizes *sizes, int rank, ht_mesh *mesh);

/* The one owner of the mesh (src/parallel/dims.c): its sizes, this rank's
 * place, and every group the rank joins, split from `world` once. An axis
 * of size 1 has a group of one rank (ht_comm_single); expert and ep are
 * NULL without expert parallelism. What crosses more than one axis is
 * done here: the gradients' sums after backward, the attention logits'
 * maxima, the tokens a rank holds. */
typedef struct ht_parallel {
    ht_mesh_sizes sizes;
    ht_mesh mesh;
    ht_comm *world; /* the ranks training together, not owned */
    /* fsdp_config.shard_size S: shard groups of S ranks share the state
     * (shard), the ranks of the same place in each hold the same rows
     * (replica): HSDP. S = world: one shard group; S = 1: every rank holds
     * everything. */
    ht_comm *shard, *replica;
    /* Context parallelism: the CP = U x R consecutive ranks reading the same
     * sequences (cp), the U splitting the heads (ulysses) and the R the
     * key/value blocks go round (ring). */
    ht_comm *cp, *ulysses, *ring;
    /* Tensor parallelism: the T consecutive ranks of tp hold the same tokens
     * and each its slices of the weights; model joins one replica's ranks
     * over every place, each holding a box of its own: the model once (its
     * first replica writes checkpoints). */
    ht_comm *tp, *model;
    /* Expert parallelism P > 1: P groups of W / P consecutive ranks hold the
     * same experts (expert: FSDP's expert units gather and reduce over it);
     * ep joins the ranks of the same place in each, which split the experts
     * and exchange the tokens' rows. */
    ht_comm *expert, *ep;
    /* Pipeline parallelism: the ranks of this one's place in every stage,
     * in stage order (pp_rank: this rank's stage, of pp_size). */
    ht_comm *pp, *tied; /* tied: the first and last stages' ranks of this place (tied embeddings) */
    int dp_rank, dp_size, cp_size, tp_size, pp_rank, pp_size;
    bool sharded; /* S > 1: each rank holds its rows of every param and its state */
} ht_parallel;

/* Every group of `world` as `sizes` (valid, world its size) asks; of a
 * virtual world (ht_comm_virtual), virtual groups with the mesh's ranks and
 * sizes. */
ht_status ht_parallel_init(ht_parallel *par, const ht_mesh_sizes *sizes, ht_comm *world, ht_error *err);
/* One rank, every axis of size 1 (before ht_parallel_init, or instead of it). */
void ht_parallel_single(ht_parallel *par, ht_comm *world);
void ht_parallel_free(ht_parallel *par);
/* The sizes, every rank's coordinates (the first 64) and the groups, in the log. */
void ht_parallel_log(const ht_parallel *par);
/* After backward: every trainable param's main_grad becomes the global
 * batch's. FSDP's reduce-scatters over the shard group finished, the sum
 * over the replicas (HSDP), and with sequence parallelism the params the
 * tensor-parallel group holds whole (the norms, a router, routed experts:
 * each rank got its tokens' part) summed over it in rank order, as
 * Megatron's finalize_model_grads sums the norms'. */
void ht_parallel_finish_grads(const ht_parallel *par, ht_fsdp *fsdp, ht_param_store *params, bool sequence_parallel);
/* The attention logits' maxima (n, one a layer's head) over the ranks
 * holding the same heads: a tensor-parallel place's, its shard and replica
 * groups. */
void ht_parallel_max_logits(const ht_parallel *par, float *max_logit, int64_t n);
/* The B sequences of T tokens of `in` as this rank's model takes them: under
 * context parallelism its Tc tokens of each (ht_context_position of the
 * model's ht_context_parallel) into `out`; otherwise `in` itself. */
struct ht_context_parallel;
const int32_t *ht_parallel_token_share(const ht_parallel *par, const struct ht_context_parallel *cp, const int32_t *in,
                                       int B, int T, int Tc, int32_t *out);

/* Context parallelism: the model's attention exchanges over `ulysses` (the
 * ranks that split the heads, parallel.ulysses_parallel_size) and `ring`
 * (parallel.ring_attention_size), their ranks being this rank's place on
 * each axis (ht_context_parallel), and its sums over `group`, the whole
 * context-parallel group (ulysses x ring ranks). All of size 1: none. A
 * model whose builder cannot split its sequences is an error. The groups
 * must outlive the model's use of them. */
ht_status ht_context_parallel_attach(ht_model *m, ht_comm *group, ht_comm *ulysses, ht_comm *ring, ht_error *err);

/* Tensor parallelism: the model's collectives over `group`, the ranks of
 * its tensor-parallel group, which must be the size and this rank's place
 * the model was built for (ht_model_build_parallel); an error otherwise.
 * sequence: sequence parallelism too (ht_tensor_parallel.sequence). The
 * group must outlive the model's use of it. */
ht_status ht_tensor_parallel_attach(ht_model *m, ht_comm *group, bool sequence, ht_error *err);

/* Pipeline parallelism's schedule (src/parallel/pipeline.c): the order this
 * rank's stage runs a step's `micro` micro-batches in, over the
 * `comm->size` stages of the pipeline group, the slots it keeps their
 * activations in, and the messages to and from its neighbours. */
typedef enum ht_pipe_schedule { HT_PIPE_1F1B = 0, HT_PIPE_GPIPE } ht_pipe_schedule;
typedef struct ht_pipeline {
    ht_comm *comm;                    /* the pipeline group: rank = stage */
    int stages, stage, chunks, micro; /* P ranks of V chunks (virtual stages) each, m micro-batches a step */
    /* (2 V m): this rank's operations in order, each ((i·V + c) << 1 | backward): micro-batch i's forward or
     * backward through chunk c */
    int *order;
    int *slot_of;   /* (V, m): the slot each micro-batch takes in each chunk */
    int slots;      /* micro-batches' activations this rank keeps at once, every chunk's (its model's m->slots) */
    int64_t floats; /* the largest boundary tensor (B·T x hidden) a slot holds */
    /* (slots, floats) each, kernel memory: the activations received, the
     * gradients received, and the input gradients being sent */
    float *in, *grad, *out;
    ht_request **sends; /* (slots, 2): each slot's forward output and input gradient in flight */
    ht_request *posted; /* the next operation's receive, started while the one before computes */
    int posted_op;
    /* The model's values that travel beside the hidden states (ht_model's
     * stage_sums), `sums` doubles a message (0: none), each its own message
     * after the tensor's with the same tag; host memory: (slots) received
     * forward, (slots) received backward, (slots, 2) being sent, and their
     * requests as sends' and posted's. */
    int sums;
    double *sums_in, *sums_grad, *sums_out;
    ht_request **sum_sends, *posted_sums;
} ht_pipeline;
/* The schedule (nothing the size of a tensor is allocated: a plan makes it too). */
ht_status ht_pipeline_init(ht_pipeline *p, ht_pipe_schedule schedule, ht_comm *comm, int chunks, int micro,
                           int64_t floats, int sums, ht_error *err);
/* The bytes of the slots' buffers, and their allocation (one stage: none). */
size_t ht_pipeline_buffer_bytes(const ht_pipeline *p);
ht_status ht_pipeline_allocate(ht_pipeline *p, ht_error *err);
void ht_pipeline_free(ht_pipeline *p);
/* The slot micro-batch `micro` takes in chunk `chunk`. */
int ht_pipeline_slot(const ht_pipeline *p, int micro, int chunk);
/* A slot's received input hidden states and output gradient (NULL: one stage). */
float *ht_pipeline_input(const ht_pipeline *p, int slot);
float *ht_pipeline_grad(const ht_pipeline *p, int slot);
/* The sums received with them (NULL: one stage, or none to pass). */
const double *ht_pipeline_input_sums(const ht_pipeline *p, int slot);
const double *ht_pipeline_grad_sums(const ht_pipeline *p, int slot);
/* Before micro-batch `micro`'s forward (grad false) or backward (true):
 * its input from the previous stage, or its output's gradient from the
 * next, `floats` of them into its slot's buffer (none on the first or the
 * last stage). */
void ht_pipeline_receive(ht_pipeline *p, int micro, int chunk, bool grad, int64_t floats);
/* Starts that receive ahead (the next operation's, before the current one
 * computes), for ht_pipeline_receive to wait for: its transfer overlaps the
 * computation. Its slot's buffer is free by then: an input is read only by
 * its own forward, a gradient only by its own backward. */
void ht_pipeline_post(ht_pipeline *p, int micro, int chunk, bool grad, int64_t floats);
/* After it: its output to the next stage, or its input's gradient to the
 * previous, started (`sent` may change once it returns where it is the
 * model's input gradient: that one goes from a copy), and `sums` with it
 * (copied; NULL where the pipeline passes none). */
void ht_pipeline_send(ht_pipeline *p, int micro, int chunk, bool grad, const float *sent, int64_t floats,
                      const double *sums);
/* Waits for every send started. */
void ht_pipeline_finish(ht_pipeline *p);

#ifdef __cplusplus
}
#endif
#endif
