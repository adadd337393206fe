/* Building the trainer from one config: the model (from_pretrained, freeze,
 * LoRA, recompute), the GEMM kernels and FSDP, the data and the memory check,
 * the LR schedules, Muon + AdamW and the QK-clip table; and freeing it all. */
#include "hypertrain/train.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "hypertrain/ckpt.h"
#include "hypertrain/parallel.h"
#include "hypertrain/kernels.h"
#include "hypertrain/optimizer.h"
#include "train/events.h"
#include "train/rundir.h"

_Static_assert(HT_CONFIG_NS_MAX_REPEAT == HT_NS_MAX_STEPS, "the config's bound on a segment is the longest schedule");

/* This process's resident bytes now. */
static double rss_now(void) {
    long pages = 0, resident = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (f) {
        if (fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
        fclose(f);
    }
    return (double)resident * (double)sysconf(_SC_PAGESIZE);
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

/* Where this rank's model sits: FSDP's rows of its tensor-parallel slices.
 * fsdp_config.shard_size: every rank holds only its rows of every parameter
 * (and so of its FP32 main param, main_grad and optimizer state).
 * training.init_model_with_meta_device: it builds, initialises and loads
 * only those rows; otherwise it builds the whole model first. */
static ht_model_placement placement(const ht_trainer *t) {
    const bool meta = t->config.training.init_model_with_meta_device;
    return (ht_model_placement){.shard_rank = meta ? t->par.shard->rank : 0,
                                .shard_world = meta ? t->par.shard->size : 1,
                                .tp_rank = t->par.tp->rank,
                                .tp_size = t->par.tp->size,
                                .pp_rank = t->par.pp_rank,
                                .pp_size = t->par.pp_size,
                                .pp_chunks = t->config.parallel.virtual_pipeline_model_parallel_size};
}

/* The model with its params declared, not yet stored: their dtypes
 * (model_init_dtype), what trains (model.freeze, model.lora), the
 * recompute plan and the LM head's chunks, all that plan_memory sizes. */
static ht_status declare_model(ht_trainer *t, ht_error *err) {
    const ht_config *c = &t->config;
    ht_model_config arch = c->model.arch; /* with model.from_pretrained, its config.json's (use_pretrained) */
    lora_config(&c->model.lora, &arch.lora);
    const ht_model_placement at = placement(t);
    ht_status s = ht_model_declare(&arch, HT_DTYPE_F32, &at, &t->model, err);
    if (s == HT_OK) s = ht_tensor_parallel_attach(t->model, t->par.tp, c->parallel.sequence_parallel, err);
    /* model_init_dtype: the dtype the weights are stored in, initialised or loaded straight into it. */
    if (s == HT_OK && c->model_init_dtype != HT_CONFIG_DTYPE_NONE)
        s = ht_params_convert(&t->model->params, c->model_init_dtype, err);
    if (s == HT_OK) s = freeze_params(t, err);
    if (s == HT_OK) s = plan_recompute(t, err);
    if (s == HT_OK && t->par.pp_size > 1) { /* every stage's params, as this stage's are declared */
        const ht_model_placement one = {.shard_world = 1, .tp_size = 1, .pp_size = 1};
        s = ht_model_declare(&arch, HT_DTYPE_F32, &one, &t->whole, err);
        if (s == HT_OK && c->model_init_dtype != HT_CONFIG_DTYPE_NONE)
            s = ht_params_convert(&t->whole->params, c->model_init_dtype, err);
    }
    if (s != HT_OK) return s;
    t->model->output_dtype = c->fsdp.output_dtype;
    t->model->keep_logits = false;         /* the loss is all a run reads of them */
    if (c->kernels.lm_head_chunk_mib >= 0) /* else auto: the backend's, which the model was built with */
        t->model->head_chunk_bytes = (int64_t)c->kernels.lm_head_chunk_mib << 20;
    const ht_model_config *a = &t->model->config;
    char heads[64];
    if (ht_model_config_has_mla(a))
        snprintf(heads, sizeof(heads), "Multi-Latent Attention, below");
    else
        snprintf(heads, sizeof(heads), "%d KV, dim %d", a->num_key_value_heads, ht_model_config_head_dim(a));
    ht_log_info("Model config: %s, vocab %d, hidden %d, intermediate %d, %d layers, %d heads (%s), "
                "max positions %d, rope theta %g, rms eps %g, attention bias %s, tied embeddings %s",
                a->name, a->vocab_size, a->hidden_size, a->intermediate_size, a->num_hidden_layers,
                a->num_attention_heads, heads, a->max_position_embeddings, a->rope_theta, a->rms_norm_eps,
                a->attention_bias ? "yes" : "no", a->tie_word_embeddings ? "yes" : "no");
    if (ht_model_config_has_mla(a)) {
        const ht_mla_config *mla = &a->mla;
        char q[48];
        snprintf(q, sizeof(q), mla->q_lora_rank > 0 ? "query latent %d" : "q_proj", mla->q_lora_rank);
        ht_log_info("Multi-Latent Attention: %s, key/value latent %d, per head q/k %d + %d rotary (%s), v %d; "
                    "softmax scale %.6g%s",
                    q, mla->kv_lora_rank, mla->qk_nope_head_dim, mla->qk_rope_head_dim,
                    mla->rope_interleave ? "interleaved pairs" : "halves", mla->v_head_dim,
                    ht_model_config_attention_scale(a), ht_rope_is_yarn(&a->rope_scaling) ? " (YaRN)" : "");
    }
    const int64_t chunk = t->model->head_chunk_bytes, rows = chunk / ((int64_t)a->vocab_size * 4);
    if (chunk > 0)
        ht_log_info("LM head and loss: at most %lld MiB of FP32 logits at once, chunks of %lld tokens where a "
                    "micro-batch has more (kernels.lm_head_chunk_mib %s)",
                    (long long)(chunk >> 20), (long long)(rows > 0 ? rows : 1),
                    c->kernels.lm_head_chunk_mib >= 0 ? "as set" : "auto: the kernel table's");
    else
        ht_log_info("LM head and loss: every token at once (kernels.lm_head_chunk_mib 0)");
    if (ht_model_config_is_deepseek(a) && a->moe.num_experts > 0)
        ht_log_info(
            "DeepSeekMoE: %d routed experts in %d groups (%d kept), top %d, %d shared, width %d, weights x %g%s; "
            "the first %d layer(s) dense (first_k_dense_replace)",
            a->moe.num_experts, a->moe.n_group, a->moe.topk_group, a->moe.num_experts_per_tok, a->moe.n_shared_experts,
            a->moe.moe_intermediate_size, a->moe.routed_scaling_factor,
            a->moe.norm_topk_prob ? " after normalising" : "", a->moe.first_k_dense_replace);
    const int X = t->par.dp_size * t->par.cp_size; /* the data x context-parallel ranks FSDP spans (a stage's) */
    if (t->par.tp_size > 1) {
        double global = 0;
        for (int i = 0; i < t->model->params.count; i++)
            global += (double)ht_param_global_numel(&t->model->params.items[i]);
        ht_log_info("Tensor parallel %d (Megatron's layout; %s): q/k/v, gate and up split by output rows "
                    "(whole heads, %d of %d here), o_proj and down by input columns, the embedding and the LM head "
                    "by vocabulary (a vocabulary-parallel cross-entropy), the norms whole on every rank%s; this "
                    "rank's slices hold %.2fM of the model's %.2fM values",
                    t->par.tp_size,
                    c->parallel.sequence_parallel
                        ? "sequence parallel: the residual stream and the norms hold 1/TP of the tokens, gathered "
                          "before each column-parallel pair and reduce-scattered after each row-parallel product"
                        : "no sequence parallelism: every rank of the group holds the whole hidden states, "
                          "all-reduced after each row-parallel product",
                    a->num_attention_heads / t->par.tp_size, a->num_attention_heads,
                    a->moe.num_experts > 0 ? "; a sparse layer's shared expert split as an MLP, its router, "
                                             "shared-expert gate and routed experts whole (each on the rank's "
                                             "tokens; the experts split by expert parallelism)"
                                           : "",
                    (double)ht_params_total_numel(&t->model->params) / 1e6, global / 1e6);
    }
    if (t->par.sharded)
        ht_log_info(
            "%s over %d ranks, %s (fsdp_config.shard_size %d: %d shard group(s) x %d replica(s)): "
            "each rank holds its rows of every parameter, %smain_grad and optimizer state "
            "(%.2fM of %.2fM values on this rank); each FSDP unit gathers its whole weights around its "
            "modules and sums its FP32 gradients into each rank's rows%s",
            t->par.cp_size > 1 ? "Data x context parallel" : "Data parallel", X,
            t->par.replica->size > 1 ? "hybrid sharded (HSDP)" : "fully sharded", t->par.shard->size,
            X / t->par.shard->size, t->par.replica->size, c->optimizer.fp32_main_params ? "FP32 main param, " : "",
            (double)local_numel(&t->model->params) / 1e6, (double)ht_params_total_numel(&t->model->params) / 1e6,
            t->par.replica->size > 1 ? ", then over the replicas" : "");
    else if (X > 1)
        ht_log_info("Data parallel over %d ranks, replicated (fsdp_config.shard_size 1): every rank holds the whole "
                    "model%s and optimizer state; the FP32 gradients are summed over the ranks before each step",
                    X, t->par.tp_size > 1 ? " (its tensor-parallel slices)" : "");
    return HT_OK;
}

/* The declared model's storage and values: initialised from the seed, then
 * model.from_pretrained's weights and model.lora.from_pretrained's adapters
 * over them, then (without the meta device) cut to this rank's rows. */
static ht_status allocate_model(ht_trainer *t, ht_error *err) {
    const ht_config *c = &t->config;
    const ht_model_placement at = placement(t);
    const bool meta = c->training.init_model_with_meta_device;
    /* model.from_pretrained: the folder's weights replace the drawn ones (only the adapters are drawn). */
    ht_status s = ht_model_allocate(t->model, &at, (uint64_t)c->training.seed, c->model.from_pretrained[0] != 0, err);
    if (s != HT_OK) return s;
    if (c->model.from_pretrained[0]) {
        s = ht_hf_load_weights(c->model.from_pretrained, &t->model->params, err);
        if (s != HT_OK) return s;
        ht_log_info("loaded weights from %s%s", c->model.from_pretrained,
                    t->par.sharded && meta ? " (this rank's rows)" : "");
    }
    if (c->model.lora.from_pretrained[0]) {
        s = ht_peft_load_adapter(c->model.lora.from_pretrained, &t->model->config.lora, &t->model->params, err);
        if (s != HT_OK) return s;
    }
    if (!meta) {
        s = ht_params_shard(&t->model->params, t->par.shard->rank, t->par.shard->size, err);
        if (s != HT_OK) return s;
    }
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
    if (t->planning && t->comm->rank != 0) return HT_OK; /* one process plans every rank: rank 0's choice holds */
    ht_status s = HT_OK;
    if (t->comm->rank == 0) {
        s = ht_kernels_choose_gemm(bf16, f16, M, C, C, &choice, err);
        if (s != HT_OK && kept[0]) {
            kept = "";
            s = ht_kernels_choose_gemm(c->kernels.bf16_gemm, c->kernels.f16_gemm, M, C, C, &choice, err);
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
        s = ht_kernels_choose_gemm(choice.bf16, choice.f16, M, C, C, &here, err); /* pinned: checked, not timed */
        if (s != HT_OK) return s;
    }
    ht_kernels_use_gemm(&choice);
    char line[512];
    ht_kernels_describe_gemm(&choice, line, sizeof(line));
    ht_log_info("%s%s", line, kept);
    if (t->planning) return HT_OK;
    /* The MFU's peak: the rate of the kernel the compute dtype runs on, on
     * this product, or on one of PEAK_MIN a side where the model's is smaller
     * (a small model's products run far below what the CPU can, and an MFU
     * against them reads several times too high; 512 a side already runs at
     * the 2048 x 512 x 512 rate of bench_gemm). Rank 0 times it. */
    enum { PEAK_MIN = 512 };
    const int64_t PM = M > PEAK_MIN ? M : PEAK_MIN, PC = C > PEAK_MIN ? C : PEAK_MIN;
    const ht_dtype pd = c->fsdp.param_dtype;
    double rate = 0.0;
    if (t->comm->rank == 0) rate = ht_kernels_gemm_rate(pd, PM, PC, PC);
    ht_broadcast(t->comm, &rate, (int64_t)sizeof(rate), 0);
    t->gemm_gflops = rate;
    return HT_OK;
}

/* parallel.expert_parallel_size P > 1 on W ranks: the model must have
 * experts, P ranks must split them evenly, and each rank's FSDP rows of an
 * expert param must be whole experts of its group's share (E a multiple of W). */
static ht_status check_experts(const ht_trainer *t, ht_error *err) {
    const ht_model_config *a = &t->model->config;
    const int P = t->par.ep->size, W = t->par.dp_size * t->par.cp_size, E = a->moe.num_experts; /* FSDP's ranks */
    if (E <= 0)
        return ht_fail(err, HT_ERR_CONFIG,
                       "parallel.expert_parallel_size is %d, but the model (%s) has no experts (model.num_experts %d)",
                       P, a->name, E);
    if (E % P != 0)
        return ht_fail(err, HT_ERR_CONFIG,
                       "model.num_experts (%d) is not a multiple of parallel.expert_parallel_size (%d): the %d ranks "
                       "of an expert-parallel group must hold the same number of experts",
                       E, P, P);
    if (E % W != 0 && t->par.tp_size == 1)
        return ht_fail(err, HT_ERR_CONFIG,
                       "model.num_experts (%d) is not a multiple of the %d ranks: with expert parallelism each rank "
                       "shards whole experts of its group's %d (FSDP over the %d ranks holding them); use a world "
                       "size that divides %d",
                       E, W, E / P, W / P, E);
    if (E % W != 0)
        return ht_fail(
            err, HT_ERR_CONFIG,
            "model.num_experts (%d) is not a multiple of the %d data x context-parallel ranks (%d ranks over "
            "parallel.tensor_parallel_size %d): with expert parallelism each of them shards whole experts "
            "of its group's %d (FSDP over the %d ranks holding them); use a number of ranks whose quotient "
            "by %d divides %d",
            E, W, t->comm->size, t->par.tp_size, E / P, W / P, t->par.tp_size, E);
    return HT_OK;
}

/* Context parallelism: the model's attention exchanges over the Ulysses
 * and ring groups, once the architecture in force (model.from_pretrained's
 * too) is known to split: Ulysses gives each rank whole heads. */
static ht_status attach_context(ht_trainer *t, ht_error *err) {
    const ht_model_config *a = &t->model->config;
    const int U = t->par.ulysses->size, R = t->par.ring->size, T = t->T;
    const int H = a->num_attention_heads, KV = ht_model_config_has_mla(a) ? H : a->num_key_value_heads;
    if (H % U != 0 || KV % U != 0)
        return ht_fail(err, HT_ERR_CONFIG,
                       "parallel.ulysses_parallel_size %d does not divide the model's %d attention heads and %d "
                       "key/value heads (%s): Ulysses gives each rank whole heads of every sequence",
                       U, H, KV, a->name);
    ht_status s = ht_context_parallel_attach(t->model, t->par.cp, t->par.ulysses, t->par.ring, err);
    if (s != HT_OK || t->comm->rank != 0) return s;
    char ring[160] = "";
    if (R > 1)
        snprintf(ring, sizeof(ring),
                 "; ring: each sequence in %d chunks of %d, ring rank r holding chunks r and %d - r, the key/value "
                 "blocks going round %d ranks",
                 2 * R, T / (2 * R), 2 * R - 1, R);
    ht_log_info("Context parallelism over %d ranks (Ulysses %d x ring %d): each holds %d of every sequence's %d "
                "tokens, rotated at their global positions%s",
                U * R, U, R, T / (U * R), T, ring);
    if (U > 1)
        ht_log_info("  Ulysses: q, k, v all-to-all into the %d tokens of each ring rank's chunks, %d heads and %d "
                    "key/value heads a rank, the output back",
                    T / R, H / U, KV / U);
    return HT_OK;
}

/* The FSDP units (fsdp_config.apply_modules / parallel.fsdp_plan.apply_modules), pointing into apply and
 * ep_modules (HT_CONFIG_LIST_MAX each). */
static ht_fsdp_options fsdp_options(const ht_trainer *t, const char **apply, const char **ep_modules) {
    const ht_config *c = &t->config;
    for (int i = 0; i < c->fsdp.apply_modules.count; i++) apply[i] = c->fsdp.apply_modules.items[i];
    /* reduce_dtype null (HyperParallel's dialect leaves it so): FSDP2's rule, the reduction in param_dtype. */
    ht_fsdp_options fo = {.apply_modules = apply,
                          .apply_count = c->fsdp.apply_modules.count,
                          .reshard_after_forward = c->fsdp.reshard_after_forward,
                          .prefetch = c->fsdp.prefetch,
                          .reduce_dtype = c->fsdp.reduce_dtype == HT_CONFIG_DTYPE_NONE ? c->fsdp.param_dtype
                                                                                       : c->fsdp.reduce_dtype};
    if (t->par.ep) {
        for (int i = 0; i < c->parallel.ep_modules.count; i++) ep_modules[i] = c->parallel.ep_modules.items[i];
        fo.expert_group = t->par.expert;
        /* in the shard group's numbering (expert parallelism shards over all the data x context ranks) */
        fo.expert_first = t->par.shard->rank / t->par.expert->size * t->par.expert->size;
        fo.expert_modules = ep_modules;
        fo.expert_count = c->parallel.ep_modules.count;
    }
    return fo;
}

/* fsdp_config.mix_precision: the precision forward and backward compute in, and the logits'. */
static ht_status set_compute(ht_trainer *t, ht_error *err) {
    const ht_config *c = &t->config;
    ht_status s = ht_model_set_compute(t->model, c->fsdp.param_dtype, err);
    if (s != HT_OK) return s;
    const char *apply[HT_CONFIG_LIST_MAX], *ep_modules[HT_CONFIG_LIST_MAX];
    const ht_fsdp_options fo = fsdp_options(t, apply, ep_modules);
    s = ht_fsdp_create(t->model, t->par.shard, &fo, &t->fsdp, err);
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
    if (t->par.ep) {
        const ht_moe_config *mc = &t->model->config.moe;
        if (t->comm->rank == 0)
            ht_log_info("Expert parallelism: groups of %d ranks split the %d experts of each sparse layer (%d per "
                        "rank), the tokens' rows exchanged all-to-all; the ranks holding the same experts (%d "
                        "consecutive ones) shard them and reduce their gradients",
                        t->par.ep->size, mc->num_experts, mc->num_experts / t->par.ep->size, t->par.expert->size);
    }
    const ht_param *p = &t->model->params.items[0];
    ht_log_info("Model: %.2fM parameters stored in %s, computing in %s%s; GEMM: %s",
                (double)ht_params_total_numel(&t->model->params) / 1e6, ht_dtype_name(p->dtype),
                ht_dtype_name(c->fsdp.param_dtype),
                p->compute_dtype != p->compute_precision ? " (FP32 operands of that precision)" : "",
                ht_kernels_gemm_name(p->compute_precision));
    return HT_OK;
}

static ht_main_storage main_storage(const ht_config *c) {
    if (!c->optimizer.fp32_main_params) return HT_MAIN_NONE;
    return c->optimizer.main_param_storage == HT_CONFIG_MAIN_RESIDUAL16 ? HT_MAIN_RESIDUAL16 : HT_MAIN_COPY;
}

/* The buffer src/comm/mpi.c keeps for a group's largest FP32 sum of n
 * floats on rank `me` of P: every rank's contribution to this rank's slice,
 * (P, mine) floats, the slices n·r/P balanced and n taken in pieces of 2^22
 * (ht_alloc's rounding and header included). None for a group of one. */
static double sum_scratch_bytes(int64_t n, int me, int P) {
    if (P <= 1 || n <= 0) return 0.0;
    const int64_t len = n < ((int64_t)1 << 22) ? n : (int64_t)1 << 22;
    const int64_t mine = len * (me + 1) / P - len * me / P;
    return (double)ht_align64((size_t)P * (size_t)(mine ? mine : 1) * sizeof(float)) + 64.0;
}

/* The comm layer's buffers on this rank (each group keeps the largest its sums needed): the replicas' FP32
 * all-reduce of main_grad (HSDP or replicated data parallelism; a 16-bit reduce_dtype goes through FSDP's
 * pool instead), the tensor-parallel group's row-parallel sums (B x Tc tokens of hidden_size), the tied
 * embedding's gradient over the first and last stages. */
static double collective_bytes(const ht_trainer *t, double grad_bytes) {
    const ht_config *c = &t->config;
    const ht_parallel *par = &t->par;
    const ht_dtype reduce = c->fsdp.reduce_dtype == HT_CONFIG_DTYPE_NONE ? c->fsdp.param_dtype : c->fsdp.reduce_dtype;
    double bytes = 0.0;
    if (reduce == HT_DTYPE_F32)
        bytes += sum_scratch_bytes((int64_t)(grad_bytes / sizeof(float)), par->replica->rank, par->replica->size);
    bytes += sum_scratch_bytes((int64_t)t->B * t->Tc * t->model->config.hidden_size, par->tp->rank, par->tp->size);
    int64_t tied = 0;
    for (int i = 0; i < t->model->params.count; i++) {
        const ht_param *p = &t->model->params.items[i];
        if (p->stage_tied && p->trainable && ht_param_local_numel(p) > tied) tied = ht_param_local_numel(p);
    }
    return bytes + sum_scratch_bytes(tied, par->tied->rank, par->tied->size);
}

/* What a rank's libraries take as its steps run, beyond the process at the
 * trainer's start and every allocation the trainer makes: code paged in
 * (oneDNN's, the kernels', libgomp's), oneDNN's JIT code and per-thread
 * scratchpads, the OpenMP threads' stacks and malloc arenas, the heap's
 * small allocations and, under MPI, its transports' buffers. No formula of
 * the config gives them: measured (docs/DESIGN.md, The memory plan) as the
 * peak RSS less the process at start and every other category, on
 * configs/default.yaml's model, 2 steps of 2 x 256 tokens, oneDNN 2.6.3,
 * glibc 2.36, Open MPI 4.1.4 over TCP, an Intel Xeon @ 2.60GHz (Ice Lake,
 * 2 cores): 16.5 MiB on one process; 19.1 and 20.5 MiB on the 2 ranks of
 * replicated data parallelism, 3.3 MiB more a rank under MPI. Not scaled by
 * the model or the ranks: 13-24 MiB a rank on every mesh of 1-8 ranks
 * measured since (bench/RESULTS.md). */
static const double RUNTIME_MIB = 16.5, RUNTIME_MPI_MIB = 3.3;

/* What MPI's start (MPI_Init: libmpi's pages touched, its shared-memory and
 * TCP endpoints to the other ranks) adds to a rank's resident memory, which
 * hypertrain plan, run without MPI, cannot measure on itself: VmRSS before
 * and after MPI_Init, as above: 7.5 MiB a rank on 2 ranks, 9.6 on 4 and 8. */
static const double MPI_START_MIB = 7.5, MPI_START_WIDE_MIB = 9.6;

double ht_memory_plan_total(const ht_memory_plan *m) {
    return m->process + m->weights + m->main + m->grad + m->optimizer + m->units + m->activations + m->collectives +
           m->corpus + m->runtime;
}

/* What this rank takes (ht_memory_plan), from the declared model and the
 * opened data, against this machine's memory shared by the ranks on it,
 * before any of it is allocated: the process as it started, the weights,
 * their FP32 main params and main_grad, the optimizer state, FSDP's whole
 * units, one micro-batch's activations and the comm layer's buffers (the
 * bytes their allocations will take), the corpus and the runtime's
 * allowance. Every rank agrees on the largest plan (one all-reduce), and
 * all refuse it together: a run refused here could not run.
 * `compute`: the storage of the compute copies, as ht_model_set_compute will
 * make them once the GEMM kernel is chosen (an FP32 copy of bf16 values where
 * it is fp32_rounded); before, param_dtype's own (no copy): a lower bound. */
static ht_status plan_memory(ht_trainer *t, ht_dtype compute, ht_error *err) {
    const ht_config *c = &t->config;
    const ht_param_store *ps = &t->model->params;
    const ht_params_bytes pb = ht_params_plan(ps, main_storage(c), compute, c->fsdp.param_dtype);
    const char *apply[HT_CONFIG_LIST_MAX], *ep_modules[HT_CONFIG_LIST_MAX];
    const ht_fsdp_options fo = fsdp_options(t, apply, ep_modules);
    const double units = ht_fsdp_plan_bytes(t->model, t->par.shard, &fo, compute, c->fsdp.param_dtype, t->par.replica,
                                            (int64_t)(pb.grad / sizeof(float)), t->grad_accum, t->eval_B > 0, err);
    if (units < 0) return err->status;
    const bool mpi = t->comm->size > 1, guessed = t->planning && mpi; /* plan: no MPI of its own to measure */
    const double mib = 1 << 20;
    ht_memory_plan *m = &t->memory_plan;
    *m = (ht_memory_plan){
        .process =
            t->rss_at_start + (guessed ? (t->comm->local_size > 2 ? MPI_START_WIDE_MIB : MPI_START_MIB) * mib : 0),
        .weights = (double)(pb.data + pb.compute),
        .main = (double)pb.main,
        .grad = (double)pb.grad,
        .optimizer = (double)ht_optimizer_plan_bytes(ps, &t->optimizer_config),
        .units = units,
        .activations = ht_model_activation_bytes(t->model, t->B, t->Tc, compute) +
                       (double)ht_pipeline_buffer_bytes(&t->pipe), /* every slot's, and what crosses stages */
        .collectives = collective_bytes(t, (double)pb.grad),
        .corpus = t->data ? (double)t->data->n_tokens * sizeof(*t->data->tokens) : 0.0,
        .runtime = (RUNTIME_MIB + (mpi ? RUNTIME_MPI_MIB : 0)) * mib,
    };
    enum { N = 7 };
    double most[N] = {ht_memory_plan_total(m), m->weights, m->main, m->grad, m->optimizer, m->activations, m->corpus};
    ht_all_reduce_f64(t->comm, most, N, HT_REDUCE_MAX); /* each the most of any rank */
    if (t->planning) return HT_OK;                      /* hypertrain plan weighs it against its own budget */
    const int local = t->comm->local_size > 0 ? t->comm->local_size : 1;
    const double have = (double)ht_physical_memory(), gib = 1 << 30;
    if (most[0] * local <= have) return HT_OK;
    char acts[64], ranks[96] = "";
    if (isinf(most[5]))
        snprintf(acts, sizeof(acts), "more bytes than 64 bits count");
    else
        snprintf(acts, sizeof(acts), "%.1f GiB", most[5] / gib);
    if (local > 1) snprintf(ranks, sizeof(ranks), ", shared by the %d ranks on it (the most of any rank each)", local);
    const bool batch = most[5] >= most[0] / 2; /* the activations are most of it */
    ht_status s = ht_fail(
        err, HT_ERR_CONFIG,
        "the run needs at least %.1f GiB a rank, more than this machine's %.1f GiB of memory%s: weights %.2f GiB "
        "(%s), FP32 main params %.2f, main_grad %.2f, optimizer state %.2f, corpus %.2f, and the activations of one "
        "micro-batch, training.local_batch_size %d x data.seq_len %d, %s (%d layers of model.hidden_size %d, "
        "intermediate_size %d): %s",
        isinf(most[0]) ? INFINITY : most[0] / gib, have / gib, ranks, most[1] / gib,
        ht_dtype_name(ps->count ? ps->items[0].dtype : HT_DTYPE_F32), most[2] / gib, most[3] / gib, most[4] / gib,
        most[6] / gib, t->B, t->T, acts, t->model->config.num_hidden_layers, t->model->config.hidden_size,
        t->model->config.intermediate_size,
        batch ? "lower training.local_batch_size (more accumulation steps keep training.global_batch_size) or "
                "data.seq_len, or set model.recompute"
              : "shard the model over more ranks (fsdp_config.shard_size), store it in 16 bits (model_init_dtype), "
                "or train less of it (model.freeze, model.lora)");
    err->everywhere = t->comm->size > 1;
    return s;
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
    t->Tc = t->T / t->par.cp_size;
    /* Every data-parallel replica takes its own local batches of each global
     * batch (the loader's rank split); the ranks of a context-parallel group
     * read the same ones. */
    int world = t->par.dp_size, rank = t->par.dp_rank;
    size_t train_tokens = ht_dataset_split_tokens(t->data, HT_SPLIT_TRAIN);
    size_t windows = train_tokens > 0 ? (train_tokens - 1) / (size_t)t->T : 0, wanted = (size_t)world * (size_t)t->B;
    if (windows < wanted)
        return ht_fail(err, HT_ERR_CONFIG,
                       "training.local_batch_size %d on %d data-parallel rank%s takes %zu sequences of data.seq_len + "
                       "1 = %d tokens a micro-batch, but the train split of data.path %s has %zu tokens: %zu such "
                       "windows",
                       t->B, world, world == 1 ? "" : "s", wanted, t->T + 1, c->data.path, train_tokens, windows);
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
    if (t->par.cp_size > 1) {
        t->share_inputs = ht_alloc((size_t)t->B * (size_t)t->Tc * sizeof(int32_t));
        t->share_targets = ht_alloc((size_t)t->B * (size_t)t->Tc * sizeof(int32_t));
        if (!t->share_inputs || !t->share_targets) return ht_fail(err, HT_ERR_OOM, "cannot allocate batch buffers");
    }
    return HT_OK;
}

_Static_assert((int)HT_CONFIG_LR_CONSTANT_WARMUP == (int)HT_LR_CONSTANT_WARMUP &&
                   (int)HT_CONFIG_LR_COSINE_ANNEALING == (int)HT_LR_COSINE_ANNEALING &&
                   (int)HT_CONFIG_LR_WARMUP_STABLE_DECAY == (int)HT_LR_WSD &&
                   (int)HT_CONFIG_LR_CONSTANT_COOLDOWN == (int)HT_LR_CONSTANT_COOLDOWN &&
                   (int)HT_CONFIG_LR_COSINE_WARM_RESTARTS == (int)HT_LR_COSINE_WARM_RESTARTS &&
                   (int)HT_CONFIG_LR_WISE_LAYER == (int)HT_LR_WISE_LAYER,
               "the config's and the optimizer's schedule enums must follow docs/NUMERICS.md's order");

void ht_train_lr_schedule(ht_lr_schedule *sc, const ht_config *c, double base_lr) {
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
    /* A segmented schedule ([[a, b, c], n], ...) runs its own length; muon_ns_steps bounds it from below
     * only when it was given (the config's rule, validate.c), never as its default 5. */
    int line, steps = c->optimizer.muon.ns_steps, length = 0;
    for (int i = 0; i < nc->count; i++) length += nc->repeat[i];
    bool segmented = nc->count > 1 || (nc->count == 1 && nc->repeat[0] > 0);
    if (segmented && length >= 1 &&
        ht_config_key_source(c, "optimizer.muon_config.muon_ns_steps", &line) == HT_CONFIG_SOURCE_DEFAULT)
        steps = length;
    ht_status s =
        ht_ns_schedule_expand(variants[c->optimizer.muon.ns_variant], steps, segments, nc->count, &mc->schedule, err);
    static const ht_ns_form forms[] = {[HT_CONFIG_NS_STANDARD] = HT_NS_FORM_STANDARD,
                                       [HT_CONFIG_NS_GRAM] = HT_NS_FORM_GRAM,
                                       [HT_CONFIG_NS_TORCH] = HT_NS_FORM_TORCH};
    mc->schedule.form = forms[c->optimizer.muon.ns_form];
    return s;
}

/* QK-clip sees each layer's q/k projections (found by their Hugging Face names) and its head layout. */
static ht_status build_qk_table(ht_trainer *t, ht_error *err) {
    const ht_model_config *a = &t->model->config;
    t->qk_layers = calloc((size_t)a->num_hidden_layers, sizeof(ht_qk_layer));
    if (!t->qk_layers) return ht_fail(err, HT_ERR_OOM, "cannot allocate the QK-clip table");
    for (int l = 0; l < a->num_hidden_layers; l++) {
        /* Tensor parallelism: this rank's heads, whose rows its slices of the projections hold. */
        t->qk_layers[l].num_heads = a->num_attention_heads / t->par.tp_size;
        t->qk_layers[l].num_kv_heads = a->num_key_value_heads / t->par.tp_size;
        t->qk_layers[l].head_dim = ht_model_config_head_dim(a);
    }
    /* The layers of this rank's pipeline stage (all of them with one): the others' are another rank's to clip. */
    for (int l = 0; l < a->num_hidden_layers; l++) {
        if (!ht_pipeline_holds_layer(&t->model->stage, l)) continue;
        char name[HT_PARAM_NAME_MAX];
        ht_param_store *ps = &t->model->params;
#define FIND(field, suffix)                                                                                            \
    snprintf(name, sizeof(name), "model.layers.%d.self_attn.%s", l, suffix);                                           \
    t->qk_layers[l].field = ht_params_find(ps, name)
        ht_qk_layer *q = &t->qk_layers[l];
        if (ht_model_config_has_mla(a)) {
            /* MLA: the queries' last projection and kv_b_proj's k_nope rows (its v rows and kv_a_proj_with_mqa's
             * shared rotary key stay). */
            FIND(q_weight, a->mla.q_lora_rank > 0 ? "q_b_proj.weight" : "q_proj.weight");
            FIND(kv_b, "kv_b_proj.weight");
            q->k_weight = q->kv_b;
            q->nope = a->mla.qk_nope_head_dim, q->rope = a->mla.qk_rope_head_dim, q->v_dim = a->mla.v_head_dim;
        } else {
            FIND(q_weight, "q_proj.weight");
            FIND(q_bias, "q_proj.bias");
            FIND(k_weight, "k_proj.weight");
            FIND(k_bias, "k_proj.bias");
        }
#undef FIND
        if (!t->qk_layers[l].q_weight || !t->qk_layers[l].k_weight)
            return ht_fail(err, HT_ERR_CONFIG,
                           "optimizer.muon_config.qk_clip_enabled: layer %d has no query/key projection "
                           "weights to clip",
                           l);
        /* QK-clip rescales the weights' FP32 main params: frozen ones have none and must not change. */
        if (!t->qk_layers[l].q_weight->trainable || !t->qk_layers[l].k_weight->trainable)
            return ht_fail(err, HT_ERR_CONFIG,
                           "optimizer.muon_config.qk_clip_enabled: layer %d's query/key projection weights are "
                           "frozen (%s), and QK-clip rescales them: set qk_clip_enabled false",
                           l, t->config.model.lora.rank > 0 ? "model.lora trains the adapters alone" : "model.freeze");
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
            ht_log_warn_once("%s: \"%s\" matches no parameter (names look like %s, or in MindFormers' spelling "
                             "decoder.layers.0.self_attention.linear_qkv.weight)",
                             ht_config_key_spelling(&t->config, key), patterns->items[k],
                             ps->count > 1 ? ps->items[1].name
                             : ps->count   ? ps->items[0].name
                                           : "?");
    }
}

/* An error of a layer below config that names a key by its canonical name:
 * named as the run's config wrote it (an alias: optimizer.comm_strategy). */
static ht_status name_as_written(const ht_config *c, ht_error *err, const char *key) {
    const char *spelling = ht_config_key_spelling(c, key), *at = strstr(err->msg, key);
    if (!spelling || strcmp(spelling, key) == 0 || !at) return err->status;
    char msg[sizeof(err->msg)];
    snprintf(msg, sizeof(msg), "%.*s%s%s", (int)(at - err->msg), err->msg, spelling, at + strlen(key));
    memcpy(err->msg, msg, sizeof(msg));
    return err->status;
}

/* The optimizer's configuration, before the params have storage (plan_memory sizes its state by it). */
static ht_status configure_optimizer(ht_trainer *t, ht_error *err) {
    const ht_config *c = &t->config;
    ht_optimizer_config oc = {0};
    oc.use_muon = c->optimizer.type == HT_CONFIG_OPTIMIZER_MUON;
    oc.comm = t->par.shard; /* the norm and Muon's matrices span a shard group; replicas hold the same rows */
    oc.replicas = t->par.sharded ? t->par.replica : NULL;
    oc.tp = t->par.tp;
    oc.stages = t->par.pp;
    oc.fp32_main_params = c->optimizer.fp32_main_params;
    oc.residual16 = c->optimizer.main_param_storage == HT_CONFIG_MAIN_RESIDUAL16;
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
    const bool deepseek = ht_model_config_is_deepseek(&t->model->config);
    if (oc.use_muon && t->model->config.moe.num_experts > 0) {
        t->adamw_include[oc.adamw_include_count++] = "*.mlp.gate.weight";
        t->adamw_include[oc.adamw_include_count++] = "*.mlp.shared_expert_gate.weight";
        if (t->comm->rank == 0)
            ht_log_info("%s: the routers (*.mlp.gate.weight)%s go to AdamW%s; the experts' 3-D weights to Muon, one "
                        "matrix per expert, unless optimizer.muon_config.adamw_include matches them",
                        t->model->config.name,
                        ht_model_config_is_deepseek(&t->model->config) ? "" : " and shared expert gates",
                        ht_model_config_is_deepseek(&t->model->config)
                            ? ", their e_score_correction_bias to no optimizer (it is not trained by gradients)"
                            : "");
    }
    /* DeepSeek-V3's aux-loss-free balancing (ht_trainer_step's count_expert_tokens). */
    const bool balanced = deepseek && ht_model_config_sparse_layers(&t->model->config) > 0;
    if (balanced && t->model->config.moe.bias_update_rate > 0 && !t->model->expert_tokens)
        return ht_fail(err, HT_ERR_CONFIG,
                       "model.moe_router_bias_update_rate %g: model '%s' does not count the tokens each expert is "
                       "routed (ht_model.expert_tokens), which the bias update needs",
                       t->model->config.moe.bias_update_rate, t->model->config.name);
    if (balanced && t->comm->rank == 0) {
        if (t->model->config.moe.bias_update_rate > 0)
            ht_log_info("deepseek_v3: aux-loss-free balancing, rate %g, over the global batch: after every step each "
                        "sparse layer's e_score_correction_bias moves by +rate for the experts that got fewer tokens "
                        "than the mean over all %d rank(s), -rate for those that got more (Megatron-Core's "
                        "get_updated_expert_bias)",
                        t->model->config.moe.bias_update_rate, t->comm->size);
        else
            ht_log_info("deepseek_v3: the correction biases stay as loaded (%s 0)",
                        ht_config_key_spelling(c, "model.moe_router_bias_update_rate"));
    }
    if (oc.use_muon && ht_model_config_has_mla(&t->model->config) && t->comm->rank == 0)
        ht_log_info("deepseek_v3: Multi-Latent Attention's projections (%s, kv_a_proj_with_mqa, kv_b_proj, "
                    "o_proj) go to Muon, q_a_layernorm and kv_a_layernorm to AdamW",
                    t->model->config.mla.q_lora_rank > 0 ? "q_a_proj, q_b_proj" : "q_proj");
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
    ht_train_lr_schedule(&oc.adamw_schedule, c, oc.adamw.lr);
    ht_train_lr_schedule(&oc.muon_schedule, c, oc.muon.lr);
    oc.max_norm = c->training.max_norm;
    /* float16 models train with a dynamic loss scale (docs/NUMERICS.md). */
    oc.loss_scaling = t->model->params.items[0].dtype == HT_DTYPE_F16;
    ht_loss_scaler_init(&oc.scaler, c->training.loss_scale_initial, c->training.loss_scale_growth_factor,
                        c->training.loss_scale_backoff_factor, c->training.loss_scale_growth_interval,
                        c->training.loss_scale_hysteresis, c->training.loss_scale_min);
    oc.stochastic_rounding = c->optimizer.stochastic_rounding;
    oc.seed = (uint64_t)c->training.seed;
    t->optimizer_config = oc;
    return HT_OK;
}

static ht_status build_optimizer(ht_trainer *t, ht_error *err) {
    const ht_config *c = &t->config;
    const ht_optimizer_config oc = t->optimizer_config;
    if (oc.use_muon) ht_config_log_section(c, "muon", "optimizer.muon_config.");
    ht_config_log_section(c, "adamw", "optimizer.adamw_config.");
    ht_status s = ht_optimizer_init(&t->optimizer, &t->model->params, &oc, err);
    if (s != HT_OK) return name_as_written(c, err, "optimizer.muon_config.muon_comm_strategy");
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

/* The mesh (docs/DESIGN.md, The mesh; ht_mesh_of): the world W = DP x CP x
 * TP, Megatron's order. FSDP shards over DP x CP (the CP ranks' gradients
 * sum like data-parallel ones): fsdp_config.shard_size S (auto: all of them)
 * splits them into shard groups of S consecutive ones and S replicate groups
 * (HSDP). Expert parallelism is carved out of DP x CP too. */
static ht_status make_groups(ht_trainer *t, ht_error *err) {
    const ht_config *c = &t->config;
    const ht_mesh_sizes sizes = {.world = t->comm->size,
                                 .tp = c->parallel.tensor_parallel_size,
                                 .ulysses = c->parallel.ulysses_parallel_size,
                                 .ring = c->parallel.ring_attention_size,
                                 .ep = c->parallel.expert_parallel_size,
                                 .shard = c->fsdp.shard_size,
                                 .pp = c->parallel.pipeline_parallel_size};
    ht_status s = ht_parallel_init(&t->par, &sizes, t->comm, err);
    if (s == HT_OK && t->comm->rank == 0 && t->comm->size > 1) ht_parallel_log(&t->par); /* said once */
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
        {"parallel.sequence_parallel", c->parallel.tensor_parallel_size > 1,
         "it applies with parallel.tensor_parallel_size > 1 (1 here)"},
        {"parallel.pipeline_schedule", c->parallel.pipeline_parallel_size > 1,
         "it applies with parallel.pipeline_parallel_size > 1 (1 here: each forward and its backward in turn)"},
    };
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
        int line;
        if (keys[i].applies || ht_config_key_source(c, keys[i].key, &line) == HT_CONFIG_SOURCE_DEFAULT) continue;
        ht_log_info("%s: accepted, not applicable here: %s", ht_config_key_spelling(c, keys[i].key), keys[i].why);
    }
}

/* kernels.backend: the process's kernel table from here until ht_trainer_free. */
static ht_status use_backend(ht_trainer *t, ht_error *err) {
    const ht_kernel_ops *K = ht_kernels_cpu();
    if (t->config.kernels.backend == HT_KERNELS_FENCED) K = ht_kernels_fenced();
    if (t->config.kernels.backend == HT_KERNELS_CUDA) {
        ht_error why = {0};
        if (!(K = ht_kernels_cuda(&why)))
            return ht_fail(err, HT_ERR_CONFIG, "kernels.backend: cuda: %s; expected cpu on this machine", why.msg);
        /* training.deterministic: the choices made by timing made by rule: attention's (cuDNN's fused
         * attention or the own kernels, whose backward alone repeats bit for bit) the own kernels, each
         * product's cuBLASLt algorithm the heuristic's first (the same in every process) */
        if (t->config.training.deterministic) {
            ht_kernels_cuda_set_attention(HT_CUDA_ATTENTION_OWN);
            ht_kernels_cuda_set_gemm(HT_CUDA_GEMM_HEURISTIC);
        }
    }
    /* training.trace: the profiled table over it, so that the traced steps
     * show each entry (the same bits; every entry waited for). */
    ht_kernels_use(t->config.training.trace.on ? ht_kernels_profiled(K) : K);
    if (K->host_memory) return HT_OK;
    /* MPI's collectives read and write host memory: every group the trainer
     * splits comes from a staged one, and on CUDA from an NCCL group over
     * it where NCCL opens (the device's memory GPU to GPU). */
    ht_comm *staged;
    ht_status s = ht_comm_staged(t->world, K, false, &staged, err);
    if (s != HT_OK) return s;
    t->comm = staged;
    ht_error why = {0};
    if (K != ht_kernels_fenced() && t->world->size > 1) {
        ht_comm *nccl;
        if (ht_comm_nccl(staged, true, &nccl, &why) == HT_OK) t->comm = nccl;
    }
    char how[sizeof(why.msg) + 128] = "";
    if (t->comm != staged)
        snprintf(how, sizeof(how), "; the collectives of its memory over NCCL, GPU to GPU");
    else if (t->world->size > 1)
        snprintf(how, sizeof(how), "; the collectives stage its memory through host buffers%s%s%s",
                 why.msg[0] ? " (no NCCL: " : "", why.msg, why.msg[0] ? ")" : "");
    if (t->comm->rank == 0)
        ht_log_info("Kernels: the %s backend%s%s", K->name,
                    K == ht_kernels_fenced() ? " (the CPU's kernels on memory the host cannot touch between them)" : "",
                    how);
    return HT_OK;
}

/* The order a step's micro-batches run in on this rank's stage
 * (parallel.pipeline_schedule; one stage: each forward and its backward in
 * turn, as gradient accumulation does) and the buffers between stages. */
static ht_status make_pipeline(ht_trainer *t, ht_error *err) {
    const ht_config *c = &t->config;
    const int P = t->par.pp_size, m = t->grad_accum, B = t->B > t->eval_B ? t->B : t->eval_B;
    const int V = t->model->stage.chunks;
    const bool gpipe = P > 1 && c->parallel.pipeline_schedule == HT_CONFIG_PP_GPIPE;
    ht_status s = ht_pipeline_init(&t->pipe, gpipe ? HT_PIPE_GPIPE : HT_PIPE_1F1B, t->par.pp, V, m,
                                   (int64_t)B * t->Tc * t->model->config.hidden_size, t->model->stage_sums_count, err);
    if (s == HT_OK) t->model->slots = t->pipe.slots; /* the activations the plan and the run size */
    if (s != HT_OK || P == 1 || t->comm->rank != 0 || t->planning) return s;
    char stages[2048] = "";
    for (int q = 0; q < P && strlen(stages) + 160 < sizeof(stages); q++) {
        const ht_pipeline_stage st = ht_pipeline_stage_of(t->model->config.num_hidden_layers, P, V, q);
        snprintf(stages + strlen(stages), sizeof(stages) - strlen(stages), "%s%d:", q ? "; " : "", q);
        for (int k = 0; k < V; k++) {
            int first, end;
            ht_pipeline_chunk_layers(&st, k, &first, &end);
            snprintf(stages + strlen(stages), sizeof(stages) - strlen(stages),
                     end - first > 1 ? "%s layers %d-%d" : "%s layer %d", k ? "," : "", first, end - 1);
        }
        snprintf(stages + strlen(stages), sizeof(stages) - strlen(stages), "%s%s", st.first ? " and the embedding" : "",
                 st.last ? " and the final norm, LM head and loss" : "");
    }
    char chunks[64] = "";
    if (V > 1) snprintf(chunks, sizeof(chunks), " interleaved, %d chunks a stage", V);
    ht_log_info("Pipeline parallel %d (%s%s, %d micro-batches a step: the gradient accumulation; bubble "
                "(P - 1) / (V m + P - 1) = %.0f%%): stage %s; stage 0 keeps %d micro-batches' activations at once",
                P, gpipe ? "gpipe" : "1f1b", chunks, m, 100.0 * (P - 1) / (V * m + P - 1), stages, t->pipe.slots);
    return HT_OK;
}

/* The model's expert- and context-parallel exchanges, once the batch is
 * known and before the memory plan: what forward sizes depends on them. */
static ht_status attach_exchanges(ht_trainer *t, ht_error *err) {
    if (t->par.ep) {
        ht_status s = check_experts(t, err);
        if (s != HT_OK) return s;
        ht_expert_parallel_attach(t->model, t->par.ep);
    }
    return t->par.cp_size > 1 ? attach_context(t, err) : HT_OK;
}

/* Everything a run decides before it allocates: the config in force, the
 * groups, the declared model, the data, the optimizer's routing, the GEMM
 * kernels and the memory plan (ht_trainer_init and ht_trainer_plan). */
static ht_status prepare(ht_trainer *t, const ht_config *cfg, ht_comm *comm, bool planning, ht_error *err) {
    memset(t, 0, sizeof(*t));
    t->config = *cfg;
    t->comm = t->world = comm;
    t->planning = planning;
    ht_parallel_single(&t->par, comm);
    t->last_eval_loss = NAN;
    t->rss_at_start = rss_now();
    /* Every rank validates the same config before any collective: all fail, or none. */
    ht_status s = ht_config_validate(cfg, comm->size, err);
    if (s == HT_OK) s = use_pretrained(t, err);
    if (s == HT_OK && comm->rank == 0 && !planning) {
        ht_config_log(&t->config); /* the values in force: model.from_pretrained's architecture included */
        log_not_applicable(cfg);
    }
    if (s == HT_OK) ht_comm_set_timeout(comm, cfg->training.distributed_timeout_minutes * 60.0);
    if (s == HT_OK) s = check_same_config(t, err);
    if (s == HT_OK && !planning) s = use_backend(t, err); /* a plan counts bytes, wherever they would live */
    if (s == HT_OK) s = make_groups(t, err);
    if (s == HT_OK) s = declare_model(t, err);
    /* The batch against the data, then the memory all of it takes against the machine's, before the model's
     * storage, its optimizer state or anything sized by the batch is allocated. */
    if (s == HT_OK) s = open_data(t, err);
    if (s == HT_OK) s = attach_exchanges(t, err);
    if (s == HT_OK) s = configure_optimizer(t, err);
    if (s == HT_OK) s = make_pipeline(t, err);
    /* The plan without the compute copies (a lower bound: a run it refuses could not run) before the GEMM
     * kernels are timed on the model's shapes, then with the copies the chosen kernel makes. */
    if (s == HT_OK) s = plan_memory(t, cfg->fsdp.param_dtype, err);
    if (s == HT_OK) s = choose_kernels(t, err);
    if (s == HT_OK) s = plan_memory(t, ht_kernels_storage(cfg->fsdp.param_dtype), err);
    return s;
}

ht_status ht_trainer_plan(ht_trainer *t, const ht_config *cfg, ht_comm *world, ht_error *err) {
    ht_status s = prepare(t, cfg, world, true, err);
    if (s != HT_OK) ht_trainer_free(t);
    return s;
}

ht_status ht_trainer_init_on(ht_trainer *t, const ht_config *cfg, ht_comm *comm, ht_error *err) {
    ht_status s = prepare(t, cfg, comm, false, err);
    if (s == HT_OK) s = allocate_model(t, err);
    /* fsdp_config.mix_precision.param_dtype: the dtype forward and backward compute with. */
    if (s == HT_OK) s = set_compute(t, err);
    if (s == HT_OK) s = build_optimizer(t, err);
    if (s == HT_OK) s = ht_pipeline_allocate(&t->pipe, err);
    if (s == HT_OK && cfg->checkpoint.restore_from[0])
        s = ht_trainer_restore(t, cfg->checkpoint.restore_from, cfg->checkpoint.restore_optimizer, err);
    if (s == HT_OK) s = ht_run_dir_check(cfg, t->step, comm, err);
    if (s != HT_OK) ht_trainer_free(t);
    return s;
}

void ht_trainer_free(ht_trainer *t) {
    if (t->metrics) fclose(t->metrics);
    if (t->trace) fclose(t->trace);
    if (t->samples) fclose(t->samples);
    ht_tokenizer_free(t->sample_tokenizer);
    ht_trace_stop();
    if (t->events) { /* a run that failed: what it wrote stays, its error was the run's */
        ht_error ignored;
        (void)ht_events_close(t->events, &ignored);
        free(t->events);
    }
    ht_optimizer_free(&t->optimizer);
    ht_pipeline_free(&t->pipe);
    ht_fsdp_free(t->fsdp);
    free(t->qk_layers);
    ht_loader_free(&t->train_loader);
    ht_loader_free(&t->valid_loader);
    ht_dataset_free(t->data);
    ht_model_free(t->model);
    ht_model_free(t->whole);
    ht_free(t->batch);
    free(t->micro_tokens);
    ht_free(t->inputs);
    ht_free(t->targets);
    ht_free(t->share_inputs);
    ht_free(t->share_targets);
    ht_parallel_free(&t->par);
    if (t->comm != t->world) ht_comm_free(t->comm);
    ht_comm *comm = t->world;
    memset(t, 0, sizeof(*t));
    t->comm = t->world = comm;
    ht_kernels_use(NULL); /* everything of kernels.backend's is freed */
}
