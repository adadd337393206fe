/* The trainer loop: model, data and optimizer from one config; micro-batches
 * with gradient accumulation into FP32 main_grad; the chained Muon + AdamW step
 * on the FP32 main params (clipping, loss scaling, QK-clip, the cast back);
 * progress, metrics, evaluation, checkpoints, the final weights and the plot. */
#include "hypertrain/train.h"

#include <math.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "hypertrain/ckpt.h"
#include "hypertrain/dist.h"
#include "hypertrain/kernels.h"
#include "hypertrain/optimizer.h"
#include "train/rundir.h"

_Static_assert(HT_CONFIG_NS_MAX_REPEAT == HT_NS_MAX_STEPS, "the config's bound on a segment is the longest schedule");

/* ------------------------------------------------------------------ setup */

/* This process's resident bytes now, and at most so far. */
static double rss_now(void) {
    long pages = 0, resident = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (f) {
        if (fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
        fclose(f);
    }
    return (double)resident * (double)sysconf(_SC_PAGESIZE);
}

static double rss_peak(void) {
    struct rusage u;
    return getrusage(RUSAGE_SELF, &u) == 0 ? (double)u.ru_maxrss * 1024.0 : 0.0;
}

static int64_t local_numel(const ht_param_store *ps) {
    int64_t n = 0;
    for (int i = 0; i < ps->count; i++) n += ht_param_local_numel(&ps->items[i]);
    return n;
}

/* model.lora: the adapters alone train; every other param is frozen as
 * model.freeze freezes (on top of what it froze already). */
static ht_status freeze_for_lora(ht_trainer *t, ht_error *err) {
    ht_param_store *ps = &t->model->params;
    const ht_lora_config *lc = &t->model->config.lora;
    int frozen, adapters = 0, modules = 0;
    int64_t values = 0;
    for (int i = 0; i < ps->count; i++) {
        const ht_param *p = &ps->items[i];
        if (!ht_lora_kind(p->name)) continue;
        adapters++;
        modules += ht_lora_kind(p->name) == 'A';
        values += ht_param_numel(p);
    }
    if (adapters == 0) /* a plugin's builder that does not read ht_model_config.lora */
        return ht_fail(err, HT_ERR_CONFIG,
                       "model.lora.rank %d: model '%s' declared no adapters (its builder does not implement "
                       "model.lora)",
                       lc->rank, t->model->config.name);
    ht_status s = ht_lora_freeze_base(ps, &frozen, err);
    if (s != HT_OK) return s;
    char targets[HT_CONFIG_LIST_MAX * 64];
    ht_config_format_value(&t->config, "model.lora.target_modules", targets, sizeof(targets));
    ht_log_info("model.lora: rank %d, alpha %g (scale %g%s), dropout %g, target_modules %s: %d adapters on %d "
                "linear layers (%.3fM values, %.2f%% of the model) train; the other %d parameters are frozen (no "
                "gradient, main param or optimizer state)",
                lc->rank, lc->alpha, ht_lora_scale(lc), lc->use_rslora ? ", rsLoRA: alpha / sqrt(r)" : "", lc->dropout,
                targets, adapters, modules, (double)values / 1e6,
                100.0 * (double)values / (double)ht_params_total_numel(ps), frozen);
    return HT_OK;
}

/* model.freeze: the covered params keep their weights and lose their
 * gradient, FP32 main param and optimizer state (nothing of them is computed
 * or reduced in backward). */
static ht_status freeze_params(ht_trainer *t, ht_error *err) {
    const ht_config_strings *fz = &t->config.model.freeze;
    if (fz->count == 0) return t->model->config.lora.rank > 0 ? freeze_for_lora(t, err) : HT_OK;
    const char *patterns[HT_CONFIG_LIST_MAX];
    for (int i = 0; i < fz->count; i++) patterns[i] = fz->items[i];
    ht_param_store *ps = &t->model->params;
    int frozen;
    ht_status s = ht_params_freeze(ps, patterns, fz->count, &frozen, err);
    if (s != HT_OK) return s;
    int64_t values = 0;
    char names[1024] = "";
    size_t len = 0;
    for (int i = 0; i < ps->count; i++) {
        const ht_param *p = &ps->items[i];
        if (p->trainable) continue;
        values += ht_param_numel(p);
        if (len < sizeof(names) - 1)
            len += (size_t)snprintf(names + len, sizeof(names) - len, "%s%s", len ? ", " : "", p->name);
    }
    if (len >= sizeof(names) - 1) strcpy(names + sizeof(names) - 5, "...");
    ht_log_info("%s: %d parameters frozen (%.2fM of %.2fM values: no gradient, main param or optimizer state): %s",
                ht_config_key_spelling(&t->config, "model.freeze"), frozen, (double)values / 1e6,
                (double)ht_params_total_numel(ps) / 1e6, names);
    return t->model->config.lora.rank > 0 ? freeze_for_lora(t, err) : HT_OK;
}

/* model.lora -> the model's ht_lora_config (the architecture may come from a config.json). */
static void lora_config(const ht_config_lora *c, ht_lora_config *lc) {
    memset(lc, 0, sizeof(*lc));
    lc->rank = c->rank;
    lc->alpha = c->alpha;
    lc->dropout = c->dropout;
    lc->use_rslora = c->use_rslora;
    lc->target_count = c->target_modules.count;
    for (int i = 0; i < c->target_modules.count; i++)
        snprintf(lc->targets[i], sizeof(lc->targets[i]), "%s", c->target_modules.items[i]);
}

/* model.recompute (MindSpeed-MM): the modules of recompute_plan.apply_modules
 * (every decoder layer when it is empty) keep only their input in forward
 * and recompute the rest in backward: activations traded for one more
 * forward of them, the gradients unchanged bit for bit. */
static ht_status plan_recompute(ht_trainer *t, ht_error *err) {
    const ht_config *c = &t->config;
    if (!c->model.recompute) return HT_OK;
    const char *patterns[HT_CONFIG_LIST_MAX] = {"model.layers.{*}"};
    int n = c->model.recompute_modules.count ? c->model.recompute_modules.count : 1;
    for (int i = 0; i < c->model.recompute_modules.count; i++) patterns[i] = c->model.recompute_modules.items[i];
    ht_status s = ht_model_set_recompute(t->model, patterns, n, err);
    if (s != HT_OK) return s;
    int chosen = 0;
    for (int k = 0; k < t->model->module_count; k++) chosen += t->model->recompute[k];
    ht_log_info("%s: %d of %d decoder layers keep only their input in forward and recompute their activations in "
                "backward (one more forward of each)",
                ht_config_key_spelling(c, "model.recompute"), chosen, t->model->config.num_hidden_layers);
    return HT_OK;
}

/* model.from_pretrained: the folder's config.json is the architecture in
 * force, and so this run's config (its log, its checkpoints) says. */
static ht_status use_pretrained(ht_trainer *t, ht_error *err) {
    if (!t->config.model.from_pretrained[0]) return HT_OK;
    ht_model_config arch;
    ht_status s = ht_hf_read_config(t->config.model.from_pretrained, &arch, err);
    if (s == HT_OK) ht_config_use_pretrained(&t->config, &arch);
    return s;
}

static ht_status build_model(ht_trainer *t, ht_error *err) {
    const ht_config *c = &t->config;
    ht_model_config arch = c->model.arch; /* with model.from_pretrained, its config.json's (use_pretrained) */
    ht_status s;
    lora_config(&c->model.lora, &arch.lora);
    /* fsdp_config.shard_size: every rank holds only its rows of every
     * parameter (and so of its FP32 main param, main_grad and optimizer
     * state). training.init_model_with_meta_device: it builds, initialises
     * and loads only those rows; otherwise it builds the whole model first. */
    int rank = t->shard_comm->rank, world = t->shard_comm->size;
    bool meta = c->training.init_model_with_meta_device;
    s = ht_model_build_shard(&arch, HT_DTYPE_F32, (uint64_t)c->training.seed, meta ? rank : 0, meta ? world : 1,
                             &t->model, err);
    if (s != HT_OK) return s;
    if (c->model.from_pretrained[0]) {
        s = ht_hf_load_weights(c->model.from_pretrained, &t->model->params, err);
        if (s != HT_OK) return s;
        ht_log_info("loaded weights from %s%s", c->model.from_pretrained,
                    t->sharded && meta ? " (this rank's rows)" : "");
    }
    if (c->model.lora.from_pretrained[0]) {
        s = ht_peft_load_adapter(c->model.lora.from_pretrained, &arch.lora, &t->model->params, err);
        if (s != HT_OK) return s;
    }
    if (!meta) {
        s = ht_params_shard(&t->model->params, rank, world, err);
        if (s != HT_OK) return s;
    }
    /* model_init_dtype converts every float parameter after the weights exist. */
    if (c->model_init_dtype != HT_CONFIG_DTYPE_NONE) {
        s = ht_params_convert(&t->model->params, c->model_init_dtype, err);
        if (s != HT_OK) return s;
    }
    s = freeze_params(t, err);
    if (s == HT_OK) s = plan_recompute(t, err);
    if (s != HT_OK) return s;
    t->model->output_dtype = c->fsdp.output_dtype;
    t->model->keep_logits = false; /* the loss is all a run reads of them */
    t->model->head_chunk_bytes = (int64_t)c->kernels.lm_head_chunk_mib << 20;
    const ht_model_config *a = &t->model->config;
    ht_log_info("Model config: %s, vocab %d, hidden %d, intermediate %d, %d layers, %d heads (%d KV, dim %d), "
                "max positions %d, rope theta %g, rms eps %g, attention bias %s, tied embeddings %s",
                a->name, a->vocab_size, a->hidden_size, a->intermediate_size, a->num_hidden_layers,
                a->num_attention_heads, a->num_key_value_heads, ht_model_config_head_dim(a), a->max_position_embeddings,
                a->rope_theta, a->rms_norm_eps, a->attention_bias ? "yes" : "no",
                a->tie_word_embeddings ? "yes" : "no");
    if (t->sharded)
        ht_log_info("Data parallel over %d ranks, %s (fsdp_config.shard_size %d: %d shard group(s) x %d replica(s)): "
                    "each rank holds its rows of every parameter, %smain_grad and optimizer state "
                    "(%.2fM of %.2fM values on this rank); each FSDP unit gathers its whole weights around its "
                    "modules and sums its FP32 gradients into each rank's rows%s",
                    t->comm->size, t->replica_comm->size > 1 ? "hybrid sharded (HSDP)" : "fully sharded",
                    t->shard_comm->size, t->comm->size / t->shard_comm->size, t->replica_comm->size,
                    c->optimizer.fp32_main_params ? "FP32 main param, " : "",
                    (double)local_numel(&t->model->params) / 1e6,
                    (double)ht_params_total_numel(&t->model->params) / 1e6,
                    t->replica_comm->size > 1 ? ", then over the replicas" : "");
    else if (t->comm->size > 1)
        ht_log_info("Data parallel over %d ranks, replicated (fsdp_config.shard_size 1): every rank holds the whole "
                    "model and optimizer state; the FP32 gradients are summed over the ranks before each step",
                    t->comm->size);
    return HT_OK;
}

/* kernels.bf16_gemm / f16_gemm: pinned, or measured on this machine on the
 * model's own linear-layer product. A resumed run keeps the kernels it was
 * checkpointed with where they were measured: the kernels sum in different
 * orders, and resume is bitwise (docs/NUMERICS.md). */
static ht_status choose_kernels(ht_trainer *t, ht_error *err) {
    const ht_config *c = &t->config;
    ht_gemm_kernel bf16 = c->kernels.bf16_gemm, f16 = c->kernels.f16_gemm;
    const char *kept = "";
    if (c->checkpoint.restore_from[0] && c->checkpoint.restore_optimizer &&
        (bf16 == HT_GEMM_KERNEL_AUTO || f16 == HT_GEMM_KERNEL_AUTO)) {
        char dir[HT_CKPT_PATH_MAX];
        ht_checkpoint *ck;
        ht_status s = ht_ckpt_resolve(c->checkpoint.restore_from, c->checkpoint.output_dir, dir, sizeof(dir), err);
        if (s == HT_OK && dir[0]) {
            s = ht_ckpt_open(dir, &ck, err);
            if (s != HT_OK) return s;
            const ht_ckpt_trainer_state *st = ht_ckpt_state(ck);
            if (bf16 == HT_GEMM_KERNEL_AUTO) bf16 = st->gemm_bf16;
            if (f16 == HT_GEMM_KERNEL_AUTO) f16 = st->gemm_f16;
            if (st->gemm_bf16 != HT_GEMM_KERNEL_AUTO) kept = "; kept from the checkpoint";
            ht_ckpt_close(ck);
        }
        if (s != HT_OK) return s;
    }
    /* training.deterministic: the one choice made by timing is made by rule,
     * so that two runs of one config on one machine sum alike everywhere:
     * fp32_rounded, which every CPU has. Everything else (thread counts from
     * the cores, fixed-order reductions, seeded streams) is fixed already. */
    if (c->training.deterministic && (bf16 == HT_GEMM_KERNEL_AUTO || f16 == HT_GEMM_KERNEL_AUTO)) {
        if (bf16 == HT_GEMM_KERNEL_AUTO) bf16 = HT_GEMM_KERNEL_FP32_ROUNDED;
        if (f16 == HT_GEMM_KERNEL_AUTO) f16 = HT_GEMM_KERNEL_FP32_ROUNDED;
        kept = "; training.deterministic: 16-bit kernels fixed to fp32_rounded, not chosen by timing";
    }
    /* Rank 0 measures alone (ranks timing at once on shared cores would
     * measure each other) and its choice goes to every rank, so that the
     * ranks sum alike; each rank then checks that it has those kernels. A
     * kept native kernel this CPU lacks is measured afresh, not refused. */
    ht_gemm_choice choice;
    int64_t M = (int64_t)c->training.local_batch_size * c->data.seq_len, C = t->model->config.hidden_size;
    ht_status s = HT_OK;
    if (t->comm->rank == 0) {
        s = ht_gemm_choose(bf16, f16, M, C, C, &choice, err);
        if (s != HT_OK && kept[0]) {
            kept = "";
            s = ht_gemm_choose(c->kernels.bf16_gemm, c->kernels.f16_gemm, M, C, C, &choice, err);
        }
    }
    int64_t status = s;
    ht_broadcast(t->comm, &status, (int64_t)sizeof(status), 0);
    if (status != HT_OK)
        return t->comm->rank == 0 ? s
                                  : ht_fail(err, (ht_status)status,
                                            "rank 0 could not choose the GEMM kernels (its "
                                            "error says why)");
    ht_broadcast(t->comm, &choice, (int64_t)sizeof(choice), 0);
    if (t->comm->rank != 0) {
        ht_gemm_choice here;
        s = ht_gemm_choose(choice.bf16, choice.f16, M, C, C, &here, err); /* pinned: checked, not timed */
        if (s != HT_OK) return s;
    }
    ht_gemm_use(&choice);
    char line[512];
    ht_gemm_describe(&choice, line, sizeof(line));
    ht_log_info("%s%s", line, kept);
    /* The MFU's peak: the rate of the kernel the compute dtype runs on, on
     * this product; pinned kernels were not timed, so rank 0 times them now. */
    ht_dtype pd = c->fsdp.param_dtype;
    ht_gemm_kernel k = pd == HT_DTYPE_BF16 ? choice.bf16 : choice.f16;
    double rate = 0.0;
    if (t->comm->rank == 0) {
        ht_gemm_choice timed = choice;
        ht_error ignored;
        bool have = pd == HT_DTYPE_F32 ? choice.f32_rate > 0
                                       : (pd == HT_DTYPE_BF16 ? choice.bf16_rate : choice.f16_rate)[k] > 0;
        if (have || ht_gemm_choose(HT_GEMM_KERNEL_AUTO, HT_GEMM_KERNEL_AUTO, M, C, C, &timed, &ignored) == HT_OK)
            rate = pd == HT_DTYPE_F32 ? timed.f32_rate : (pd == HT_DTYPE_BF16 ? timed.bf16_rate : timed.f16_rate)[k];
    }
    ht_broadcast(t->comm, &rate, (int64_t)sizeof(rate), 0);
    t->gemm_gflops = rate;
    return HT_OK;
}

/* parallel.expert_parallel_size P > 1 on W ranks: the model must have
 * experts, P ranks must split them evenly, and each rank's FSDP rows of an
 * expert param must be whole experts of its group's share (E a multiple of W). */
static ht_status check_experts(const ht_trainer *t, ht_error *err) {
    const ht_model_config *a = &t->model->config;
    const int P = t->ep_comm->size, W = t->comm->size, E = a->moe.num_experts;
    if (E <= 0)
        return ht_fail(err, HT_ERR_CONFIG,
                       "parallel.expert_parallel_size is %d, but the model (%s) has no experts (model.num_experts %d)",
                       P, a->name, E);
    if (E % P != 0)
        return ht_fail(err, HT_ERR_CONFIG,
                       "model.num_experts (%d) is not a multiple of parallel.expert_parallel_size (%d): the %d ranks "
                       "of an expert-parallel group must hold the same number of experts",
                       E, P, P);
    if (E % W != 0)
        return ht_fail(err, HT_ERR_CONFIG,
                       "model.num_experts (%d) is not a multiple of the %d ranks: with expert parallelism each rank "
                       "shards whole experts of its group's %d (FSDP over the %d ranks holding them); use a world "
                       "size that divides %d",
                       E, W, E / P, W / P, E);
    return HT_OK;
}

/* fsdp_config.mix_precision: the precision forward and backward compute in, and the logits'. */
static ht_status set_compute(ht_trainer *t, ht_error *err) {
    const ht_config *c = &t->config;
    ht_status s = choose_kernels(t, err);
    if (s != HT_OK) return s;
    s = ht_model_set_compute(t->model, c->fsdp.param_dtype, err);
    if (s != HT_OK) return s;
    /* The FSDP units (fsdp_config.apply_modules / parallel.fsdp_plan.apply_modules). */
    const char *apply[HT_CONFIG_LIST_MAX];
    for (int i = 0; i < c->fsdp.apply_modules.count; i++) apply[i] = c->fsdp.apply_modules.items[i];
    /* reduce_dtype null (HyperParallel's dialect leaves it so): FSDP2's rule, the reduction in param_dtype. */
    ht_fsdp_options fo = {.apply_modules = apply,
                          .apply_count = c->fsdp.apply_modules.count,
                          .reshard_after_forward = c->fsdp.reshard_after_forward,
                          .prefetch = c->fsdp.prefetch,
                          .reduce_dtype = c->fsdp.reduce_dtype == HT_CONFIG_DTYPE_NONE ? c->fsdp.param_dtype
                                                                                       : c->fsdp.reduce_dtype};
    const char *ep_modules[HT_CONFIG_LIST_MAX];
    if (t->ep_comm) {
        s = check_experts(t, err);
        if (s != HT_OK) return s;
        for (int i = 0; i < c->parallel.ep_modules.count; i++) ep_modules[i] = c->parallel.ep_modules.items[i];
        fo.expert_group = t->expert_comm;
        fo.expert_first = t->comm->rank / t->expert_comm->size * t->expert_comm->size;
        fo.expert_modules = ep_modules;
        fo.expert_count = c->parallel.ep_modules.count;
    }
    s = ht_fsdp_create(t->model, t->shard_comm, &fo, &t->fsdp, err);
    if (s != HT_OK) return s;
    ht_fsdp_log_plan(t->fsdp);
    /* cast_forward_inputs: FSDP2 casts a unit's floating-point forward inputs to param_dtype; here those are
     * the FP32 hidden states entering a module that is a unit of its own (module 0, the embedding, takes
     * token ids). */
    int cast = 0;
    for (int k = 1; t->model->input_dtype && k < t->model->module_count; k++) {
        bool on =
            c->fsdp.cast_forward_inputs && c->fsdp.param_dtype != HT_DTYPE_F32 && ht_fsdp_module_is_unit(t->fsdp, k);
        t->model->input_dtype[k] = on ? c->fsdp.param_dtype : HT_DTYPE_F32;
        cast += on;
    }
    if (cast)
        ht_log_info("fsdp_config.mix_precision.cast_forward_inputs: the FP32 hidden states entering %d FSDP "
                    "unit(s) rounded to %s, as FSDP2 casts a unit's floating-point inputs to param_dtype",
                    cast, ht_dtype_name(c->fsdp.param_dtype));
    if (t->ep_comm) {
        ht_expert_parallel_attach(t->model, t->ep_comm);
        const ht_moe_config *mc = &t->model->config.moe;
        if (t->comm->rank == 0)
            ht_log_info("Expert parallelism: groups of %d ranks split the %d experts of each sparse layer (%d per "
                        "rank), the tokens' rows exchanged all-to-all; the ranks holding the same experts (%d "
                        "consecutive ones) shard them and reduce their gradients",
                        t->ep_comm->size, mc->num_experts, mc->num_experts / t->ep_comm->size, t->expert_comm->size);
    }
    const ht_param *p = &t->model->params.items[0];
    ht_log_info("Model: %.2fM parameters stored in %s, computing in %s%s; GEMM: %s",
                (double)ht_params_total_numel(&t->model->params) / 1e6, ht_dtype_name(p->dtype),
                ht_dtype_name(c->fsdp.param_dtype),
                p->compute_dtype != p->compute_precision ? " (FP32 operands of that precision)" : "",
                ht_gemm_kernel_name(p->compute_precision));
    return HT_OK;
}

/* A micro-batch's activations and the model's weights against this
 * machine's memory, before the first forward, or choose_kernels' timing on
 * as many rows, allocates them. A lower bound (operands in param_dtype's
 * size, no optimizer state yet): a run refused here could not run. */
static ht_status check_memory(const ht_trainer *t, ht_error *err) {
    const ht_config *c = &t->config;
    const ht_param_store *ps = &t->model->params;
    const double acts = ht_model_activation_bytes(t->model, t->B, t->T, c->fsdp.param_dtype);
    const double model = (double)(ps->data_bytes + ps->grad_bytes), have = (double)ht_physical_memory();
    if (acts + model <= have) return HT_OK;
    char took[64];
    if (isinf(acts))
        snprintf(took, sizeof(took), "more bytes than 64 bits count");
    else
        snprintf(took, sizeof(took), "%.1f GiB", acts / (1 << 30));
    return ht_fail(err, HT_ERR_CONFIG,
                   "training.local_batch_size %d x data.seq_len %d: the activations of one micro-batch take %s (%d "
                   "layers of model.hidden_size %d, intermediate_size %d), the model %.2f GiB, more than this "
                   "machine's %.1f GiB of memory: lower training.local_batch_size (more accumulation steps keep "
                   "training.global_batch_size) or data.seq_len, or set model.recompute",
                   t->B, t->T, took, t->model->config.num_hidden_layers, t->model->config.hidden_size,
                   t->model->config.intermediate_size, model / (1 << 30), have / (1 << 30));
}

static ht_status open_data(ht_trainer *t, ht_error *err) {
    const ht_config *c = &t->config;
    ht_data_config dc = {0};
    snprintf(dc.dataset_type, sizeof(dc.dataset_type), "%s", c->data.dataset_type);
    snprintf(dc.path, sizeof(dc.path), "%s", c->data.path);
    dc.seq_len = c->data.seq_len;
    dc.valid_fraction = c->data.valid_fraction;
    if (dc.seq_len > t->model->config.max_position_embeddings)
        return ht_fail(err, HT_ERR_CONFIG, "data.seq_len (%d) is longer than model.max_position_embeddings (%d)",
                       dc.seq_len, t->model->config.max_position_embeddings);
    ht_status s = ht_dataset_open(&dc, &t->data, err);
    if (s != HT_OK) return s;
    char vocab_from[sizeof(c->model.from_pretrained) + 64] = "model.vocab_size";
    if (c->model.from_pretrained[0])
        snprintf(vocab_from, sizeof(vocab_from), "the vocab_size of %s/config.json", c->model.from_pretrained);
    s = ht_dataset_check_vocab(t->data, t->model->config.vocab_size, vocab_from, err);
    if (s != HT_OK) return s;
    if (c->data.tokenizer[0]) {
        /* The tokenizer the shards were made with (MindSpeed-MM's preprocess_parameters.model_name_or_path):
         * it must fit the model, and every shard must have been made with a vocabulary like it. */
        char file[HT_CONFIG_STR_MAX + 32], from[HT_CONFIG_STR_MAX + 64];
        int vocab;
        s = ht_tokenizer_vocab_size(c->data.tokenizer, &vocab, file, sizeof(file), err);
        if (s != HT_OK) return s;
        if (vocab > t->model->config.vocab_size)
            return ht_fail(err, HT_ERR_CONFIG, "%s has %d tokens, more than %s (%d): it is not this model's tokenizer",
                           file, vocab, vocab_from, t->model->config.vocab_size);
        snprintf(from, sizeof(from), "the vocabulary of %s", file);
        s = ht_dataset_check_vocab(t->data, vocab, from, err);
        if (s != HT_OK) return s;
        ht_log_info("data: %s, %d tokens, fits the model and every shard", file, vocab);
    }
    t->B = c->training.local_batch_size;
    t->T = c->data.seq_len;
    /* Every rank takes its own local batches of each global batch (the loader's rank split). */
    int world = t->comm->size, rank = t->comm->rank;
    size_t train_tokens = ht_dataset_split_tokens(t->data, HT_SPLIT_TRAIN);
    size_t windows = train_tokens > 0 ? (train_tokens - 1) / (size_t)t->T : 0, wanted = (size_t)world * (size_t)t->B;
    if (windows < wanted)
        return ht_fail(err, HT_ERR_CONFIG,
                       "training.local_batch_size %d on %d data-parallel rank%s takes %zu sequences of data.seq_len + "
                       "1 = %d tokens a micro-batch, but the train split of data.path %s has %zu tokens: %zu such "
                       "windows",
                       t->B, world, world == 1 ? "" : "s", wanted, t->T + 1, c->data.path, train_tokens, windows);
    s = check_memory(t, err);
    if (s != HT_OK) return s;
    /* MindSpeed-MM's gradient_accumulation_steps, when given, is the count
     * (its global batch is micro x accumulation x data parallel); else the global batch says it. */
    t->grad_accum = c->training.gradient_accumulation_steps > 0
                        ? c->training.gradient_accumulation_steps
                        : c->training.global_batch_size / (c->training.local_batch_size * world);
    uint64_t seed = (uint64_t)c->training.seed;
    s = ht_loader_init(&t->train_loader, t->data, HT_SPLIT_TRAIN, t->B, t->T, rank, world, seed, c->data.shuffle, err);
    if (s != HT_OK) return s;
    if (ht_dataset_split_tokens(t->data, HT_SPLIT_VALID) > 0 && c->training.eval_batches > 0) {
        /* Every rank reads the validation windows one by one, wherever they
         * are: ht_trainer_evaluate deals them out itself, the same ones
         * whatever the rank count. */
        ht_error probe;
        if (ht_loader_init(&t->valid_loader, t->data, HT_SPLIT_VALID, 1, t->T, 0, 1, seed, false, &probe) == HT_OK)
            t->eval_B = t->B;
        else
            ht_log_warn_once("the validation split is too small for one sequence: no evaluation");
    }
    ht_log_info("Data: %s at %s: %zu train tokens, %zu validation tokens, vocab %d; %d x %d tokens per micro-batch, "
                "%d micro-batches per step",
                c->data.dataset_type, c->data.path, ht_dataset_split_tokens(t->data, HT_SPLIT_TRAIN),
                ht_dataset_split_tokens(t->data, HT_SPLIT_VALID), ht_dataset_vocab_size(t->data), t->B, t->T,
                t->grad_accum);
    size_t n = (size_t)t->B * (size_t)t->T;
    t->batch = ht_alloc((n + (size_t)t->B) * sizeof(int32_t));
    t->inputs = ht_alloc(n * sizeof(int32_t));
    t->targets = ht_alloc(n * sizeof(int32_t));
    if (!t->batch || !t->inputs || !t->targets) return ht_fail(err, HT_ERR_OOM, "cannot allocate batch buffers");
    return HT_OK;
}

_Static_assert((int)HT_CONFIG_LR_CONSTANT_WARMUP == (int)HT_LR_CONSTANT_WARMUP &&
                   (int)HT_CONFIG_LR_COSINE_ANNEALING == (int)HT_LR_COSINE_ANNEALING &&
                   (int)HT_CONFIG_LR_WARMUP_STABLE_DECAY == (int)HT_LR_WSD &&
                   (int)HT_CONFIG_LR_CONSTANT_COOLDOWN == (int)HT_LR_CONSTANT_COOLDOWN &&
                   (int)HT_CONFIG_LR_COSINE_WARM_RESTARTS == (int)HT_LR_COSINE_WARM_RESTARTS &&
                   (int)HT_CONFIG_LR_WISE_LAYER == (int)HT_LR_WISE_LAYER,
               "the config's and the optimizer's schedule enums must follow docs/NUMERICS.md's order");

static void fill_schedule(ht_lr_schedule *sc, const ht_config *c, double base_lr) {
    memset(sc, 0, sizeof(*sc));
    sc->type = (ht_lr_type)c->lr_scheduler.type; /* both enums follow docs/NUMERICS.md's order */
    sc->base_lr = base_lr;
    sc->warmup_lr_init = c->lr_scheduler.warmup_lr_init;
    sc->lr_end = c->lr_scheduler.lr_end;
    sc->total_steps = c->training.steps;
    sc->warmup_steps = ht_config_warmup_steps(c);
    sc->num_cycles = c->lr_scheduler.num_cycles;
    sc->decay_steps = ht_config_decay_steps(c);
    sc->power = c->lr_scheduler.power;
    sc->decay_start = ht_config_decay_start_steps(c);
    sc->eta_min = c->lr_scheduler.eta_min;
    sc->t_max = c->lr_scheduler.t_max;
    sc->keep_steps = c->lr_scheduler.keep_steps;
    sc->final_steps = c->lr_scheduler.final_steps;
    sc->lr_end1 = c->lr_scheduler.lr_end1;
    sc->lr_end2 = ht_config_lr_end2(c);
    sc->t_0 = c->lr_scheduler.t_0;
    sc->t_mult = c->lr_scheduler.t_mult;
    /* LearningRateWiseLayer is refused by ht_config_validate (no schedule to wrap); lr_scale stays 0. */
}

/* The strings of a config list as the const char * array the optimizer takes. */
static int string_list(const ht_config_strings *list, const char **out) {
    for (int i = 0; i < list->count; i++) out[i] = list->items[i];
    return list->count;
}

/* optimizer.muon_config -> the Muon leaf's config, with its Newton-Schulz schedule expanded. */
static ht_status muon_config(const ht_config *c, ht_muon_config *mc, ht_error *err) {
    static const ht_ns_variant variants[] = {
        [HT_CONFIG_NS_LEGACY] = HT_NS_LEGACY,
        [HT_CONFIG_NS_ASYM5] = HT_NS_ASYM5,
        [HT_CONFIG_NS_POLAR_EXPRESS] = HT_NS_POLAR_EXPRESS,
        [HT_CONFIG_NS_DEEPSEEK_V4] = HT_NS_DEEPSEEK_V4,
        [HT_CONFIG_NS_CUSTOM] = HT_NS_CUSTOM,
    };
    const ht_config_ns_coefficients *nc = &c->optimizer.muon.ns_coefficients;
    ht_ns_segment segments[HT_CONFIG_NS_MAX];
    for (int i = 0; i < nc->count; i++) {
        memcpy(segments[i].abc, nc->abc[i], sizeof(segments[i].abc));
        segments[i].repeat = nc->repeat[i];
    }
    *mc = (ht_muon_config){
        .lr = c->optimizer.muon.lr,
        .weight_decay = c->optimizer.muon.weight_decay,
        .momentum = c->optimizer.muon.momentum,
        .nesterov = c->optimizer.muon.nesterov,
        .momentum_style =
            c->optimizer.muon.momentum_style == HT_CONFIG_MOMENTUM_EMA ? HT_MUON_MOMENTUM_EMA : HT_MUON_MOMENTUM_SUM,
        .ns_eps = c->optimizer.muon.ns_eps,
        .matched_adamw_rms = c->optimizer.muon.matched_adamw_rms,
        .ns_dtype = c->optimizer.muon.ns_dtype,
        .comm_strategy = c->optimizer.muon.comm_strategy == HT_CONFIG_MUON_COMM_DEREDUNDANCY ? HT_MUON_COMM_DEREDUNDANCY
                                                                                             : HT_MUON_COMM_ALLGATHER,
    };
    return ht_ns_schedule_expand(variants[c->optimizer.muon.ns_variant], c->optimizer.muon.ns_steps, segments,
                                 nc->count, &mc->schedule, err);
}

/* QK-clip sees each layer's q/k projections (found by their Hugging Face names) and its head layout. */
static ht_status build_qk_table(ht_trainer *t, ht_error *err) {
    const ht_model_config *a = &t->model->config;
    t->qk_layers = calloc((size_t)a->num_hidden_layers, sizeof(ht_qk_layer));
    if (!t->qk_layers) return ht_fail(err, HT_ERR_OOM, "cannot allocate the QK-clip table");
    for (int l = 0; l < a->num_hidden_layers; l++) {
        char name[HT_PARAM_NAME_MAX];
        ht_param_store *ps = &t->model->params;
#define FIND(field, suffix)                                                                                            \
    snprintf(name, sizeof(name), "model.layers.%d.self_attn.%s", l, suffix);                                           \
    t->qk_layers[l].field = ht_params_find(ps, name)
        FIND(q_weight, "q_proj.weight");
        FIND(q_bias, "q_proj.bias");
        FIND(k_weight, "k_proj.weight");
        FIND(k_bias, "k_proj.bias");
#undef FIND
        if (!t->qk_layers[l].q_weight || !t->qk_layers[l].k_weight)
            return ht_fail(err, HT_ERR_CONFIG,
                           "optimizer.muon_config.qk_clip_enabled: layer %d has no self_attn.q_proj/k_proj "
                           "weights to clip",
                           l);
        /* QK-clip rescales the weights' FP32 main params: frozen ones have none and must not change. */
        if (!t->qk_layers[l].q_weight->trainable || !t->qk_layers[l].k_weight->trainable)
            return ht_fail(err, HT_ERR_CONFIG,
                           "optimizer.muon_config.qk_clip_enabled: layer %d's self_attn.q_proj/k_proj weights are "
                           "frozen (%s), and QK-clip rescales them: set qk_clip_enabled false",
                           l, t->config.model.lora.rank > 0 ? "model.lora trains the adapters alone" : "model.freeze");
        t->qk_layers[l].num_heads = a->num_attention_heads;
        t->qk_layers[l].num_kv_heads = a->num_key_value_heads;
        t->qk_layers[l].head_dim = ht_model_config_head_dim(a);
    }
    return HT_OK;
}

/* A routing or weight-decay pattern that matches no parameter is named: a
 * module name spelled for another model goes nowhere otherwise. */
static void warn_unmatched(const ht_trainer *t, const char *key, const ht_config_strings *patterns) {
    const ht_param_store *ps = &t->model->params;
    int line;
    /* hypertrain's own defaults cover other models' names too ("*ln_*"): only what a run chose is checked. */
    if (ht_config_key_source(&t->config, key, &line) == HT_CONFIG_SOURCE_DEFAULT &&
        !t->config.dialect_default[ht_config_key_index(key)])
        return;
    for (int k = 0; k < patterns->count; k++) {
        bool hit = false;
        for (int i = 0; i < ps->count && !hit; i++) hit = ht_name_match(patterns->items[k], ps->items[i].name);
        if (!hit)
            ht_log_warn("%s: \"%s\" matches no parameter (names look like %s, or in MindFormers' spelling "
                        "decoder.layers.0.self_attention.linear_qkv.weight)",
                        ht_config_key_spelling(&t->config, key), patterns->items[k],
                        ps->count > 1 ? ps->items[1].name
                        : ps->count   ? ps->items[0].name
                                      : "?");
    }
}

static ht_status build_optimizer(ht_trainer *t, ht_error *err) {
    const ht_config *c = &t->config;
    ht_optimizer_config oc = {0};
    oc.use_muon = c->optimizer.type == HT_CONFIG_OPTIMIZER_MUON;
    oc.comm = t->shard_comm; /* the norm and Muon's matrices span a shard group; replicas hold the same rows */
    oc.replicas = t->sharded ? t->replica_comm : NULL;
    oc.fp32_main_params = c->optimizer.fp32_main_params;
    oc.adamw = (ht_adamw_config){
        .lr = c->optimizer.adamw.lr,
        .beta1 = c->optimizer.adamw.betas[0],
        .beta2 = c->optimizer.adamw.betas[1],
        .eps = c->optimizer.adamw.eps,
        .weight_decay = c->optimizer.adamw.weight_decay,
    };
    oc.no_weight_decay = t->no_wd;
    oc.no_weight_decay_count = string_list(&c->optimizer.adamw.no_weight_decay, t->no_wd);
    oc.adamw_include = t->adamw_include;
    oc.adamw_include_count = string_list(&c->optimizer.muon.adamw_include, t->adamw_include);
    /* model.lora: the adapters go to AdamW, as PEFT trains them (Muon would
     * orthogonalize each rank-r matrix), unless model.lora.use_muon. */
    if (oc.use_muon && c->model.lora.rank > 0) {
        if (c->model.lora.use_muon) {
            ht_log_info("model.lora.use_muon: the adapters' matrices go to Muon (optimizer.muon_config.adamw_include "
                        "still applies)");
        } else {
            t->adamw_include[oc.adamw_include_count++] = "*.lora_A.weight";
            t->adamw_include[oc.adamw_include_count++] = "*.lora_B.weight";
            ht_log_info("model.lora: the adapters go to AdamW (as PEFT trains them; model.lora.use_muon true sends "
                        "them to Muon)");
        }
    }
    /* qwen2_moe: the routers (E x C) and the shared experts' gates (1 x C)
     * are classifiers, not hidden transforms: AdamW, as the other systems
     * train them. The 3-D experts go to Muon (each expert's matrix on its
     * own) unless optimizer.muon_config.adamw_include matches them. */
    if (oc.use_muon && t->model->config.moe.num_experts > 0) {
        t->adamw_include[oc.adamw_include_count++] = "*.mlp.gate.weight";
        t->adamw_include[oc.adamw_include_count++] = "*.mlp.shared_expert_gate.weight";
        if (t->comm->rank == 0)
            ht_log_info("qwen2_moe: the routers (*.mlp.gate.weight) and shared expert gates go to AdamW; the experts' "
                        "3-D weights to Muon, one matrix per expert, unless optimizer.muon_config.adamw_include "
                        "matches them");
    }
    oc.weight_decay_include = t->wd_include;
    oc.weight_decay_include_count = string_list(&c->optimizer.adamw.weight_decay_include, t->wd_include);
    oc.weight_decay_exclude = t->wd_exclude;
    oc.weight_decay_exclude_count = string_list(&c->optimizer.adamw.weight_decay_exclude, t->wd_exclude);
    if (t->comm->rank == 0) { /* the same config and names on every rank: said once */
        warn_unmatched(t, "optimizer.adamw_config.no_weight_decay", &c->optimizer.adamw.no_weight_decay);
        warn_unmatched(t, "optimizer.adamw_config.weight_decay_include", &c->optimizer.adamw.weight_decay_include);
        warn_unmatched(t, "optimizer.adamw_config.weight_decay_exclude", &c->optimizer.adamw.weight_decay_exclude);
        if (oc.use_muon) warn_unmatched(t, "optimizer.muon_config.adamw_include", &c->optimizer.muon.adamw_include);
    }
    if (ht_config_key_source(c, "optimizer.use_fused_adamw", NULL) != HT_CONFIG_SOURCE_DEFAULT)
        ht_log_info("optimizer.use_fused_adamw: %s: AdamW always runs as one fused pass here (equal bit for bit "
                    "to torch's fused AdamW)",
                    c->optimizer.use_fused_adamw ? "true" : "false");
    ht_status s = muon_config(c, &oc.muon, err);
    if (s != HT_OK) return s;
    fill_schedule(&oc.adamw_schedule, c, oc.adamw.lr);
    fill_schedule(&oc.muon_schedule, c, oc.muon.lr);
    oc.max_norm = c->training.max_norm;
    /* float16 models train with a dynamic loss scale (docs/NUMERICS.md). */
    oc.loss_scaling = t->model->params.items[0].dtype == HT_DTYPE_F16;
    ht_loss_scaler_init(&oc.scaler, c->training.loss_scale_initial, c->training.loss_scale_growth_factor,
                        c->training.loss_scale_backoff_factor, c->training.loss_scale_growth_interval,
                        c->training.loss_scale_hysteresis, c->training.loss_scale_min);
    oc.stochastic_rounding = c->optimizer.stochastic_rounding;
    oc.seed = (uint64_t)c->training.seed;
    if (oc.use_muon) ht_config_log_section(c, "muon", "optimizer.muon_config.");
    ht_config_log_section(c, "adamw", "optimizer.adamw_config.");
    s = ht_optimizer_init(&t->optimizer, &t->model->params, &oc, err);
    if (s != HT_OK) return s;
    ht_log_info("LR schedule %s, %lld warmup steps of %d; Muon from %g, AdamW from %g",
                ht_lr_type_name(oc.adamw_schedule.type), (long long)oc.adamw_schedule.warmup_steps, c->training.steps,
                oc.muon.lr, oc.adamw.lr);
    t->model->track_attn_max = c->optimizer.muon.qk_clip_enabled;
    return c->optimizer.muon.qk_clip_enabled ? build_qk_table(t, err) : HT_OK;
}

/* Every rank must run the same configuration: rank 0's is compared with
 * each rank's own, key by key, and the first key that differs is named. */
static ht_status check_same_config(ht_trainer *t, ht_error *err) {
    if (t->comm->size == 1) return HT_OK;
    ht_config *root = malloc(sizeof(ht_config));
    if (!root) return ht_fail(err, HT_ERR_OOM, "cannot allocate a config");
    *root = t->config;
    ht_broadcast(t->comm, root, (int64_t)sizeof(*root), 0);
    char mine[4096], theirs[4096];
    double differs = 0;
    const char *key = NULL;
    for (int i = 0; i < ht_config_key_count() && !key; i++) {
        ht_config_format_value(&t->config, ht_config_key_name(i), mine, sizeof(mine));
        ht_config_format_value(root, ht_config_key_name(i), theirs, sizeof(theirs));
        if (strcmp(mine, theirs) != 0) key = ht_config_key_name(i);
    }
    differs = key ? 1.0 + t->comm->rank : 0.0;
    ht_all_reduce_f64(t->comm, &differs, 1, HT_REDUCE_MAX); /* every rank learns it, and fails together */
    ht_status s = HT_OK;
    if (key)
        s = ht_fail(err, HT_ERR_CONFIG, "rank %d runs another configuration than rank 0: %s is %s here, %s on rank 0",
                    t->comm->rank, key, mine, theirs);
    else if (differs)
        s = ht_fail(err, HT_ERR_CONFIG,
                    "rank %d (and maybe others) runs another configuration than rank 0 (its error names the key)",
                    (int)differs - 1);
    free(root);
    return s;
}

ht_status ht_trainer_init(ht_trainer *t, const ht_config *cfg, ht_error *err) {
    return ht_trainer_init_on(t, cfg, ht_comm_single(), err);
}

/* fsdp_config.shard_size S (auto: the world) splits the world W into W / S
 * shard groups of S consecutive ranks and S replicate groups (HSDP). */
static ht_status make_groups(ht_trainer *t, ht_error *err) {
    int W = t->comm->size, S = t->config.fsdp.shard_size == 0 ? W : t->config.fsdp.shard_size;
    ht_status s = ht_comm_split(t->comm, t->comm->rank / S, t->comm->rank % S, &t->shard_comm, err);
    if (s == HT_OK) s = ht_comm_split(t->comm, t->comm->rank % S, t->comm->rank / S, &t->replica_comm, err);
    t->sharded = S > 1;
    /* Expert parallelism (validated: P divides W, no HSDP). */
    const int P = t->config.parallel.expert_parallel_size, D = W / (P > 0 ? P : 1), r = t->comm->rank;
    if (s == HT_OK && P > 1) s = ht_comm_split(t->comm, r / D, r % D, &t->expert_comm, err);
    if (s == HT_OK && P > 1) s = ht_comm_split(t->comm, r % D, r / D, &t->ep_comm, err);
    return s;
}

/* Keys a seed system has that change nothing here, by the nature of a CPU
 * engine or of their own rule: each one the run sets is named with why. */
static void log_not_applicable(const ht_config *c) {
    const struct {
        const char *key;
        bool applies; /* false: the key has nothing to act on in this run */
        const char *why;
    } keys[] = {
        {"data.num_workers", false, "batches are read in place from the memory-mapped tokens"},
        {"data.pin_memory", false, "there is no device memory to copy to"},
        {"model.trust_remote_code", false, "no model code is loaded from a model folder"},
        {"parallel.ep_plan.apply_modules", c->parallel.expert_parallel_size > 1,
         "it applies with parallel.expert_parallel_size > 1 (1 here)"},
        {"model.recompute_plan.apply_modules", c->model.recompute, "it applies with model.recompute true"},
    };
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
        int line;
        if (keys[i].applies || ht_config_key_source(c, keys[i].key, &line) == HT_CONFIG_SOURCE_DEFAULT) continue;
        ht_log_info("%s: accepted, not applicable here: %s", ht_config_key_spelling(c, keys[i].key), keys[i].why);
    }
}

ht_status ht_trainer_init_on(ht_trainer *t, const ht_config *cfg, ht_comm *comm, ht_error *err) {
    memset(t, 0, sizeof(*t));
    t->config = *cfg;
    t->comm = comm;
    t->shard_comm = t->replica_comm = ht_comm_single();
    t->last_eval_loss = NAN;
    t->rss_at_start = rss_now();
    /* Every rank validates the same config before any collective: all fail, or none. */
    ht_status s = ht_config_validate(cfg, comm->size, err);
    if (s == HT_OK) s = use_pretrained(t, err);
    if (s == HT_OK && comm->rank == 0) {
        ht_config_log(&t->config); /* the values in force: model.from_pretrained's architecture included */
        log_not_applicable(cfg);
    }
    if (s == HT_OK) ht_comm_set_timeout(comm, cfg->training.distributed_timeout_minutes * 60.0);
    if (s == HT_OK) s = check_same_config(t, err);
    if (s == HT_OK) s = make_groups(t, err);
    if (s == HT_OK) s = build_model(t, err);
    /* The batch against the data and the machine's memory before anything is sized by it. */
    if (s == HT_OK) s = open_data(t, err);
    /* fsdp_config.mix_precision.param_dtype: the dtype forward and backward compute with. */
    if (s == HT_OK) s = set_compute(t, err);
    if (s == HT_OK) s = build_optimizer(t, err);
    if (s == HT_OK && cfg->checkpoint.restore_from[0])
        s = ht_trainer_restore(t, cfg->checkpoint.restore_from, cfg->checkpoint.restore_optimizer, err);
    if (s == HT_OK)
        s = ht_run_dir_check(cfg->checkpoint.output_dir, t->step, cfg->training.steps, cfg->training.dump_state, comm,
                             err);
    if (s != HT_OK) ht_trainer_free(t);
    return s;
}

void ht_trainer_free(ht_trainer *t) {
    if (t->metrics) fclose(t->metrics);
    ht_optimizer_free(&t->optimizer);
    ht_fsdp_free(t->fsdp);
    free(t->qk_layers);
    ht_loader_free(&t->train_loader);
    ht_loader_free(&t->valid_loader);
    ht_dataset_free(t->data);
    ht_model_free(t->model);
    ht_free(t->batch);
    ht_free(t->inputs);
    ht_free(t->targets);
    if (t->ep_comm) ht_comm_free(t->ep_comm);
    if (t->expert_comm) ht_comm_free(t->expert_comm);
    if (t->replica_comm) ht_comm_free(t->replica_comm);
    if (t->shard_comm) ht_comm_free(t->shard_comm);
    ht_comm *comm = t->comm;
    memset(t, 0, sizeof(*t));
    t->comm = comm;
}

/* ------------------------------------------------------------------ steps */

#define HT_MAX_DUMPED 4096 /* params */
/* training.dump_state: one step's tensors, kept until written (the writer borrows them). */
typedef struct state_dump {
    ht_st_writer w;
    void *bufs[2 * HT_MAX_DUMPED];
    int count;
} state_dump;

static void dump_free(state_dump *d) {
    if (!d) return;
    ht_st_writer_free(&d->w);
    for (int i = 0; i < d->count; i++) ht_free(d->bufs[i]);
    free(d);
}

/* Every param's whole main_grad ("main_grad.") or model values ("param."),
 * gathered from the shard group's rows, added to the dump on rank 0. Every
 * rank takes part. */
static ht_status dump_tensors(ht_trainer *t, state_dump *d, const char *prefix, ht_error *err) {
    const bool grads = prefix[0] == 'm';
    ht_param_store *ps = &t->model->params;
    for (int i = 0; i < ps->count; i++) {
        ht_param *p = &ps->items[i];
        if (grads && !p->main_grad) continue; /* frozen */
        const size_t elem = grads ? sizeof(float) : ht_dtype_size(p->dtype);
        void *whole = ht_alloc((size_t)ht_param_numel(p) * elem + 64);
        if (!whole || d->count == 2 * HT_MAX_DUMPED) {
            ht_free(whole);
            return ht_fail(err, HT_ERR_OOM, "training.dump_state: cannot hold %s", p->name);
        }
        d->bufs[d->count++] = whole;
        ht_fsdp_gather_rows(p, t->shard_comm, grads ? (void *)p->main_grad : p->data, whole, elem);
        char name[HT_PARAM_NAME_MAX + 16];
        snprintf(name, sizeof(name), "%s%s", prefix, p->name);
        ht_dtype dt = grads ? HT_DTYPE_F32 : p->dtype;
        ht_status s = t->comm->rank == 0 ? ht_st_writer_add(&d->w, name, dt, p->ndim, p->shape, whole, dt, err) : HT_OK;
        if (s != HT_OK) return s;
    }
    return HT_OK;
}

static ht_status write_dump(ht_trainer *t, state_dump *d, ht_error *err) {
    if (t->comm->rank != 0) return HT_OK;
    char dir[HT_CONFIG_STR_MAX + 16], path[HT_CONFIG_STR_MAX + 64];
    snprintf(dir, sizeof(dir), "%s/state", t->config.checkpoint.output_dir);
    ht_status s = ht_make_dirs(dir, err);
    snprintf(path, sizeof(path), "%s/step_%08lld.safetensors", dir, (long long)t->step);
    return s == HT_OK ? ht_st_writer_write(&d->w, path, err) : s;
}

ht_status ht_trainer_step(ht_trainer *t, ht_step_stats *stats, ht_error *err) {
    double t0 = ht_time_seconds();
    ht_model *m = t->model;
    /* The loss scale multiplies the gradients; 1/(accumulation × ranks)
     * averages the global batch's micro-batches, once, before the sum over ranks. */
    float grad_scale = (float)(ht_optimizer_loss_scale(&t->optimizer) * t->config.training.gradient_scaling_factor /
                               ((double)t->grad_accum * t->comm->size));
    ht_model_reset_attn_max(m);
    double loss_sum = 0.0;
    /* model.lora.dropout: this step's masks, drawn from (seed, step) and each
     * sequence's place in the global batch: a resumed run, and any split of
     * the batch over ranks and micro-batches, drop the same elements. The
     * constant keeps the stream apart from the others derived from the seed;
     * the low bit keeps it nonzero (0 means no dropout). */
    uint64_t dropout = ht_fnv1a64(&t->step, sizeof(t->step), (uint64_t)t->config.training.seed ^ 0x6c6f7261ULL) | 1;
    const double exchanged = m->experts.seconds;
    for (int micro = 0; micro < t->grad_accum; micro++) {
        ht_loader_next(&t->train_loader, t->batch);
        ht_batch_split(t->batch, t->B, t->T, t->inputs, t->targets);
        m->dropout_seed = dropout;
        m->dropout_first_sequence = ((int64_t)micro * t->comm->size + t->comm->rank) * t->B;
        float loss;
        double f0 = ht_time_seconds();
        ht_status s = ht_model_forward(m, t->inputs, t->targets, t->B, t->T, &loss, err);
        if (s != HT_OK) return s;
        t->forward_seconds += ht_time_seconds() - f0;
        ht_model_backward(m, grad_scale);
        loss_sum += loss;
    }
    m->dropout_seed = 0;                /* forwards outside a training step (evaluation) drop nothing */
    ht_status gs = ht_gemm_status(err); /* before any rank sums this rank's gradients */
    if (gs != HT_OK) return gs;
    double t1 = ht_time_seconds();
    /* Data parallel: every rank's FP32 gradients summed over the shard
     * group into each rank's rows (each unit's reduce-scatter, started in
     * backward), then over the replicas. */
    ht_fsdp_finish_backward(t->fsdp);
    ht_fsdp_reduce_replicas(t->fsdp, t->replica_comm, m->params.grad_block,
                            (int64_t)(m->params.grad_bytes / sizeof(float)));
    ht_all_reduce_f64(t->comm, &loss_sum, 1, HT_REDUCE_SUM);
    if (t->qk_layers)
        ht_all_reduce_f32(t->comm, m->attn_max_logit,
                          (int64_t)m->config.num_hidden_layers * m->config.num_attention_heads, HT_REDUCE_MAX);
    double t2 = ht_time_seconds();
    ht_step_result r;
    state_dump *dump = t->config.training.dump_state ? calloc(1, sizeof(state_dump)) : NULL;
    ht_status s = HT_OK;
    if (t->config.training.dump_state)
        s = dump ? dump_tensors(t, dump, "main_grad.", err)
                 : ht_fail(err, HT_ERR_OOM, "training.dump_state: out of memory");
    if (s == HT_OK) s = ht_optimizer_step(&t->optimizer, &r, err);
    if (s == HT_OK) s = ht_gemm_status(err); /* Newton-Schulz */
    if (s != HT_OK) {
        dump_free(dump);
        return s;
    }
    int clipped = 0;
    if (t->qk_layers && !r.skipped) {
        const ht_model_config *a = &m->config;
        for (int l = 0; l < a->num_hidden_layers; l++)
            clipped += ht_qk_clip(&t->qk_layers[l], m->attn_max_logit + (size_t)l * a->num_attention_heads,
                                  t->config.optimizer.muon.qk_clip_threshold);
    }
    ht_fsdp_weights_changed(t->fsdp);
    t->step++;
    if (t->config.training.dump_state) {
        s = dump_tensors(t, dump, "param.", err);
        if (s == HT_OK) s = write_dump(t, dump, err);
        dump_free(dump);
        if (s != HT_OK) return s;
    }
    double t3 = ht_time_seconds(), dt = t3 - t0;
    t->forward_backward_seconds += t1 - t0;
    t->all_to_all_seconds += m->experts.seconds - exchanged;
    t->sync_seconds += t2 - t1;
    t->optimizer_seconds += t3 - t2;
    if (stats) {
        stats->step = t->step;
        stats->loss = loss_sum / ((double)t->grad_accum * t->comm->size);
        stats->lr = r.adamw_lr;
        stats->muon_lr = r.muon_lr;
        stats->grad_norm = r.grad_norm;
        stats->loss_scale = r.loss_scale;
        stats->skipped = r.skipped;
        stats->qk_clipped_heads = clipped;
        stats->seconds = dt;
        stats->tokens_per_s = (double)t->grad_accum * t->comm->size * t->B * t->T / dt;
        if (t->gemm_gflops > 0)
            stats->mfu = stats->tokens_per_s / t->comm->size * ht_model_flops_per_token(&m->config, t->T) /
                         (t->gemm_gflops * 1e9);
    }
    return HT_OK;
}

ht_status ht_trainer_evaluate(ht_trainer *t, double *loss, ht_error *err) {
    *loss = NAN;
    if (t->eval_B == 0) return HT_OK;
    /* The first eval_batches x B windows of the validation split (all of
     * them if it holds fewer), in groups of B consecutive windows; rank
     * g mod world forwards group g. A forward then sees the same sequences
     * on any rank count, so its loss (and a load-balancing term, which is the
     * forward's) is the same computation: only the double sum's order
     * depends on the rank count. */
    const uint64_t B = (uint64_t)t->eval_B, world = (uint64_t)t->comm->size, rank = (uint64_t)t->comm->rank;
    uint64_t n = (uint64_t)t->config.training.eval_batches * B;
    if (n > t->valid_loader.n_windows) n = t->valid_loader.n_windows;
    const uint64_t groups = (n + B - 1) / B, rounds = (groups + world - 1) / world;
    double sum = 0.0;
    for (uint64_t r = 0; r < rounds; r++) {
        /* A rank with no group left in the last round forwards the first
         * one and drops its loss: FSDP's gathers and the experts' exchanges
         * need every rank's forward. */
        const uint64_t g = r * world + rank, first = g < groups ? g * B : 0;
        const int count = (int)(n - first < B ? n - first : B);
        ht_loader_resume(&t->valid_loader, (ht_loader_pos){.epoch = 0, .index = first}, NULL);
        for (int b = 0; b < count; b++) ht_loader_next(&t->valid_loader, t->batch + (size_t)b * (size_t)(t->T + 1));
        ht_batch_split(t->batch, count, t->T, t->inputs, t->targets);
        float l;
        ht_status s = ht_model_forward(t->model, t->inputs, t->targets, count, t->T, &l, err);
        if (s == HT_OK) s = ht_gemm_status(err);
        if (s != HT_OK) return s;
        if (g < groups) sum += (double)l * count; /* every window has T targets: the mean over its tokens */
    }
    ht_all_reduce_f64(t->comm, &sum, 1, HT_REDUCE_SUM);
    if (n) *loss = sum / (double)n;
    return HT_OK;
}

/* ------------------------------------------------------------------ the run */

static void format_duration(char *buf, size_t n, double seconds) {
    if (!(seconds >= 0) || seconds > 1e7) {
        snprintf(buf, n, "?");
        return;
    }
    int s = (int)(seconds + 0.5);
    if (s >= 3600)
        snprintf(buf, n, "%dh%02dm", s / 3600, s % 3600 / 60);
    else if (s >= 60)
        snprintf(buf, n, "%dm%02ds", s / 60, s % 60);
    else
        snprintf(buf, n, "%ds", s);
}

/* path opened for writing ("w" or "a") without following a symlink: the
 * run writes into its own directory only. */
static FILE *open_own_file(const char *path, const char *mode) {
    int flags = O_WRONLY | O_CREAT | O_NOFOLLOW | O_CLOEXEC | (mode[0] == 'a' ? O_APPEND : O_TRUNC);
    int fd = open(path, flags, 0644);
    FILE *f = fd >= 0 ? fdopen(fd, mode) : NULL;
    if (!f && fd >= 0) close(fd);
    return f;
}

/* A metrics file no checkpoint stands behind (a run stopped before its
 * first save) is history, not a run to protect: it is kept aside as
 * metrics.jsonl.<time> and this run starts from step 0. */
static ht_status set_aside(const char *path, ht_error *err) {
    char aside[HT_CONFIG_STR_MAX + 96], when[32];
    time_t now = time(NULL);
    struct tm tm;
    strftime(when, sizeof(when), "%Y%m%d-%H%M%S", localtime_r(&now, &tm));
    struct stat sb;
    snprintf(aside, sizeof(aside), "%s.%s", path, when);
    for (int k = 2; lstat(aside, &sb) == 0 && k < 1000; k++) snprintf(aside, sizeof(aside), "%s.%s-%d", path, when, k);
    if (rename(path, aside) != 0)
        return ht_fail(err, HT_ERR_IO, "%s: cannot keep it aside as %s: %s", path, aside, strerror(errno));
    ht_log_info("%s holds the metrics of a run that saved no checkpoint: kept as %s; this run starts from step 0", path,
                aside);
    return HT_OK;
}

/* A fresh run starts metrics.jsonl anew; a resumed one keeps the lines up to
 * the restored step (a crashed run may have written past its last checkpoint)
 * and appends. The kept lines go to metrics.jsonl.tmp, fsynced, then renamed
 * over the old file: a kill at any moment leaves the whole old history or the
 * whole kept one, never an empty or cut file. */
static ht_status open_metrics(ht_trainer *t, ht_error *err) {
    char path[HT_CONFIG_STR_MAX + 32], tmp[HT_CONFIG_STR_MAX + 40];
    ht_status s = ht_make_dirs(t->config.checkpoint.output_dir, err);
    if (s != HT_OK) return s;
    snprintf(path, sizeof(path), "%s/metrics.jsonl", t->config.checkpoint.output_dir);
    /* A run that starts from step 0 where another run left checkpoints
     * would replace them: only with checkpoint.overwrite. */
    char newest[64] = "";
    struct stat sb;
    bool has_metrics = stat(path, &sb) == 0 && sb.st_size > 0;
    bool new_lineage = t->step == 0 || t->resumed_from[0]; /* this run did not write what output_dir holds */
    bool has_checkpoint = new_lineage && ht_ckpt_newest(t->config.checkpoint.output_dir, newest, sizeof(newest));
    if (new_lineage && has_metrics && !has_checkpoint && t->step == 0 && !t->config.checkpoint.overwrite) {
        s = set_aside(path, err);
        if (s != HT_OK) return s;
        has_metrics = false;
    }
    if (new_lineage && (has_checkpoint || has_metrics)) {
        char what[160], how[HT_CKPT_PATH_MAX + 64];
        snprintf(what, sizeof(what), "%s%s%s", newest, newest[0] && has_metrics ? " and " : "",
                 has_metrics ? "metrics.jsonl" : "");
        if (t->step == 0)
            snprintf(how, sizeof(how), "this one starts from step 0");
        else
            snprintf(how, sizeof(how), "this one continues %s, a checkpoint of another directory", t->resumed_from);
        if (!t->config.checkpoint.overwrite)
            return ht_fail(err, HT_ERR_CONFIG,
                           "checkpoint.output_dir %s holds another run (%s) and %s: %s, choose another output_dir, or "
                           "set checkpoint.overwrite: true to replace it",
                           t->config.checkpoint.output_dir, what, how,
                           strcmp(t->config.checkpoint.restore_from, "latest") == 0
                               ? "resume one of its own checkpoints (checkpoint.restore_from)"
                               : "resume it (checkpoint.restore_from: latest)");
        ht_log_warn("checkpoint.overwrite: this run replaces the one in %s (%s)", t->config.checkpoint.output_dir,
                    what);
    }
    char *old = NULL;
    size_t len = 0;
    if (new_lineage || ht_read_file(path, &old, &len, NULL) != HT_OK) {
        t->metrics = open_own_file(path, "w");
        if (!t->metrics) return ht_fail(err, HT_ERR_IO, "%s: cannot open for writing: %s", path, strerror(errno));
        return HT_OK;
    }
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    FILE *f = open_own_file(tmp, "w");
    if (!f) {
        free(old);
        return ht_fail(err, HT_ERR_IO, "%s: cannot open for writing: %s", tmp, strerror(errno));
    }
    /* Every line is kept or dropped for a reason: past the restored step, or
     * the last line cut by a kill mid-write. Any other line that is not JSON
     * stops the resume rather than vanish. */
    int number = 0;
    for (char *line = old; line && *line;) {
        char *end = strchr(line, '\n');
        size_t n = end ? (size_t)(end - line) : strlen(line);
        ht_json *obj;
        number++;
        if (n > 0 && ht_json_parse(line, n, path, &obj, NULL) == HT_OK) {
            const ht_json *step = ht_json_get(obj, "step");
            if (step && step->type == HT_JSON_NUMBER && step->number <= (double)t->step)
                fprintf(f, "%.*s\n", (int)n, line);
            ht_json_free(obj);
        } else if (!end) {
            ht_log_warn("%s: line %d was cut short (a kill while it was written): dropped", path, number);
        } else if (n > 0) {
            fclose(f);
            remove(tmp);
            free(old);
            return ht_fail(err, HT_ERR_FORMAT,
                           "%s: line %d is not a JSON object: fix or move the file before resuming (it is never "
                           "rewritten without its lines)",
                           path, number);
        }
        line = end ? end + 1 : NULL;
    }
    free(old);
    bool ok = fflush(f) == 0 && fsync(fileno(f)) == 0;
    ok = fclose(f) == 0 && ok;
    if (!ok || rename(tmp, path) != 0) {
        remove(tmp);
        return ht_fail(err, HT_ERR_IO, "%s: cannot write the kept metrics: %s", tmp, strerror(errno));
    }
    t->metrics = open_own_file(path, "a");
    if (!t->metrics) return ht_fail(err, HT_ERR_IO, "%s: cannot open for appending", path);
    return HT_OK;
}

/* ", \"key\": value" in `fmt`; JSON has no NaN or Inf, so a non-finite value
 * (an fp16 step skipped on overflow has no gradient norm) is null. */
static void write_number(FILE *f, const char *key, const char *fmt, double v) {
    fprintf(f, ", \"%s\": ", key);
    if (isfinite(v))
        fprintf(f, fmt, v);
    else
        fputs("null", f);
}

/* One line of metrics.jsonl, flushed; a line the disk did not take stops the
 * run, naming the file, rather than leaving the history cut short unnoticed. */
static ht_status write_metrics(ht_trainer *t, const ht_step_stats *st, double eval_loss, ht_error *err) {
    FILE *f = t->metrics;
    if (!f) return HT_OK;
    fprintf(f, "{\"step\": %lld", (long long)(st ? st->step : t->step));
    if (st) {
        write_number(f, "loss", "%.6f", st->loss);
        write_number(f, "lr", "%.6e", st->lr);
        write_number(f, "muon_lr", "%.6e", st->muon_lr);
        write_number(f, "grad_norm", "%.6f", st->grad_norm);
        write_number(f, "loss_scale", "%g", st->loss_scale);
        fprintf(f, ", \"skipped\": %s, \"qk_clipped_heads\": %d", st->skipped ? "true" : "false", st->qk_clipped_heads);
        write_number(f, "tokens_per_s", "%.1f", st->tokens_per_s);
        if (st->mfu > 0) write_number(f, "mfu", "%.4f", st->mfu);
    }
    if (isfinite(eval_loss)) write_number(f, "val_loss", "%.6f", eval_loss);
    fprintf(f, "}\n");
    if (fflush(f) != 0 || ferror(f))
        return ht_fail(err, HT_ERR_IO, "%s/metrics.jsonl: cannot write step %lld's line: %s",
                       t->config.checkpoint.output_dir, (long long)(st ? st->step : t->step), strerror(errno));
    return HT_OK;
}

static ht_status evaluate_and_log(ht_trainer *t, ht_error *err) {
    double vl;
    ht_status s = ht_trainer_evaluate(t, &vl, err);
    if (s != HT_OK) return s;
    if (isfinite(vl)) {
        ht_log_info("eval  step %5lld | validation loss %.4f (%.3f bits/token)", (long long)t->step, vl, vl / log(2.0));
        t->last_eval_loss = vl;
        return write_metrics(t, NULL, vl, err);
    }
    return HT_OK;
}

/* What the FSDP collectives cost a step over the run (evaluations included). */
static void log_fsdp_stats(ht_trainer *t, int64_t steps) {
    const ht_fsdp_stats *st = ht_fsdp_stats_get(t->fsdp);
    const ht_param_store *ps = &t->model->params;
    double weights = 0, grads = 0;
    for (int i = 0; i < ps->count; i++) {
        weights += (double)ht_param_numel(&ps->items[i]) * (double)ht_dtype_size(ps->items[i].compute_dtype);
        grads += (double)ht_param_numel(&ps->items[i]) * sizeof(float);
    }
    double n = (double)steps, mib = 1024.0 * 1024.0;
    double hidden = st->in_flight_seconds > 0 ? 100.0 * (1.0 - st->waited_seconds / st->in_flight_seconds) : 100.0;
    const bool f32 = st->reduce_dtype == HT_DTYPE_F32; /* else the reduce-scatters' bytes are 16-bit ones */
    ht_log_info("FSDP a step (over %lld steps, evaluations included): %.1f all-gathers (%.2f MiB), %.1f "
                "reduce-scatters (%.2f MiB%s%s); collectives in flight %.3f s, compute waited %.3f s of it (%.0f%% "
                "hidden); at most %.2f MiB of whole weights and gradients held at once (the whole model: %.2f MiB "
                "of weights, %.2f MiB of FP32 gradients)",
                (long long)steps, (double)st->gathers / n, st->gathered_bytes / n / mib,
                (double)st->reduce_scatters / n, st->reduced_bytes / n / mib, f32 ? "" : " of ",
                f32 ? "" : ht_dtype_name(st->reduce_dtype), st->in_flight_seconds / n, st->waited_seconds / n, hidden,
                st->pool_peak_bytes / mib, weights / mib, grads / mib);
}

/* Every rank's peak resident memory against what it should hold: the
 * process before the trainer, its rows of the weights (and their compute
 * copy), FP32 main params, main_grad and optimizer state, the whole weights
 * and gradients of FSDP units (the most held at once, measured), the
 * activations of one micro-batch and the corpus. Rank 0 prints a line a rank. */
static void log_memory(ht_trainer *t) {
    const ht_param_store *ps = &t->model->params;
    enum { START, WEIGHTS, MAIN, GRAD, OPTIM, UNITS, ACTS, DATA, PEAK, N };
    double v[N] = {
        [START] = t->rss_at_start,
        [WEIGHTS] = (double)(ps->data_bytes + ps->compute_bytes),
        [MAIN] = (double)ps->main_bytes,
        [GRAD] = (double)ps->grad_bytes,
        [OPTIM] = (double)ht_optimizer_bytes(&t->optimizer),
        [UNITS] = ht_fsdp_stats_get(t->fsdp)->pool_peak_bytes,
        [ACTS] = (double)t->model->activation_bytes,
        [DATA] = t->data ? (double)t->data->n_tokens * sizeof(*t->data->tokens) : 0.0,
        [PEAK] = rss_peak(),
    };
    int P = t->comm->size;
    double *all = t->comm->rank == 0 ? malloc((size_t)P * N * sizeof(double)) : NULL;
    int64_t bytes[P];
    for (int r = 0; r < P; r++) bytes[r] = N * (int64_t)sizeof(double);
    if (t->comm->rank == 0 && !all) return;
    ht_gather(t->comm, v, all, bytes, 0);
    const double mib = 1024.0 * 1024.0;
    for (int r = 0; all && r < P; r++) {
        const double *x = all + (size_t)r * N;
        double sum = 0;
        for (int k = START; k < PEAK; k++) sum += x[k];
        ht_log_info("memory rank %d: peak RSS %.1f MiB = %.3f x the formula %.1f MiB (at start %.1f, weights %.1f, "
                    "FP32 main params %.1f, main_grad %.1f, optimizer %.1f, whole units %.1f, activations %.1f, "
                    "corpus %.1f)",
                    r, x[PEAK] / mib, x[PEAK] / sum, sum / mib, x[START] / mib, x[WEIGHTS] / mib, x[MAIN] / mib,
                    x[GRAD] / mib, x[OPTIM] / mib, x[UNITS] / mib, x[ACTS] / mib, x[DATA] / mib);
        if (!t->config.training.memory_profile) continue;
        const char *const names[] = {"at start (libraries, MPI, config)",
                                     "weights (model dtype)",
                                     t->config.optimizer.fp32_main_params ? "FP32 main params"
                                                                          : "FP32 main params (off: no copies)",
                                     "main_grad (FP32)",
                                     "optimizer state",
                                     "whole FSDP units at once",
                                     "activations",
                                     "corpus tokens"};
        ht_log_info("Memory rank %d (tools.memory_profile): %-34s %10s %7s", r, "category", "MiB", "share");
        for (int k = START; k < PEAK; k++)
            ht_log_info("Memory rank %d:   %-34s %10.1f %6.1f%%", r, names[k - START], x[k] / mib,
                        sum > 0 ? 100.0 * x[k] / sum : 0.0);
        ht_log_info("Memory rank %d:   %-34s %10.1f (peak RSS %.1f)", r, "formula", sum / mib, x[PEAK] / mib);
    }
    free(all);
}

/* A whole, unsharded copy of the model's weights on rank 0, from the rows of
 * the first shard group's ranks (the others hold the same rows). The other
 * ranks send theirs and hold nothing more. */
static ht_status gather_whole_model(ht_trainer *t, ht_param_store *whole, ht_error *err) {
    const ht_param_store *ps = &t->model->params;
    bool root = t->comm->rank == 0;
    if (t->comm->rank >= t->shard_comm->size) return HT_OK; /* not the first shard group */
    for (int i = 0; root && i < ps->count; i++) {
        const ht_param *p = &ps->items[i];
        ht_param *q = ht_params_add(whole, p->name, p->ndim, p->shape, p->dtype);
        if (!q) {
            ht_params_free(whole);
            return ht_fail(err, HT_ERR_OOM, "cannot gather %s", p->name);
        }
        q->trainable = false;
    }
    /* Every rank of the group learns whether rank 0 could hold the model before anyone sends. */
    int64_t ok = root ? ht_params_allocate(whole, err) == HT_OK : 1;
    ht_broadcast(t->shard_comm, &ok, (int64_t)sizeof(ok), 0);
    if (!ok) {
        ht_params_free(whole);
        return root ? HT_ERR_OOM : ht_fail(err, HT_ERR_OOM, "rank 0 cannot hold the whole model to save it");
    }
    int64_t bytes[t->shard_comm->size];
    for (int i = 0; i < ps->count; i++) {
        const ht_param *p = &ps->items[i];
        ht_fsdp_row_bytes(p, t->shard_comm->size, bytes, ht_dtype_size(p->dtype));
        ht_gather(t->shard_comm, p->data, root ? whole->items[i].data : NULL, bytes, 0);
    }
    return HT_OK;
}

/* tools.profile: where the training loop's time went, phase by phase. */
static void log_profile(const ht_trainer *t, int64_t steps, double total) {
    const struct {
        const char *phase;
        double seconds;
    } rows[] = {
        {"forward", t->forward_seconds},
        {"backward", t->forward_backward_seconds - t->forward_seconds},
        {"reduce (gradient sync)", t->sync_seconds},
        {"optimizer", t->optimizer_seconds},
        {"checkpoint", t->checkpoint_seconds},
        {"evaluation", t->eval_seconds},
    };
    double counted = 0;
    ht_log_info("Profile over %lld steps (tools.profile; backward includes FSDP's overlapped collectives):",
                (long long)steps);
    ht_log_info("  %-24s %10s %12s %7s", "phase", "total s", "per step ms", "share");
    for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
        counted += rows[i].seconds;
        ht_log_info("  %-24s %10.3f %12.2f %6.1f%%", rows[i].phase, rows[i].seconds, 1e3 * rows[i].seconds / steps,
                    total > 0 ? 100.0 * rows[i].seconds / total : 0.0);
    }
    ht_log_info("  %-24s %10.3f %12.2f %6.1f%%", "other (data, metrics, log)", total - counted,
                1e3 * (total - counted) / steps, total > 0 ? 100.0 * (total - counted) / total : 0.0);
}

/* The final weights as a Hugging Face folder. With model.lora the adapters
 * are merged into the weights they adapt (transformers loads the folder as
 * it is), and written alone as a PEFT adapter directory in dir/adapter/. */
static ht_status save_final(ht_trainer *t, const char *dir, const ht_param_store *model, ht_error *err) {
    const ht_model_config *a = &t->model->config;
    ht_dtype dtype = t->model->params.items[0].dtype;
    if (a->lora.rank <= 0) {
        ht_status s = ht_hf_save(dir, a, model, dtype, (size_t)2 << 30, err);
        if (s == HT_OK)
            ht_log_info("saved the final weights (Hugging Face format, %s) to %s", ht_dtype_name(dtype), dir);
        return s;
    }
    ht_param_store merged;
    ht_status s = ht_lora_merge(model, ht_lora_scale(&a->lora), &merged, err);
    if (s != HT_OK) return s;
    s = ht_hf_save(dir, a, &merged, dtype, (size_t)2 << 30, err);
    ht_params_free(&merged);
    if (s != HT_OK) return s;
    ht_log_info("saved the final weights (Hugging Face format, %s, the LoRA adapters merged: W + scale B A) to %s",
                ht_dtype_name(dtype), dir);
    char adapter[HT_CONFIG_STR_MAX + 48];
    snprintf(adapter, sizeof(adapter), "%s/adapter", dir);
    /* In the model dtype, as PEFT's save_pretrained saves its params. */
    s = ht_peft_save_adapter(adapter, model, &a->lora, t->config.model.from_pretrained, dtype, err);
    if (s == HT_OK)
        ht_log_info("saved the LoRA adapters alone (PEFT's layout, %s) to %s", ht_dtype_name(dtype), adapter);
    return s;
}

/* Whether any rank was asked to stop (t->stop_request): every rank asks at
 * the same step boundary, and all learn the same answer, the largest value. */
static int stop_agreed(ht_trainer *t) {
    double v = t->stop_request ? (double)*t->stop_request : 0.0;
    if (t->comm->size > 1) ht_all_reduce_f64(t->comm, &v, 1, HT_REDUCE_MAX);
    return (int)v;
}

/* metrics.jsonl synced and closed: an error if the disk did not take it. */
static ht_status close_metrics(ht_trainer *t, ht_error *err) {
    FILE *metrics = t->metrics;
    if (!metrics) return HT_OK;
    t->metrics = NULL;
    bool kept = fflush(metrics) == 0 && fsync(fileno(metrics)) == 0;
    int e = errno;
    if (fclose(metrics) != 0 && kept) kept = false, e = errno;
    if (!kept)
        return ht_fail(err, HT_ERR_IO, "%s/metrics.jsonl: cannot finish writing: %s", t->config.checkpoint.output_dir,
                       strerror(e));
    return HT_OK;
}

/* A run asked to stop (a preemption's SIGTERM): the step in progress was
 * finished; what it trained since the newest checkpoint is saved, so that
 * the same command resumes where it stopped. */
static ht_status stop_run(ht_trainer *t, int64_t saved_step, ht_error *err) {
    const ht_config *c = &t->config;
    const bool root = t->comm->rank == 0;
    if (root)
        ht_log_warn("stop requested (signal %d) at step %lld of %d: saving a checkpoint and stopping", t->stopped_by,
                    (long long)t->step, c->training.steps);
    ht_status s = HT_OK;
    if (c->checkpoint.save_interval > 0 && t->step != saved_step) s = ht_trainer_save_checkpoint(t, err);
    if (s == HT_OK && root) s = close_metrics(t, err);
    if (s != HT_OK || !root) return s;
    if (c->checkpoint.save_interval <= 0)
        ht_log_warn("stopped at step %lld: checkpoint.save_interval is 0, so no checkpoint was saved; the %lld steps "
                    "of this run are lost",
                    (long long)t->step, (long long)t->step);
    else
        ht_log_info("stopped at step %lld with checkpoint %s/step_%08lld; the same command with "
                    "checkpoint.restore_from: latest resumes it",
                    (long long)t->step, c->checkpoint.output_dir, (long long)t->step);
    return HT_OK;
}

ht_status ht_trainer_run(ht_trainer *t, ht_error *err) {
    const ht_config *c = &t->config;
    const bool root = t->comm->rank == 0; /* rank 0 writes the metrics, the final weights and the plot */
    ht_status s = root ? open_metrics(t, err) : HT_OK;
    if (s != HT_OK) return s;
    int steps = c->training.steps;
    s = evaluate_and_log(t, err);
    if (s != HT_OK) return s;
    double first_eval = t->last_eval_loss;
    ht_fsdp_stats_reset(t->fsdp);
    t->forward_backward_seconds = t->sync_seconds = t->optimizer_seconds = 0.0;
    t->forward_seconds = t->checkpoint_seconds = t->eval_seconds = 0.0;
    double start = ht_time_seconds(), tokens_per_s = 0.0, mfu = 0.0;
    int64_t first_step = t->step; /* > 0 when resumed: the ETA counts this run's steps only */
    int64_t saved_step = t->step; /* the step the newest checkpoint holds: resumed from, or saved */
    while (t->step < steps) {
        if ((t->stopped_by = stop_agreed(t)) != 0) break;
        ht_step_stats st;
        s = ht_trainer_step(t, &st, err);
        if (s != HT_OK) return s;
        tokens_per_s = tokens_per_s == 0.0 ? st.tokens_per_s : 0.9 * tokens_per_s + 0.1 * st.tokens_per_s;
        mfu = mfu == 0.0 ? st.mfu : 0.9 * mfu + 0.1 * st.mfu;
        s = write_metrics(t, &st, NAN, err);
        if (s != HT_OK) return s;
        if (t->step % c->training.log_interval == 0 || t->step == 1 || t->step == steps) {
            double elapsed = ht_time_seconds() - start;
            char eta[32], el[32];
            format_duration(eta, sizeof(eta), elapsed / (double)(t->step - first_step) * (double)(steps - t->step));
            format_duration(el, sizeof(el), elapsed);
            char scale[48] = "";
            if (t->optimizer.loss_scaling)
                snprintf(scale, sizeof(scale), " | loss scale %g%s", st.loss_scale, st.skipped ? " (skipped)" : "");
            char util[32] = "";
            if (mfu > 0) snprintf(util, sizeof(util), " | MFU %4.1f%%", 100.0 * mfu);
            ht_log_info("step %5lld/%d | loss %.4f | lr %.3e | grad norm %7.4f%s | %8.0f tok/s%s | %s elapsed, ETA %s",
                        (long long)t->step, steps, st.loss, st.lr, st.grad_norm, scale, tokens_per_s, util, el, eta);
        }
        double p0 = ht_time_seconds();
        if (c->checkpoint.save_interval > 0 && t->step % c->checkpoint.save_interval == 0) {
            s = ht_trainer_save_checkpoint(t, err);
            if (s != HT_OK) return s;
            saved_step = t->step;
        }
        double p1 = ht_time_seconds();
        if (c->training.eval_interval > 0 && t->step % c->training.eval_interval == 0 && t->step != steps) {
            s = evaluate_and_log(t, err);
            if (s != HT_OK) return s;
        }
        t->checkpoint_seconds += p1 - p0;
        t->eval_seconds += ht_time_seconds() - p1;
    }
    if (t->stopped_by) return stop_run(t, saved_step, err);
    if (c->training.profile && t->step > first_step) log_profile(t, t->step - first_step, ht_time_seconds() - start);
    if (t->step > first_step) {
        double n = (double)(t->step - first_step);
        char a2a[96] = "";
        if (t->ep_comm)
            snprintf(a2a, sizeof(a2a), " (the experts' all-to-all %.3f s of it, %.0f%%)", t->all_to_all_seconds / n,
                     100.0 * t->all_to_all_seconds / fmax(t->forward_backward_seconds, 1e-12));
        ht_log_info("time a step (over %lld steps): forward + backward %.3f s%s, gradient sync %.3f s, optimizer %.3f "
                    "s (Muon and AdamW with their collectives, the clip, the cast back)",
                    (long long)(t->step - first_step), t->forward_backward_seconds / n, a2a, t->sync_seconds / n,
                    t->optimizer_seconds / n);
    }
    if (t->sharded && t->step > first_step) log_fsdp_stats(t, t->step - first_step);
    log_memory(t);
    if (c->checkpoint.save_interval > 0 && t->step % c->checkpoint.save_interval != 0 && t->step != saved_step) {
        s = ht_trainer_save_checkpoint(t, err); /* the end of the run */
        if (s != HT_OK) return s;
    }
    s = evaluate_and_log(t, err);
    if (s != HT_OK) return s;
    if (isfinite(first_eval) && isfinite(t->last_eval_loss))
        ht_log_info("validation loss: %.4f before training, %.4f after %d steps", first_eval, t->last_eval_loss, steps);

    /* The final weights, whole: a sharded run gathers every param's rows first. */
    ht_param_store gathered = {0};
    const ht_param_store *model = &t->model->params;
    if (t->sharded) {
        s = gather_whole_model(t, &gathered, err);
        if (s != HT_OK) return s;
        model = &gathered;
    }
    if (!root) {
        ht_params_free(&gathered);
        return HT_OK;
    }
    char dir[HT_CONFIG_STR_MAX + 32], path[HT_CONFIG_STR_MAX + 64];
    snprintf(dir, sizeof(dir), "%s/final", c->checkpoint.output_dir);
    s = save_final(t, dir, model, err);
    ht_params_free(&gathered);
    if (s != HT_OK) return s;
    /* The metrics are complete: synced and closed, an error if the disk did not take them. */
    snprintf(path, sizeof(path), "%s/metrics.jsonl", c->checkpoint.output_dir);
    s = close_metrics(t, err);
    if (s != HT_OK) return s;
    char svg[HT_CONFIG_STR_MAX + 64];
    snprintf(svg, sizeof(svg), "%s/loss.svg", c->checkpoint.output_dir);
    s = ht_plot_metrics(path, svg, err);
    if (s != HT_OK) return s;
    ht_log_info("metrics: %s; loss curve: %s", path, svg);
    return HT_OK;
}

/* ------------------------------------------------------------------ checkpoints */

void ht_trainer_checkpoint_view(ht_trainer *t, ht_ckpt_view *v) {
    memset(v, 0, sizeof(*v));
    v->params = &t->model->params;
    v->optimizer = &t->optimizer;
    v->config = &t->config;
    v->model = &t->model->config;
    v->state.step = t->step;
    v->state.schedule_step = t->optimizer.step;
    v->state.no_rng = t->config.training.no_save_rng;
    v->state.seed = t->config.training.seed;
    v->state.train_pos = ht_loader_position(&t->train_loader);
    v->state.valid_pos = ht_loader_position(&t->valid_loader);
    v->state.loss_scaling = t->optimizer.loss_scaling;
    v->state.scaler = t->optimizer.scaler;
    v->state.gemm_bf16 = ht_gemm_kernel_of(HT_DTYPE_BF16);
    v->state.gemm_f16 = ht_gemm_kernel_of(HT_DTYPE_F16);
}

/* What one rank wrote, as bytes for rank 0: the file's name, size and hash,
 * then its chunks. */
typedef struct rank_file_head {
    char file[64];
    uint64_t size, hash;
    int64_t count;
} rank_file_head;

/* Every rank's ht_ckpt_rank_file, on every rank (ranks[world]). */
static ht_status gather_rank_files(ht_comm *comm, const ht_ckpt_rank_file *mine, ht_ckpt_rank_file *ranks,
                                   ht_error *err) {
    int P = comm->size;
    int64_t my_bytes = (int64_t)sizeof(rank_file_head) + (int64_t)mine->count * (int64_t)sizeof(ht_ckpt_chunk);
    int64_t sizes[P], eight[P], total = 0;
    for (int r = 0; r < P; r++) eight[r] = sizeof(int64_t);
    ht_all_gather(comm, &my_bytes, sizes, eight);
    for (int r = 0; r < P; r++) total += sizes[r];
    char *all = malloc((size_t)total), *me = malloc((size_t)my_bytes);
    if (!all || !me) {
        free(all);
        free(me);
        return ht_fail(err, HT_ERR_OOM, "cannot gather the checkpoint's chunk lists");
    }
    rank_file_head head = {.size = mine->size, .hash = mine->hash, .count = mine->count};
    memcpy(head.file, mine->file, sizeof(head.file));
    memcpy(me, &head, sizeof(head));
    memcpy(me + sizeof(head), mine->chunks, (size_t)mine->count * sizeof(ht_ckpt_chunk));
    ht_all_gather(comm, me, all, sizes);
    const char *at = all;
    for (int r = 0; r < P; r++) {
        memcpy(&head, at, sizeof(head));
        memcpy(ranks[r].file, head.file, sizeof(ranks[r].file));
        ranks[r].size = head.size;
        ranks[r].hash = head.hash;
        ranks[r].count = ranks[r].capacity = (int)head.count;
        ranks[r].chunks = malloc((size_t)(head.count ? head.count : 1) * sizeof(ht_ckpt_chunk));
        if (ranks[r].chunks) memcpy(ranks[r].chunks, at + sizeof(head), (size_t)head.count * sizeof(ht_ckpt_chunk));
        at += sizes[r];
    }
    free(all);
    free(me);
    for (int r = 0; r < P; r++)
        if (!ranks[r].chunks) return ht_fail(err, HT_ERR_OOM, "cannot gather the checkpoint's chunk lists");
    return HT_OK;
}

ht_status ht_trainer_save_checkpoint(ht_trainer *t, ht_error *err) {
    const ht_config *c = &t->config;
    ht_ckpt_view v;
    ht_trainer_checkpoint_view(t, &v);
    ht_ckpt_save_options o = {.save_optimizer = c->checkpoint.save_optimizer, .keep_last = c->checkpoint.keep_last};
    double t0 = ht_time_seconds();
    ht_comm *comm = t->comm;
    const bool root = comm->rank == 0;
    /* The first shard group writes (its replicas hold the same rows; with
     * shard_size 1 that is rank 0 alone, holding everything). Rank 0 opens
     * step_X.tmp/, every rank of the group writes its rows into its own file,
     * rank 0 writes metadata.json from every rank's chunk list and commits,
     * and the other ranks wait until it is complete. A rank that fails ends
     * the world (CLI), and the .tmp is never loaded. */
    ht_comm *group = t->shard_comm;
    if (comm->rank < group->size) {
        char tmp[HT_CKPT_PATH_MAX] = "";
        ht_status s = root ? ht_ckpt_begin(c->checkpoint.output_dir, t->step, tmp, sizeof(tmp), err) : HT_OK;
        if (s != HT_OK) return s;
        ht_broadcast(group, tmp, (int64_t)sizeof(tmp), 0);
        ht_ckpt_rank_file mine = {0};
        s = ht_ckpt_write_rank(tmp, group->rank, &v, &o, &mine, err);
        if (s != HT_OK) return s;
        ht_ckpt_rank_file *ranks = calloc((size_t)group->size, sizeof(ht_ckpt_rank_file));
        s = ranks ? gather_rank_files(group, &mine, ranks, err) : ht_fail(err, HT_ERR_OOM, "out of memory");
        if (s == HT_OK && root) s = ht_ckpt_commit(c->checkpoint.output_dir, group->size, ranks, &v, &o, err);
        ht_ckpt_rank_file_free(&mine);
        for (int r = 0; ranks && r < group->size; r++) ht_ckpt_rank_file_free(&ranks[r]);
        free(ranks);
        if (s != HT_OK) return s;
        if (root)
            ht_log_info("saved checkpoint %s/step_%08lld (%d rank file%s) in %.2f s", c->checkpoint.output_dir,
                        (long long)t->step, group->size, group->size > 1 ? "s" : "", ht_time_seconds() - t0);
    }
    ht_barrier(comm);
    return HT_OK;
}

/* The optimizer and schedule settings the checkpoint was saved with, against
 * this run's: each difference is named, and this run's value is the one used
 * (as the seed systems do on a resume). */
static void log_changed_hyperparameters(const ht_trainer *t, const ht_checkpoint *ck) {
    int changed = 0;
    char now[4096];
    for (int i = 0; i < ht_config_key_count(); i++) {
        const char *key = ht_config_key_name(i);
        if (strncmp(key, "optimizer.", 10) != 0 && strncmp(key, "lr_scheduler.", 13) != 0 &&
            strcmp(key, "training.max_norm") != 0 && strcmp(key, "training.gradient_scaling_factor") != 0)
            continue;
        const char *then = ht_ckpt_config_value(ck, key);
        if (!then || !ht_config_format_value(&t->config, key, now, sizeof(now)) || strcmp(then, now) == 0) continue;
        ht_log_warn("resume: %s was %s in %s; this run uses %s (the config's value wins)", key, then, ht_ckpt_dir(ck),
                    now);
        changed++;
    }
    if (changed)
        ht_log_info("resume: %d optimizer setting%s changed since the checkpoint", changed, changed > 1 ? "s" : "");
}

/* A checkpoint config's integer (0: absent or null). */
static long long saved_int(const ht_checkpoint *ck, const char *key) {
    const char *v = ht_ckpt_config_value(ck, key);
    return v ? strtoll(v, NULL, 10) : 0;
}

/* The global batch, in sequences per step, and what sets it: the
 * accumulation count when given (MindSpeed-MM's: it follows the ranks), else
 * training.global_batch_size. */
static long long describe_batch(long long local, long long accum, long long world, long long global, char *buf,
                                size_t n) {
    if (accum > 0) {
        snprintf(buf, n,
                 "training.local_batch_size %lld x training.gradient_accumulation_steps %lld x %lld data-parallel "
                 "rank%s",
                 local, accum, world, world == 1 ? "" : "s");
        return local * accum * world;
    }
    snprintf(buf, n, "training.global_batch_size");
    return global;
}

/* A resume with another global batch keeps the data position and the step
 * count: said once, with what it does to both. */
static void warn_changed_batch(const ht_trainer *t, const ht_checkpoint *ck, const ht_ckpt_trainer_state *st) {
    const ht_config *c = &t->config;
    char then_how[256], now_how[256], data[256];
    long long then = describe_batch(saved_int(ck, "training.local_batch_size"),
                                    saved_int(ck, "training.gradient_accumulation_steps"), ht_ckpt_world_size(ck),
                                    saved_int(ck, "training.global_batch_size"), then_how, sizeof(then_how));
    long long now = describe_batch(t->B, c->training.gradient_accumulation_steps, t->comm->size,
                                   (long long)t->B * t->grad_accum * t->comm->size, now_how, sizeof(now_how));
    if (then <= 0 || then == now) return;
    if (st->no_rng || c->training.no_load_rng)
        snprintf(data, sizeof(data), "starts again from its beginning (no data position is restored)");
    else
        snprintf(data, sizeof(data), "continues at the saved position (epoch %llu, window %llu)",
                 (unsigned long long)st->train_pos.epoch, (unsigned long long)st->train_pos.index);
    long long step = st->step, steps = c->training.steps, left = steps > step ? steps - step : 0;
    ht_log_warn("resume: the global batch was %lld sequences in %s (%s); this run's is %lld (%s). The data %s, %lld "
                "windows a step from here; the LR schedules count steps, not sequences, so each of steps %lld to %lld "
                "takes %.3g times the sequences it would have had at its learning rate, and the run sees %lld "
                "sequences in all instead of %lld",
                then, ht_ckpt_dir(ck), then_how, now, now_how, data, now, step + 1, steps, (double)now / (double)then,
                step * then + left * now, steps * then);
}

/* The directory that holds a checkpoint's entry, as its path names it (not
 * where a symlink points): a symlinked checkpoint in output_dir is output_dir's. */
static void holding_dir(const char *dir, char *out, size_t n) {
    snprintf(out, n, "%s", dir);
    size_t len = strlen(out);
    while (len > 1 && out[len - 1] == '/') out[--len] = '\0';
    char *slash = strrchr(out, '/');
    const char *last = slash ? slash + 1 : out;
    if (strcmp(last, ".") == 0 || strcmp(last, "..") == 0)
        snprintf(out, n, "%s/..", dir); /* no entry to name: the directory above, as realpath finds it */
    else if (!slash)
        snprintf(out, n, ".");
    else if (slash == out)
        out[1] = '\0'; /* "/step_1" is held by "/" */
    else
        *slash = '\0';
}

ht_status ht_trainer_restore(ht_trainer *t, const char *restore_from, bool restore_optimizer, ht_error *err) {
    char dir[HT_CKPT_PATH_MAX];
    ht_status s = ht_ckpt_resolve(restore_from, t->config.checkpoint.output_dir, dir, sizeof(dir), err);
    if (s != HT_OK || !dir[0]) return s;
    ht_checkpoint *ck;
    s = ht_ckpt_open(dir, &ck, err);
    if (s != HT_OK) return s;
    /* A checkpoint of another directory starts a new lineage in output_dir:
     * what output_dir holds already is another run's (open_metrics). */
    char parent[HT_CKPT_PATH_MAX + 8], here[PATH_MAX], there[PATH_MAX];
    holding_dir(dir, parent, sizeof(parent));
    t->resumed_from[0] = '\0';
    if (!realpath(parent, there) || !realpath(t->config.checkpoint.output_dir, here) || strcmp(here, there) != 0)
        snprintf(t->resumed_from, sizeof(t->resumed_from), "%s", dir);
    ht_ckpt_view v;
    ht_trainer_checkpoint_view(t, &v);
    v.lenient = !t->config.training.load_strict;
    s = ht_ckpt_load(ck, &v, restore_optimizer, err);
    if (s == HT_OK && restore_optimizer && t->comm->rank == 0) {
        log_changed_hyperparameters(t, ck);
        warn_changed_batch(t, ck, &v.state);
    }
    ht_ckpt_close(ck);
    if (s != HT_OK) return s;
    if (t->fsdp) ht_fsdp_weights_changed(t->fsdp); /* gathered copies of the old weights are stale */
    if (!restore_optimizer) return HT_OK;
    /* The schedules' step and the loss scaler came with the optimizer; the rest is the trainer's. */
    t->step = v.state.step;
    /* The random state (training.no_save_rng / no_load_rng, MindSpeed-MM's):
     * without it the data starts from its beginning in this run's order. */
    bool root = t->comm->rank == 0;
    if (v.state.no_rng || t->config.training.no_load_rng) {
        if (root)
            ht_log_warn("resume: %s; the data starts again from its beginning in the order of training.seed %lld, "
                        "at step %lld",
                        !v.state.no_rng
                            ? "training.no_load_rng: the checkpoint's seed and data positions are not loaded"
                            : "the checkpoint holds no seed or data positions (saved with "
                              "training.no_save_rng)",
                        (long long)t->config.training.seed, (long long)t->step);
        return HT_OK;
    }
    if (root && v.state.seed != t->config.training.seed)
        ht_log_warn("resume: training.seed was %lld in the checkpoint; this run uses %lld, so the data after the saved "
                    "position follows another order (and so do the other seeded streams)",
                    (long long)v.state.seed, (long long)t->config.training.seed);
    s = ht_loader_resume(&t->train_loader, v.state.train_pos, err);
    if (s == HT_OK && t->eval_B > 0) s = ht_loader_resume(&t->valid_loader, v.state.valid_pos, err);
    return s;
}
