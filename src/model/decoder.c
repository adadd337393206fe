/* The Qwen2/Llama/Qwen2-MoE/DeepSeek-V3 decoder: named parameters with
 * Hugging Face names, the forward pass and a hand-written backward pass. Matmul inputs are stored in
 * the weights' dtype (bf16 weights -> bf16 x bf16 GEMMs with FP32
 * accumulation); the residual stream, norms, softmax and loss are FP32.
 * Gradients accumulate (+=) into each parameter's full FP32 grad (its main_grad
 * unless the store is sharded).
 *
 * Shapes: B batch, T sequence, N = B*T tokens, C hidden, H query heads,
 * KV key/value heads, D head dim, F intermediate, V vocab, L layers.
 * Multi-Latent Attention (DeepSeek-V3): Dk = nope + rope per query/key head,
 * Dv per value head, every head its own key (KVh = H); Rq, Rkv the query and
 * key/value latents, Dr the rotary key shared by the heads. */
#include "model/decoder.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hypertrain/kernels.h"
#include "model/context.h"
#include "model/moe.h"

/* A layer's linear layers by their Hugging Face module names: the plain
 * attention's and the MLP's, then Multi-Latent Attention's. */
enum { LIN_Q = 0, LIN_K, LIN_V, LIN_O, LIN_GATE, LIN_UP, LIN_DOWN, LIN_QA, LIN_QB, LIN_KVA, LIN_KVB, LIN_COUNT };
enum { LIN_PLAIN = LIN_QA }; /* the linears before MLA's */
static const char *const LIN_MODULES[LIN_COUNT] = {
    "self_attn.q_proj",    "self_attn.k_proj",
    "self_attn.v_proj",    "self_attn.o_proj",
    "mlp.gate_proj",       "mlp.up_proj",
    "mlp.down_proj",       "self_attn.q_a_proj",
    "self_attn.q_b_proj",  "self_attn.kv_a_proj_with_mqa",
    "self_attn.kv_b_proj",
};

typedef struct layer_params {
    ht_param *ln1, *q_w, *q_b, *k_w, *k_b, *v_w, *v_b, *o_w; /* attention block */
    ht_param *qa_w, *qa_ln, *qb_w, *kva_w, *kva_ln, *kvb_w;  /* MLA's (q_w: its q_proj without q_lora_rank) */
    ht_param *ln2, *gate_w, *up_w, *down_w;                  /* MLP block (dense layers) */
    int sparse; /* the layer's index among the sparse layers (qwen2_moe), -1: the dense MLP */
    ht_param *lora_a[LIN_COUNT], *lora_b[LIN_COUNT]; /* model.lora: (r, in), (out, r); NULL: no adapter */
} layer_params;

/* What the forward pass keeps for the backward pass, per layer. "cd" buffers
 * hold matmul inputs in the compute dtype (the weights' dtype). */
typedef struct layer_acts {
    float *resid;     /* (N, C) the layer's input */
    float *rstd1;     /* (N) */
    void *ln1;        /* (N, C) cd */
    float *q;         /* (B, T, H, Dk) after bias and rotary */
    float *k;         /* (B, T, KVh, Dk) after bias and rotary */
    float *v;         /* (B, T, KVh, Dv) */
    float *o;         /* (B, T, H, Dv) attention output, FP32 */
    float *lse;       /* (B, H, T) log-sum-exp of each row of scores: the probabilities, recomputed in backward */
    void *att;        /* (N, H*Dv) cd: the o_proj input (o in cd) */
    float *qa;        /* MLA: (N, Rq) q_a_proj's output, the q_a_layernorm input */
    float *rstd_qa;   /* (N) */
    void *qa_ln;      /* (N, Rq) cd: the q_b_proj input */
    float *kv_lat;    /* (N, Rkv) the latent, the kv_a_layernorm input */
    float *rstd_kv;   /* (N) */
    void *kv_ln;      /* (N, Rkv) cd: the kv_b_proj input */
    float *resid_mid; /* (N, C) after the attention residual */
    float *rstd2;     /* (N) */
    void *ln2;        /* (N, C) cd */
    float *gate;      /* (N, F) */
    float *up;        /* (N, F) */
    void *h;          /* (N, F) cd: silu(gate) * up, the down_proj input */
    void *lora_h[LIN_COUNT]; /* (N, r) cd: each adapted linear's (dropped-out) input times lora_Aᵀ */
} layer_acts;

/* What one micro-batch's forward keeps for its backward (m->slots of them
 * under pipeline parallelism: the micro-batches a stage has forwarded and
 * not yet taken backward): its layers' activations and the tail's. */
typedef struct micro_slot {
    layer_acts *acts; /* (L), of which the stage's layers' are carved */
    float *resid_final, *rstdf, *logits;
    void *lnf;
    int32_t *inputs, *targets;
    ht_softmax_row *softmax_rows;
    int64_t target_count;
    uint64_t dropout_seed;
    int64_t dropout_first;
} micro_slot;

typedef struct decoder {
    int L, C, F, H, KV, D, V;
    /* Pipeline parallelism (m->stage): the layers [l0, l1) this model holds,
     * with the embedding (has_embed) and the final norm and LM head
     * (has_head); the whole model: [0, L) with both. */
    int l0, l1;
    bool has_embed, has_head;
    /* The attention as the kernel sees it: query/key and value head dims,
     * key/value heads, the logits' scale; the rotary dims (D, or MLA's Dr). */
    int Dk, Dv, KVh, rope_dim;
    float attn_scale;
    bool mla;
    int Rq, Rkv, Dn, Dr; /* MLA: q_lora_rank (0: q_proj), kv_lora_rank, qk_nope and qk_rope head dims */
    bool rope_interleave;
    ht_param *embed, *norm, *head; /* head == embed when the embeddings are tied */
    layer_params *layers;          /* (L) */
    ht_moe *moe;                   /* the sparse layers (NULL: none): the current micro-batch slot's */
    ht_moe **moes;                 /* (slot_count, at least 1) each slot's; moes[0] the model's own, the rest clones */
    int moe_count;
    float *cos_t, *sin_t; /* (max_position_embeddings, D/2) */
    /* The rows of the rotary tables this forward's tokens take: cos_t and
     * sin_t, or under context parallelism their rows at the positions this
     * rank's tokens hold (cp_cos, cp_sin: (T, D/2), for cp_T tokens). */
    const float *rope_cos, *rope_sin;
    float *cp_cos, *cp_sin;
    int cp_T;
    ht_cp_attention *cp; /* context parallelism's attention scratch (NULL: none) */
    /* Tensor parallelism (m->tensor; size 1: none): V and F above are this
     * rank's slices of the vocabulary and of the MLP width, H and KV its
     * heads; v0 the first token id of its vocabulary slice. */
    const ht_tensor_parallel *tp;
    int tp_size;
    int64_t v0;
    /* Sequence parallelism (m->tensor.sequence): the residual stream, the
     * norms and their outputs hold this rank's Ns = N / TP rows of the
     * tokens, the group's ranks the rows in rank order; without it Ns = N. */
    bool sp;
    int64_t Ns;
    const ht_context_parallel *context; /* the model's, and the size of its group */
    int cp_size;

    int B, T;                     /* the shapes the buffers below were sized for */
    size_t activation_bytes;      /* the block's */
    void *act_block;              /* one allocation carved into everything below */
    micro_slot *slots;            /* (slot_count) each micro-batch's, carved from act_block */
    layer_acts *all_acts;         /* (slot_count, L) the slots' acts */
    int slot_count, slot;         /* and the one the buffers below the slot's (acts .. softmax_rows) are */
    layer_acts *acts;             /* (L); a recomputed layer's share one set of buffers (all but resid) */
    int sized_generation;         /* the model's recompute_generation the buffers were carved for */
    size_t sized_cd;              /* the compute dtype's size they were carved for */
    float *resid_final;           /* (N, C) the last layer's output */
    float *rstdf;                 /* (N) */
    void *lnf;                    /* (N, C) cd */
    float *logits;                /* (head_rows, V); becomes dlogits in backward */
    int64_t head_rows;            /* the tokens the LM head and the loss take at once: N, or a chunk (chunk_rows) */
    int32_t *inputs;              /* (N) copy of the last forward's inputs */
    int32_t *targets;             /* (N) copy of the last forward's targets */
    ht_softmax_row *softmax_rows; /* (N) the forward's softmax of each counted row, for backward */
    int64_t target_count;
    /* backward scratch */
    float *dresid;       /* (N, C) gradient of the residual stream */
    float *dln;          /* (N, C) */
    float *datt;         /* (N, H*D) */
    float *dq;           /* (N, H*Dk) */
    float *dk, *dv;      /* (N, KVh*Dk), (N, KVh*Dv) */
    float *kva;          /* MLA: (N, Rkv + Dr) kv_a_proj_with_mqa's output; in backward its gradient */
    float *kvb;          /* MLA: (N, H*(Dn + Dv)) kv_b_proj's output; in backward its gradient */
    float *dkpe;         /* MLA: (N, Dr) the shared rotary key's gradient */
    float *dlat, *dlat2; /* MLA: (N, Rkv) the gradients of kv_b_proj's input and of the latent */
    float *dqa, *dqa2;   /* MLA: (N, Rq) the gradients of q_b_proj's input and of q_a_proj's output */
    float *dgate;        /* (N, F) */
    float *dup;          /* (N, F) */
    float *dh;           /* (N, F) */
    void *dy_cd;         /* (N, max(V, F, H*D, C)) a gradient cast to cd for a GEMM */
    float *att_work;     /* (threads, ht_kernels()->attention_workspace_floats(T, Dk, Dv)) the attention tiles */
    /* (L, B, H) the largest logit of each head in each layer's forward, and
     * its host copy (QK-clip's maxima are the host's): downloaded once, after
     * the last layer, not a wait a layer */
    float *head_max, *head_max_host;
    /* tensor parallelism's cross-entropy, per head chunk: each row's target
     * logit (0 where another rank's slice holds it), kernel memory; on the
     * host (tp_host, one block), the rows' maxima, then their sums of
     * exponentials and target logits (2 x head_rows), and where the kernels'
     * memory is not the host's, the rows' statistics and target logits
     * downloaded */
    float *tp_picked;
    void *tp_host;
    float *tp_max, *tp_picked_host;
    double *tp_sums;
    ht_softmax_row *tp_rows;
    /* sequence parallelism: a norm's output gathered to every row (N, C) cd,
     * the residual stream's gradient gathered (N, C), a row-parallel
     * product's rows of this rank (Ns, C) */
    void *ln_full;
    float *d_full, *red;
    int threads;
    /* model.lora */
    int lora_rank;
    float lora_scale;      /* alpha / r or alpha / sqrt(r) */
    float lora_dropout;    /* p */
    float *lora_h32;       /* (N, r) a product before its cast to cd */
    void *lora_dh;         /* (N, r) cd: the gradient of an adapter's h, a GEMM operand */
    void *lora_x;          /* (N, widest input) cd: a dropped-out adapter input (dropout only) */
    float *lora_dx;        /* (N, widest input) FP32 scratch of the dropout (dropout only) */
    uint64_t dropout_seed; /* the last forward's masks (0: none) */
    int64_t dropout_first; /* and the index of its first sequence in the global batch */
    /* generation's key/value cache (ht_model_set_cache; m->cache_capacity
     * positions P): every layer's keys after rotary (L, P, KVh, Dk) and
     * values (L, P, KVh, Dv), and the attention scratch for P keys */
    float *kcache, *vcache, *cache_work;
} decoder;

/* ------------------------------------------------------------------ params */

static ht_param *add_param(ht_model *m, const char *name, int64_t d0, int64_t d1, ht_dtype dtype) {
    int64_t shape[2] = {d0, d1};
    return ht_params_add(&m->params, name, d1 > 0 ? 2 : 1, shape, dtype);
}

/* Each linear's (out, in). */
static void linear_shape(const decoder *d, int lin, int64_t *out, int64_t *in) {
    int64_t qd = (int64_t)d->H * d->Dk, kvd = (int64_t)d->KV * d->D, od = (int64_t)d->H * d->Dv;
    const int64_t shapes[LIN_COUNT][2] = {
        {qd, d->C},
        {kvd, d->C},
        {kvd, d->C},
        {d->C, od},
        {d->F, d->C},
        {d->F, d->C},
        {d->C, d->F},
        {d->Rq, d->C},
        {qd, d->Rq},
        {d->Rkv + d->Dr, d->C},
        {(int64_t)d->H * (d->Dn + d->Dv), d->Rkv},
    };
    *out = shapes[lin][0];
    *in = shapes[lin][1];
}

/* Whether a layer's attention has linear `lin` (the MLP's are every dense layer's). */
static bool attention_has(const decoder *d, int lin) {
    if (!d->mla) return lin < LIN_PLAIN;
    if (lin == LIN_K || lin == LIN_V) return false;
    if (lin == LIN_Q) return d->Rq == 0;
    if (lin == LIN_QA || lin == LIN_QB) return d->Rq > 0;
    return true;
}

static bool layer_has(const decoder *d, const ht_model_config *c, int l, int lin) {
    if (lin >= LIN_GATE && lin <= LIN_DOWN) return !ht_model_config_layer_is_sparse(c, l);
    return attention_has(d, lin);
}

static bool lora_adapts(const ht_lora_config *lc, const char *path) {
    for (int k = 0; k < lc->target_count; k++)
        if (ht_lora_target_matches(lc->targets[k], path)) return true;
    return false;
}

/* model.lora.target_modules: every entry must select a linear layer, and
 * none the embedding or the LM head (PEFT's LoRA on those is an embedding
 * adapter and a tied-weight question: not supported here). */
static ht_status check_lora_targets(const decoder *d, const ht_model_config *c, ht_error *err) {
    const ht_lora_config *lc = &c->lora;
    char path[HT_PARAM_NAME_MAX];
    for (int k = 0; k < lc->target_count; k++) {
        const char *t = lc->targets[k];
        const char *other[] = {"lm_head", "model.embed_tokens", "model.norm"};
        for (size_t i = 0; i < sizeof(other) / sizeof(other[0]); i++)
            if (ht_lora_target_matches(t, other[i]))
                return ht_fail(err, HT_ERR_CONFIG,
                               "model.lora.target_modules: \"%s\" selects %s: not supported (adapters go on the "
                               "linear layers of the attention and the MLP only)",
                               t, other[i]);
        bool hit = false;
        for (int l = 0; l < d->L && !hit; l++) {
            const char *not_linear[] = {"input_layernorm",         "post_attention_layernorm", "self_attn", "mlp",
                                        "self_attn.q_a_layernorm", "self_attn.kv_a_layernorm"};
            for (size_t i = 0; i < sizeof(not_linear) / sizeof(not_linear[0]); i++) {
                snprintf(path, sizeof(path), "model.layers.%d.%s", l, not_linear[i]);
                if (ht_lora_target_matches(t, path))
                    return ht_fail(err, HT_ERR_CONFIG,
                                   "model.lora.target_modules: \"%s\" selects %s, which is not a linear layer "
                                   "(adapters go on the attention's and the MLP's linear layers)",
                                   t, path);
            }
            for (int lin = 0; lin < LIN_COUNT && !hit; lin++) {
                if (!attention_has(d, lin) && !(lin >= LIN_GATE && lin <= LIN_DOWN)) continue;
                snprintf(path, sizeof(path), "model.layers.%d.%s", l, LIN_MODULES[lin]);
                hit = ht_lora_target_matches(t, path);
                if (hit && lin >= LIN_GATE && lin <= LIN_DOWN && ht_model_config_layer_is_sparse(c, l))
                    return ht_fail(err, HT_ERR_CONFIG,
                                   "model.lora.target_modules: \"%s\" selects %s, but layer %d is sparse (its MLP "
                                   "is experts): adapters on experts are not supported; target the attention "
                                   "projections, or the MLPs of the dense layers by path",
                                   t, path, l);
            }
        }
        if (!hit) {
            char names[256] = "";
            size_t used = 0;
            for (int lin = 0; lin < LIN_COUNT; lin++)
                if (attention_has(d, lin) && used < sizeof(names))
                    used += (size_t)snprintf(names + used, sizeof(names) - used, "%s%s", used ? ", " : "",
                                             LIN_MODULES[lin] + strlen("self_attn."));
            return ht_fail(err, HT_ERR_CONFIG,
                           "model.lora.target_modules: \"%s\" matches no linear layer of this model; its linear "
                           "layers are model.layers.{0..%d}.self_attn.{%s} and "
                           "model.layers.{0..%d}.mlp.{gate_proj, up_proj, down_proj} (a bare name such as o_proj "
                           "matches it in every layer, a path such as model.layers.0.self_attn.o_proj one module, "
                           "'{*}' standing for one dotted component)",
                           t, d->L - 1, names, d->L - 1);
        }
    }
    return HT_OK;
}

static ht_status declare_params(ht_model *m, decoder *d, ht_dtype dtype, ht_error *err) {
    const ht_model_config *c = &m->config;
    const ht_lora_config *lc = &c->lora;
    char name[HT_PARAM_NAME_MAX + 32], module[HT_PARAM_NAME_MAX];
    if (lc->rank > 0) {
        ht_status s = check_lora_targets(d, c, err);
        if (s != HT_OK) return s;
    }
    /* Declare in Hugging Face's named_parameters() order (PEFT's for the
     * adapters: after the weight and bias they adapt). Pointers are taken
     * afterwards: the store's array may move while it grows. */
    add_param(m, "model.embed_tokens.weight", d->V, d->C, dtype);
    for (int l = 0; l < d->L; l++) {
#define P(suffix, d0, d1)                                                                                              \
    do {                                                                                                               \
        snprintf(name, sizeof(name), "%s.%s", module, suffix);                                                         \
        if (!add_param(m, name, d0, d1, dtype)) return ht_fail(err, HT_ERR_OOM, "cannot declare %s", name);            \
    } while (0)
        bool sparse = ht_model_config_layer_is_sparse(c, l);
        /* transformers' order: MLA's q_a_proj, q_a_layernorm, q_b_proj (or
         * q_proj), kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, then o_proj. */
        static const int plain[] = {LIN_Q, LIN_K, LIN_V, LIN_O, LIN_GATE, LIN_UP, LIN_DOWN};
        static const int latent[] = {LIN_QA, LIN_QB, LIN_Q, LIN_KVA, LIN_KVB, LIN_O, LIN_GATE, LIN_UP, LIN_DOWN};
        const int *order = d->mla ? latent : plain;
        const int lins = d->mla ? (int)(sizeof(latent) / sizeof(latent[0])) : (int)(sizeof(plain) / sizeof(plain[0]));
        for (int i = 0; i < lins; i++) {
            const int lin = order[i];
            int64_t out, in;
            if (!layer_has(d, c, l, lin)) continue; /* a sparse layer's MLP params come from moe.c */
            linear_shape(d, lin, &out, &in);
            snprintf(module, sizeof(module), "model.layers.%d.%s", l, LIN_MODULES[lin]);
            P("weight", out, in);
            if (c->attention_bias && lin <= LIN_V) P("bias", out, 0);
            if (lc->rank > 0 && lora_adapts(lc, module)) {
                P("lora_A.weight", lc->rank, in);
                P("lora_B.weight", out, lc->rank);
            }
            snprintf(module, sizeof(module), "model.layers.%d", l);
            if (lin == LIN_QA) P("self_attn.q_a_layernorm.weight", d->Rq, 0);
            if (lin == LIN_KVA) P("self_attn.kv_a_layernorm.weight", d->Rkv, 0);
        }
        snprintf(module, sizeof(module), "model.layers.%d", l);
        if (sparse && !ht_moe_declare(&m->params, module, c, dtype))
            return ht_fail(err, HT_ERR_OOM, "cannot declare %s's experts", module);
        P("input_layernorm.weight", d->C, 0);
        P("post_attention_layernorm.weight", d->C, 0);
#undef P
    }
    add_param(m, "model.norm.weight", d->C, 0, dtype);
    if (!c->tie_word_embeddings) add_param(m, "lm_head.weight", d->V, d->C, dtype);
    if (m->params.count == 0) return ht_fail(err, HT_ERR_OOM, "cannot declare parameters");
    return HT_OK;
}

static ht_param *find(ht_model *m, const char *fmt, int l) {
    char name[HT_PARAM_NAME_MAX];
    snprintf(name, sizeof(name), fmt, l);
    return ht_params_find(&m->params, name);
}

static void bind_params(ht_model *m, decoder *d) {
    int sparse = 0;
    d->embed = ht_params_find(&m->params, "model.embed_tokens.weight");
    d->norm = ht_params_find(&m->params, "model.norm.weight");
    d->head = m->config.tie_word_embeddings ? d->embed : ht_params_find(&m->params, "lm_head.weight");
    for (int l = 0; l < d->L; l++) {
        layer_params *p = &d->layers[l];
        p->ln1 = find(m, "model.layers.%d.input_layernorm.weight", l);
        p->q_w = find(m, "model.layers.%d.self_attn.q_proj.weight", l);
        p->q_b = find(m, "model.layers.%d.self_attn.q_proj.bias", l);
        p->k_w = find(m, "model.layers.%d.self_attn.k_proj.weight", l);
        p->k_b = find(m, "model.layers.%d.self_attn.k_proj.bias", l);
        p->v_w = find(m, "model.layers.%d.self_attn.v_proj.weight", l);
        p->v_b = find(m, "model.layers.%d.self_attn.v_proj.bias", l);
        p->o_w = find(m, "model.layers.%d.self_attn.o_proj.weight", l);
        p->qa_w = find(m, "model.layers.%d.self_attn.q_a_proj.weight", l);
        p->qa_ln = find(m, "model.layers.%d.self_attn.q_a_layernorm.weight", l);
        p->qb_w = find(m, "model.layers.%d.self_attn.q_b_proj.weight", l);
        p->kva_w = find(m, "model.layers.%d.self_attn.kv_a_proj_with_mqa.weight", l);
        p->kva_ln = find(m, "model.layers.%d.self_attn.kv_a_layernorm.weight", l);
        p->kvb_w = find(m, "model.layers.%d.self_attn.kv_b_proj.weight", l);
        p->ln2 = find(m, "model.layers.%d.post_attention_layernorm.weight", l);
        p->gate_w = find(m, "model.layers.%d.mlp.gate_proj.weight", l);
        p->up_w = find(m, "model.layers.%d.mlp.up_proj.weight", l);
        p->down_w = find(m, "model.layers.%d.mlp.down_proj.weight", l);
        p->sparse = ht_model_config_layer_is_sparse(&m->config, l) ? sparse++ : -1;
        if (p->sparse >= 0) {
            char module[HT_PARAM_NAME_MAX];
            snprintf(module, sizeof(module), "model.layers.%d", l);
            ht_moe_bind(d->moe, p->sparse, &m->params, module);
        }
        for (int lin = 0; lin < LIN_COUNT; lin++) {
            char fmt[HT_PARAM_NAME_MAX];
            snprintf(fmt, sizeof(fmt), "model.layers.%%d.%s.lora_A.weight", LIN_MODULES[lin]);
            p->lora_a[lin] = find(m, fmt, l);
            snprintf(fmt, sizeof(fmt), "model.layers.%%d.%s.lora_B.weight", LIN_MODULES[lin]);
            p->lora_b[lin] = find(m, fmt, l);
        }
    }
}

/* The modules in forward order: the embedding, each layer, the final norm,
 * the LM head (which reads the embedding when they are tied). */
enum { MOD_EMBED = 0 };
#define MOD_LAYER(l) (1 + (l))
#define MOD_NORM(d) (1 + (d)->L)
#define MOD_HEAD(d) (2 + (d)->L)

static void module_add(ht_module *mod, ht_param *p) {
    if (p) mod->params[mod->param_count++] = p;
}

static ht_status declare_modules(ht_model *m, decoder *d, ht_error *err) {
    bind_params(m, d); /* the store's array is final: pointers into it stay valid */
    m->module_count = d->L + 3;
    m->modules = ht_alloc((size_t)m->module_count * sizeof(ht_module));
    m->input_dtype = ht_alloc((size_t)m->module_count * sizeof(ht_dtype)); /* zeroed: F32, no cast */
    if (!m->modules || !m->input_dtype) return ht_fail(err, HT_ERR_OOM, "cannot allocate the model's modules");
    snprintf(m->modules[MOD_EMBED].name, HT_PARAM_NAME_MAX, "model.embed_tokens");
    module_add(&m->modules[MOD_EMBED], m->stage.first ? d->embed : NULL); /* a last stage's tied copy: its head's */
    for (int l = 0; l < d->L; l++) {
        ht_module *mod = &m->modules[MOD_LAYER(l)];
        layer_params *p = &d->layers[l];
        snprintf(mod->name, HT_PARAM_NAME_MAX, "model.layers.%d", l);
        /* A sparse layer's experts keep their activations: not recomputable (yet). */
        mod->recomputable = p->sparse < 0;
        if (p->sparse >= 0)
            mod->why_not = "a sparse layer: its experts keep their activations and the load-balancing sums, which a "
                           "second forward would count twice";
        ht_param *all[] = {p->q_w,   p->q_b,    p->k_w,   p->k_b, p->v_w,    p->v_b,  p->qa_w,   p->qa_ln, p->qb_w,
                           p->kva_w, p->kva_ln, p->kvb_w, p->o_w, p->gate_w, p->up_w, p->down_w, p->ln1,   p->ln2};
        for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) module_add(mod, all[i]);
        if (p->sparse >= 0) {
            const ht_moe_params *e = ht_moe_params_of(d->moe, p->sparse);
            ht_param *experts[] = {e->router,  e->bias,  e->gate_up, e->down,
                                   e->sh_gate, e->sh_up, e->sh_down, e->sh_expert_gate};
            for (size_t i = 0; i < sizeof(experts) / sizeof(experts[0]); i++) module_add(mod, experts[i]);
        }
        for (int lin = 0; lin < LIN_COUNT; lin++) { /* the adapters travel with their layer (FSDP units) */
            module_add(mod, p->lora_a[lin]);
            module_add(mod, p->lora_b[lin]);
        }
    }
    snprintf(m->modules[MOD_NORM(d)].name, HT_PARAM_NAME_MAX, "model.norm");
    module_add(&m->modules[MOD_NORM(d)], d->norm);
    snprintf(m->modules[MOD_HEAD(d)].name, HT_PARAM_NAME_MAX, "lm_head");
    module_add(&m->modules[MOD_HEAD(d)], d->head);
    return HT_OK;
}

static double yarn_mscale(double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * log(scale) + 1.0; }

/* The dimension YaRN's ramp puts at `rotations` turns over the original context. */
static double yarn_dim(double rotations, int dim, double base, int max_pos) {
    return dim * log(max_pos / (rotations * 2 * 3.14159265358979323846)) / (2 * log(base));
}

/* Rotary tables computed as transformers does: inv_freq and the angles in
 * float32, the cosine and sine of each float32 angle correctly rounded.
 * YaRN (model.rope_scaling, transformers' _compute_yarn_parameters, truncate
 * on): each frequency blended between theta^(-2i/dim) and that / factor by
 * a ramp from floor(dim at beta_fast turns) to ceil(dim at beta_slow turns),
 * and cos, sin times the attention factor mscale(s, mscale) /
 * mscale(s, mscale_all_dim) (mscale(s) alone when either is 0). */
static ht_status fill_rope_tables(decoder *d, const ht_model_config *cfg, ht_error *err) {
    const int dim = d->rope_dim, half = dim / 2, max_pos = cfg->max_position_embeddings;
    /* computed on the host, then uploaded into the backend's tables */
    const size_t n = (size_t)max_pos * (size_t)half;
    float *cos_t = malloc((n ? n : 1) * sizeof(float)), *sin_t = malloc((n ? n : 1) * sizeof(float));
    if (!cos_t || !sin_t) {
        free(cos_t), free(sin_t);
        return ht_fail(err, HT_ERR_OOM, "cannot allocate the rotary tables");
    }
    const double theta = cfg->rope_theta;
    const ht_rope_scaling *r = &cfg->rope_scaling;
    const bool yarn = ht_rope_is_yarn(r);
    float factor = 1.0f, low = 0, span = 1;
    if (yarn) {
        const double s = r->factor;
        const double af = r->mscale != 0 && r->mscale_all_dim != 0
                              ? yarn_mscale(s, r->mscale) / yarn_mscale(s, r->mscale_all_dim)
                              : yarn_mscale(s, 1.0);
        factor = (float)af;
        double lo = floor(yarn_dim(r->beta_fast, dim, theta, r->original_max_position_embeddings));
        double hi = ceil(yarn_dim(r->beta_slow, dim, theta, r->original_max_position_embeddings));
        lo = lo > 0 ? lo : 0;
        hi = hi < dim - 1 ? hi : dim - 1;
        if (lo == hi) hi += 0.001;
        low = (float)lo, span = (float)(hi - lo);
    }
    for (int i = 0; i < half; i++) {
        float pos_freq = powf((float)theta, (float)(2 * i) / (float)dim), inv_freq = 1.0f / pos_freq;
        if (yarn) {
            float ramp = ((float)i - low) / span;
            ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
            float extrapolation = 1.0f - ramp, interpolation = 1.0f / ((float)r->factor * pos_freq);
            inv_freq = interpolation * (1.0f - extrapolation) + inv_freq * extrapolation;
        }
        for (int t = 0; t < max_pos; t++) {
            float angle = (float)t * inv_freq;
            float c = (float)cos((double)angle), sn = (float)sin((double)angle);
            cos_t[(size_t)t * half + i] = yarn ? c * factor : c;
            sin_t[(size_t)t * half + i] = yarn ? sn * factor : sn;
        }
    }
    ht_kernels()->upload(d->cos_t, cos_t, n * sizeof(float));
    ht_kernels()->upload(d->sin_t, sin_t, n * sizeof(float));
    free(cos_t), free(sin_t);
    return HT_OK;
}

/* ------------------------------------------------------------------ activations */

static bool recomputed(const ht_model *m, int l) { return m->recompute && m->recompute[MOD_LAYER(l)]; }

/* Whether layer l's linear `lin` has an adapter; l -1 (the buffers the
 * recomputed layers share): whether any layer's has. */
static bool lora_in_any(const decoder *d, int l, int lin) {
    if (l >= 0) return d->layers[l].lora_a[lin] != NULL;
    for (int k = 0; k < d->L; k++) /* the layers this model holds: the others have no adapters here */
        if (d->layers[k].lora_a[lin]) return true;
    return false;
}

/* Whether the residual stream is split over the tensor-parallel group. */
static bool sequence_parallel(const ht_model *m, const decoder *d) { return d->tp_size > 1 && m->tensor.sequence; }

/* The dtype of the matmul operands the activations hold: the weights'
 * compute dtype (a stage without the embedding: its first layer's o_proj's). */
static ht_dtype compute_dtype(const decoder *d) { return (d->embed ? d->embed : d->layers[d->l0].o_w)->compute_dtype; }

/* The LM head and the loss over chunks of tokens (m->keep_logits false):
 * no (N, V) logits, nor their gradient, exist at once. Only where they
 * would be large: below m->head_chunk_bytes of FP32 logits the whole batch
 * is one chunk, and backward reuses forward's logits instead of computing
 * them again. */
static int64_t chunk_rows(const ht_model *m, const decoder *d, int64_t N) {
    const int64_t rows = m->head_chunk_bytes / ((int64_t)d->V * 4);
    return m->keep_logits || m->head_chunk_bytes <= 0 || N <= rows ? N : rows > 0 ? rows : 1;
}

/* The bytes of every activation buffer for (B, T) with matmul operands of
 * cd bytes, in carving order: NPL per layer, then the tail and the LoRA
 * scratch. The total is what size_activations allocates. */
enum { NPL = 21, NTAIL = 30, NLORA = 4 };
typedef struct act_plan {
    size_t per_layer[NPL], tail[NTAIL], lora_h, lora_tail[NLORA];
    bool shared; /* model.recompute: the recomputed layers share one set of buffers */
    int slots;   /* micro-batches kept at once (m->slots), of every chunk */
    size_t slot[HT_PIPELINE_CHUNKS_MAX],
        total; /* one slot's bytes of each chunk (its layers' and tail's), everything's */
} act_plan;

/* The tail's buffers each micro-batch slot has its own of (the rest are
 * backward's scratch), and those only a slot of the chunk with the head needs. */
static bool slot_tail(int i) { return i <= 5 || i == 18; }
static bool head_tail(int i) { return (i >= 1 && i <= 3) || i == 18; }

static int slots_of(const ht_model *m) { return m->slots > 1 ? m->slots : 1; }

/* The chunk a slot belongs to: slots / chunks of them each, in chunk order. */
static int chunk_of(const ht_model *m, int slot) { return slot / (slots_of(m) / m->stage.chunks); }

/* Whether chunk c computes the final norm, the LM head and the loss (the last rank's last chunk). */
static bool chunk_has_head(const ht_model *m, int c) { return m->stage.last && c == m->stage.chunks - 1; }

/* The experts `moe` holds activations for: chunk c of st's sparse layers, by their index among the sparse layers. */
static void chunk_experts(const ht_model *m, const ht_pipeline_stage *st, int c, ht_moe *moe) {
    int l0, l1, s0 = 0, s1 = 0;
    ht_pipeline_chunk_layers(st, c, &l0, &l1);
    for (int l = 0; l < l1; l++) {
        const bool sparse = ht_model_config_layer_is_sparse(&m->config, l);
        s0 += sparse && l < l0;
        s1 += sparse;
    }
    ht_moe_set_layers(moe, s0, s1);
}

/* Chunk c's layers, and whether it embeds the tokens or computes the loss, as the current ones. */
static void select_chunk(const ht_model *m, decoder *d, int c) {
    ht_pipeline_chunk_layers(&m->stage, c, &d->l0, &d->l1);
    d->has_embed = m->stage.first && c == 0;
    d->has_head = chunk_has_head(m, c);
}
static void plan_activations(const ht_model *m, const decoder *d, int B, int T, size_t cd, int threads, act_plan *p) {
    const int64_t head_rows = chunk_rows(m, d, (int64_t)B * T);
    int64_t N = (int64_t)B * T, C = d->C, F = d->F, V = d->V;
    const bool sp = sequence_parallel(m, d);
    const int64_t Ns = sp ? N / d->tp_size : N; /* the residual stream's rows */
    int64_t QD = (int64_t)d->H * d->Dk, KD = (int64_t)d->KVh * d->Dk, VD = (int64_t)d->KVh * d->Dv,
            OD = (int64_t)d->H * d->Dv;
    int64_t Rq = d->Rq, Rkv = d->mla ? d->Rkv : 0, KVA = d->mla ? d->Rkv + d->Dr : 0,
            KVB = d->mla ? (int64_t)d->H * (d->Dn + d->Dv) : 0, Dr = d->mla ? d->Dr : 0;
    /* dy_cd: any linear's output gradient, the head's chunk included */
    const int64_t outs[] = {F, QD, KD, OD, C, KVA, KVB, Rq};
    int64_t widest = 0;
    for (size_t i = 0; i < sizeof(outs) / sizeof(outs[0]); i++) widest = outs[i] > widest ? outs[i] : widest;
    const int64_t dy_cd_elems = N * widest > head_rows * V ? N * widest : head_rows * V;
    const size_t per_layer[NPL] = {
        Ns * C * 4,       Ns * 4,      Ns * C * cd, N * QD * 4,
        N * KD * 4,       N * VD * 4,  N * OD * 4,  (size_t)B * d->H * T * 4,
        N * OD * cd,      Ns * C * 4,  Ns * 4,      Ns * C * cd,
        N * F * 4,        N * F * 4,   N * F * cd,  N * Rq * 4,
        N * 4 * (Rq > 0), N * Rq * cd, N * Rkv * 4, N * 4 * (Rkv > 0),
        N * Rkv * cd,
    };
    const size_t tail[NTAIL] = {
        Ns * C * 4,
        Ns * 4,
        Ns * C * cd,
        (size_t)(head_rows * V) * 4,
        N * 4,
        N * 4, /* resid_final .. logits, inputs, targets */
        Ns * C * 4,
        N * C * 4,
        N * OD * 4,
        N * QD * 4,
        N * KD * 4,
        N * VD * 4, /* dresid .. dv */
        N * F * 4,
        N * F * 4,
        N * F * 4,
        (size_t)dy_cd_elems * cd, /* dgate .. dy_cd */
        (size_t)threads * ht_kernels()->attention_workspace_floats(T, d->Dk, d->Dv) * 4,
        (size_t)d->L * B * d->H * 4,
        /* att_work, head_max */ (size_t)N * sizeof(ht_softmax_row), /* softmax_rows */
        N * KVA * 4,
        N * KVB * 4,
        N * Dr * 4,
        N * Rkv * 4,
        N * Rkv * 4,
        N * Rq * 4,
        N * Rq * 4,                               /* MLA: kva .. dqa2 */
        (size_t)head_rows * 4 * (d->tp_size > 1), /* tensor parallelism: tp_picked */
        N * C * cd * sp,
        N * C * 4 * sp,
        Ns * C * 4 * sp, /* sequence parallelism: ln_full, d_full, red */
    };
    memcpy(p->per_layer, per_layer, sizeof(per_layer));
    memcpy(p->tail, tail, sizeof(tail));
    /* model.lora: each adapted linear keeps its h; one product, its
     * gradient and (with dropout) a dropped-out input are scratch. */
    int64_t R = d->lora_rank, widest_in = F > OD ? F : OD;
    widest_in = widest_in > C ? widest_in : C;
    widest_in = widest_in > Rq ? widest_in : Rq;
    widest_in = widest_in > Rkv ? widest_in : Rkv;
    size_t lora_x = d->lora_dropout > 0 ? (size_t)(N * widest_in) * 4 : 0;
    p->lora_h = (size_t)(N * R) * cd;
    const size_t lora_tail[NLORA] = {(size_t)(N * R) * 4, (size_t)(N * R) * cd, lora_x, lora_x}; /* h32, dh, x, dx */
    memcpy(p->lora_tail, lora_tail, sizeof(lora_tail));
    /* model.recompute: a recomputed layer keeps its input (resid) alone; the
     * rest of its buffers are one set all of them share, carved once (as if
     * for layer -1), which backward fills again before the layer's turn. */
    p->shared = false;
    for (int l = 0; l < d->L; l++) p->shared = p->shared || (ht_pipeline_holds_layer(&m->stage, l) && recomputed(m, l));
    p->slots = slots_of(m);
    size_t shared = 0;
    for (int i = 1; p->shared && i < NPL; i++) shared += ht_align64(p->per_layer[i]); /* the common set */
    for (int lin = 0; p->shared && lin < LIN_COUNT; lin++)
        if (lora_in_any(d, -1, lin)) shared += ht_align64(p->lora_h);
    for (int i = 0; i < NTAIL; i++) shared += slot_tail(i) ? 0 : ht_align64(p->tail[i]);
    for (int i = 0; i < NLORA; i++) shared += ht_align64(p->lora_tail[i]);
    p->total = shared;
    for (int c = 0; c < m->stage.chunks; c++) { /* each chunk's slots: its layers and the tail */
        int l0, l1;
        ht_pipeline_chunk_layers(&m->stage, c, &l0, &l1);
        p->slot[c] = 0;
        for (int l = l0; l < l1; l++) {
            const bool own = !recomputed(m, l);
            for (int i = 0; i < NPL; i++)
                if (i == 0 || own) p->slot[c] += ht_align64(p->per_layer[i]);
            for (int lin = 0; lin < LIN_COUNT; lin++)
                if (own && lora_in_any(d, l, lin)) p->slot[c] += ht_align64(p->lora_h);
        }
        for (int i = 0; i < NTAIL; i++)
            if (slot_tail(i) && (chunk_has_head(m, c) || !head_tail(i))) p->slot[c] += ht_align64(p->tail[i]);
        p->total += (size_t)(p->slots / m->stage.chunks) * p->slot[c];
    }
}

/* What plan_activations totals, for a caller asking before anything is
 * sized; +inf where it might not fit in 64 bits: each buffer is at most
 * N x the widest dimension (at least 2^16, which covers the attention
 * scratch's fixed part) x 8 bytes, and a thread's attention scratch two of them. */
static double decoder_activation_bytes(const ht_model *m, int B, int T, size_t cd) {
    const decoder *d = m->impl;
    const int threads = omp_get_max_threads();
    int64_t widest = (int64_t)1 << 16, bound;
    const int64_t dims[] = {2 * (int64_t)d->V,
                            d->C,
                            d->F,
                            (int64_t)d->H * d->Dk,
                            (int64_t)d->H * (d->Dn + d->Dv),
                            (int64_t)d->Rkv + d->Dr,
                            d->Rq,
                            2 * (int64_t)d->lora_rank};
    for (size_t i = 0; i < sizeof(dims) / sizeof(dims[0]); i++) widest = dims[i] > widest ? dims[i] : widest;
    const int64_t buffers =
        ((int64_t)(NPL + LIN_COUNT) * (d->L + 1) + NTAIL) * slots_of(m) + NLORA + 2 * (int64_t)threads;
    if (__builtin_mul_overflow((int64_t)B * T, widest, &bound) || __builtin_mul_overflow(bound, 8 * buffers, &bound))
        return INFINITY;
    act_plan p;
    plan_activations(m, d, B, T, cd, threads, &p);
    /* what forward adds beside the decoder's block: the experts' buffers, context parallelism's attention and
     * rotary tables at the rank's positions (as forward sizes them) */
    const int64_t N = (int64_t)B * T, Ns = sequence_parallel(m, d) ? N / d->tp_size : N;
    /* every micro-batch slot's experts, each counted as the first chunk's */
    double more =
        (double)ht_moe_plan_bytes(d->moe, Ns, m->experts.size, d->tp_size, m->tensor.sequence, cd) * slots_of(m);
    if (ht_context_size(&m->context) > 1) {
        const ht_attention_shape local = {
            .B = B, .T = T, .H = d->H, .KV = d->KVh, .Dk = d->Dk, .Dv = d->Dv, .scale = d->attn_scale};
        more += (double)ht_cp_attention_plan_bytes(&m->context, &local) +
                2.0 * (double)T * (double)(d->rope_dim / 2) * sizeof(float);
    }
    return (double)p.total + more;
}

/* Sizes every activation for (B, T) and carves them from one block. */
/* One layer's activations carved from the arena: all of them, or (a
 * recomputed layer) its input alone and the shared set `common` for the rest. */
static void carve_layer(ht_arena *arena, const ht_model *m, const decoder *d, const act_plan *plan, int l,
                        const layer_acts *common, layer_acts *a) {
    const size_t *per_layer = plan->per_layer;
    if (l >= 0) a->resid = ht_arena_take(arena, per_layer[0]);
    if (l >= 0 && recomputed(m, l)) {
        float *resid = a->resid;
        *a = *common;
        a->resid = resid;
        for (int lin = 0; lin < LIN_COUNT; lin++)
            if (!d->layers[l].lora_a[lin]) a->lora_h[lin] = NULL;
        return;
    }
    a->rstd1 = ht_arena_take(arena, per_layer[1]);
    a->ln1 = ht_arena_take(arena, per_layer[2]);
    a->q = ht_arena_take(arena, per_layer[3]);
    a->k = ht_arena_take(arena, per_layer[4]);
    a->v = ht_arena_take(arena, per_layer[5]);
    a->o = ht_arena_take(arena, per_layer[6]);
    a->lse = ht_arena_take(arena, per_layer[7]);
    a->att = ht_arena_take(arena, per_layer[8]);
    a->resid_mid = ht_arena_take(arena, per_layer[9]);
    a->rstd2 = ht_arena_take(arena, per_layer[10]);
    a->ln2 = ht_arena_take(arena, per_layer[11]);
    a->gate = ht_arena_take(arena, per_layer[12]);
    a->up = ht_arena_take(arena, per_layer[13]);
    a->h = ht_arena_take(arena, per_layer[14]);
    a->qa = ht_arena_take(arena, per_layer[15]);
    a->rstd_qa = ht_arena_take(arena, per_layer[16]);
    a->qa_ln = ht_arena_take(arena, per_layer[17]);
    a->kv_lat = ht_arena_take(arena, per_layer[18]);
    a->rstd_kv = ht_arena_take(arena, per_layer[19]);
    a->kv_ln = ht_arena_take(arena, per_layer[20]);
    for (int lin = 0; lin < LIN_COUNT; lin++)
        a->lora_h[lin] = lora_in_any(d, l, lin) ? ht_arena_take(arena, plan->lora_h) : NULL;
}

/* Makes micro-batch slot k's buffers the current ones (d->acts .. d->softmax_rows
 * and the forward's counts), keeping the current slot's counts. */
static void select_slot(decoder *d, int k) {
    micro_slot *o = &d->slots[d->slot], *n = &d->slots[k];
    o->target_count = d->target_count, o->dropout_seed = d->dropout_seed, o->dropout_first = d->dropout_first;
    d->slot = k;
    d->acts = n->acts;
    d->resid_final = n->resid_final, d->rstdf = n->rstdf, d->lnf = n->lnf, d->logits = n->logits;
    d->inputs = n->inputs, d->targets = n->targets, d->softmax_rows = n->softmax_rows;
    d->target_count = n->target_count, d->dropout_seed = n->dropout_seed, d->dropout_first = n->dropout_first;
    if (d->moe) d->moe = d->moes[k];
}

/* Sizes every activation for (B, T) and m->slots micro-batches and carves them from one block. */
static ht_status size_activations(ht_model *m, decoder *d, int B, int T, ht_error *err) {
    /* The attention scratch is per thread: more threads than it was sized for size it again. */
    /* cd buffers hold matmul operands in the compute dtype: sized for it,
     * and sized again when it changes (ht_model_set_compute). */
    const size_t cd = ht_dtype_size(compute_dtype(d));
    const int64_t head_rows = chunk_rows(m, d, (int64_t)B * T);
    const bool sp = sequence_parallel(m, d);
    const int S = slots_of(m);
    if (d->act_block && d->B == B && d->T == T && d->threads >= omp_get_max_threads() &&
        d->sized_generation == m->recompute_generation && d->sized_cd == cd && d->head_rows == head_rows &&
        d->sp == sp && d->slot_count == S)
        return HT_OK;
    ht_kernels()->free(d->act_block);
    ht_free(d->head_max_host);
    ht_free(d->tp_host);
    ht_free(d->slots);
    ht_free(d->all_acts);
    d->act_block = NULL;
    d->tp_host = NULL;
    d->slot_count = d->slot = 0;
    d->threads = omp_get_max_threads();
    if (d->moe) { /* each slot its own expert activations: clones of the first, made again for S slots */
        for (int k = d->moe_count - 1; k >= 1; k--) ht_moe_free(d->moes[k]);
        d->moe_count = 1;
        ht_moe **moes = realloc(d->moes, (size_t)S * sizeof(ht_moe *));
        if (!moes) return ht_fail(err, HT_ERR_OOM, "cannot allocate the experts' slots");
        d->moes = moes;
        for (; d->moe_count < S; d->moe_count++)
            if (!(d->moes[d->moe_count] = ht_moe_clone(d->moes[0])))
                return ht_fail(err, HT_ERR_OOM, "cannot allocate the experts' slot %d", d->moe_count);
        for (int k = 0; k < S; k++) chunk_experts(m, &m->stage, chunk_of(m, k), d->moes[k]);
    }
    d->slots = ht_alloc((size_t)S * sizeof(micro_slot));
    d->all_acts = ht_alloc((size_t)S * (size_t)d->L * sizeof(layer_acts));
    if (!d->slots || !d->all_acts || !(d->head_max_host = ht_alloc((size_t)d->L * B * d->H * sizeof(float))))
        return ht_fail(err, HT_ERR_OOM, "cannot allocate the activations' tables for batch %d", B);
    if (d->tp_size > 1) {
        const size_t h = (size_t)head_rows, bytes[4] = {h * 4, h * 16, h * sizeof(ht_softmax_row), h * 4};
        if (!(d->tp_host = ht_alloc(ht_align64(bytes[0]) + ht_align64(bytes[1]) + ht_align64(bytes[2]) + bytes[3])))
            return ht_fail(err, HT_ERR_OOM, "cannot allocate the vocabulary-parallel cross-entropy's sums");
        ht_arena host = {.base = d->tp_host};
        d->tp_max = ht_arena_take(&host, bytes[0]);
        d->tp_sums = ht_arena_take(&host, bytes[1]);
        d->tp_rows = ht_arena_take(&host, bytes[2]);
        d->tp_picked_host = ht_arena_take(&host, bytes[3]);
    }
    act_plan plan;
    plan_activations(m, d, B, T, cd, d->threads, &plan);
    const size_t *tail = plan.tail, *lora_tail = plan.lora_tail;
    char *block = ht_kernels()->alloc(plan.total);
    if (!block)
        return ht_fail(err, HT_ERR_OOM, "cannot allocate %.1f MiB of activations for batch %d x %d%s",
                       (double)plan.total / (1 << 20), B, T, S > 1 ? " (every micro-batch slot)" : "");
    ht_arena arena = {.base = block};
    layer_acts common = {0};
    if (plan.shared) carve_layer(&arena, m, d, &plan, -1, NULL, &common);
    for (int k = 0; k < S; k++) {
        micro_slot *ms = &d->slots[k];
        const int c = chunk_of(m, k);
        const size_t head = chunk_has_head(m, c); /* only the loss's chunk needs the norm's and head's buffers */
        int l0, l1;
        ht_pipeline_chunk_layers(&m->stage, c, &l0, &l1);
        ms->acts = d->all_acts + (size_t)k * (size_t)d->L;
        for (int l = l0; l < l1; l++) carve_layer(&arena, m, d, &plan, l, &common, &ms->acts[l]);
        ms->resid_final = ht_arena_take(&arena, tail[0]);
        ms->rstdf = ht_arena_take(&arena, tail[1] * head);
        ms->lnf = ht_arena_take(&arena, tail[2] * head);
        ms->logits = ht_arena_take(&arena, tail[3] * head);
        ms->inputs = ht_arena_take(&arena, tail[4]);
        ms->targets = ht_arena_take(&arena, tail[5]);
        ms->softmax_rows = ht_arena_take(&arena, tail[18] * head);
    }
    d->slot_count = S;
    select_slot(d, 0);
    d->dresid = ht_arena_take(&arena, tail[6]);
    d->dln = ht_arena_take(&arena, tail[7]);
    d->datt = ht_arena_take(&arena, tail[8]);
    d->dq = ht_arena_take(&arena, tail[9]);
    d->dk = ht_arena_take(&arena, tail[10]);
    d->dv = ht_arena_take(&arena, tail[11]);
    d->dgate = ht_arena_take(&arena, tail[12]);
    d->dup = ht_arena_take(&arena, tail[13]);
    d->dh = ht_arena_take(&arena, tail[14]);
    d->dy_cd = ht_arena_take(&arena, tail[15]);
    d->att_work = ht_arena_take(&arena, tail[16]);
    d->head_max = ht_arena_take(&arena, tail[17]);
    d->kva = ht_arena_take(&arena, tail[19]);
    d->kvb = ht_arena_take(&arena, tail[20]);
    d->dkpe = ht_arena_take(&arena, tail[21]);
    d->dlat = ht_arena_take(&arena, tail[22]);
    d->dlat2 = ht_arena_take(&arena, tail[23]);
    d->dqa = ht_arena_take(&arena, tail[24]);
    d->dqa2 = ht_arena_take(&arena, tail[25]);
    d->tp_picked = ht_arena_take(&arena, tail[26]);
    d->ln_full = ht_arena_take(&arena, tail[27]);
    d->d_full = ht_arena_take(&arena, tail[28]);
    d->red = ht_arena_take(&arena, tail[29]);
    d->lora_h32 = ht_arena_take(&arena, lora_tail[0]);
    d->lora_dh = ht_arena_take(&arena, lora_tail[1]);
    d->lora_x = ht_arena_take(&arena, lora_tail[2]);
    d->lora_dx = ht_arena_take(&arena, lora_tail[3]);
    d->act_block = block;
    d->B = B;
    d->T = T;
    d->sized_generation = m->recompute_generation;
    d->sized_cd = cd;
    d->head_rows = head_rows;
    d->sp = sp;
    d->activation_bytes = plan.total;
    return HT_OK;
}

/* ------------------------------------------------------------------ building blocks */

/* y (N, out) = x (N, in) · Wᵀ + b, with x in the weight's dtype. */
static void linear_forward(float *y, const void *x, const ht_param *w, const ht_param *b, int64_t N) {
    int64_t out = w->shape[0], in = w->shape[1];
    ht_kernels()->gemm(false, true, N, out, in, 1.0f, x, in, w->compute, in, w->compute_dtype, 0.0f, y, out);
    if (b) ht_kernels()->add_bias(y, b->compute, b->compute_dtype, N, out);
}

/* Given dy (N, out) FP32: W.grad += dyᵀ · x, b.grad += Σ dy, and
 * dx (N, in) = dx_beta · dx + dy · W. The GEMMs take dy in the weight's dtype.
 * A frozen weight or bias (model.freeze) has no grad: its product is skipped.
 * Returns dy as the GEMMs read it (valid until the next linear_backward). */
static const void *linear_backward(decoder *d, float *dx, float dx_beta, const float *dy, const void *x,
                                   const ht_param *w, const ht_param *b, int64_t N) {
    int64_t out = w->shape[0], in = w->shape[1];
    const void *dy_cd = dy;
    if (w->compute_dtype != HT_DTYPE_F32) {
        ht_kernels()->convert(d->dy_cd, w->compute_dtype, dy, HT_DTYPE_F32, (size_t)(N * out));
        dy_cd = d->dy_cd;
    } else if (w->compute_precision != HT_DTYPE_F32) { /* FP32 operands of bf16/f16 precision */
        ht_kernels()->copy(d->dy_cd, dy, (size_t)(N * out) * sizeof(float));
        ht_kernels()->round_to(d->dy_cd, (size_t)(N * out), w->compute_precision);
        dy_cd = d->dy_cd;
    }
    if (w->grad)
        ht_kernels()->gemm(true, false, out, in, N, 1.0f, dy_cd, out, x, in, w->compute_dtype, 1.0f, w->grad, in);
    if (b && b->grad) ht_kernels()->bias_backward(b->grad, dy, N, out);
    if (dx)
        ht_kernels()->gemm(false, false, N, in, out, 1.0f, dy_cd, out, w->compute, in, w->compute_dtype, dx_beta, dx,
                           in);
    return dy_cd;
}

/* Tensor parallelism's three exchanges (docs/DESIGN.md, Tensor
 * parallelism), each nothing without it. tp_gather_input: a column-parallel
 * product's input, a norm's output of the residual stream's rows (cd), at
 * every token: under sequence parallelism gathered over the group into
 * ln_full, otherwise x itself. tp_reduce: a row-parallel product's partial
 * sums y (N, C), and a column-parallel input's gradient, completed: summed
 * over the group in place (returns y), or under sequence parallelism
 * reduce-scattered to this rank's Ns rows (returns red). tp_gather_grad:
 * the residual stream's gradient (Ns, C) at every token (d_full), or g itself. */
static const void *tp_gather_input(const decoder *d, const void *x) {
    if (!d->sp) return x;
    const size_t bytes = (size_t)(d->Ns * d->C) * ht_dtype_size(compute_dtype(d));
    d->tp->all_gather(d->tp->ctx, x, d->ln_full, (int64_t)bytes);
    return d->ln_full;
}

static float *tp_reduce(const decoder *d, float *y) {
    if (d->tp_size <= 1) return y;
    if (!d->sp) {
        d->tp->sum(d->tp->ctx, y, d->Ns * d->C);
        return y;
    }
    d->tp->reduce_scatter(d->tp->ctx, y, d->red, d->Ns * d->C);
    return d->red;
}

static const float *tp_gather_grad(const decoder *d, const float *g) {
    if (!d->sp) return g;
    d->tp->all_gather(d->tp->ctx, g, d->d_full, d->Ns * d->C * (int64_t)sizeof(float));
    return d->d_full;
}

/* rmsnorm_backward over the residual stream's rows into dx, and w's
 * gradient: under sequence parallelism this rank's tokens' part of it (the
 * group's parts are summed above the model: ht_tensor_parallel). */
static void norm_backward(const decoder *d, float *dx, const ht_param *w, const float *dout, const float *x,
                          const float *rstd) {
    ht_kernels()->rmsnorm_backward(dx, w->grad, dout, x, w->compute, w->compute_dtype, rstd, d->Ns, d->C);
}

/* ------------------------------------------------------------------ LoRA */

/* An FP32 product as the operand of a later GEMM of compute dtype cd: cast,
 * or (FP32 storage of a coarser precision) rounded, as the activations are. */
static void to_operand(void *dst, const float *src, size_t n, ht_dtype cd, ht_dtype precision) {
    if (cd != HT_DTYPE_F32) {
        ht_kernels()->convert(dst, cd, src, HT_DTYPE_F32, n);
        return;
    }
    if (dst != src) ht_kernels()->copy(dst, src, n * sizeof(float));
    ht_kernels()->round_to(dst, n, precision);
}

/* x (N, in) FP32 times the dropout mask of adapter (layer l, linear lin)
 * (ht_kernels()->dropout): an element is dropped from (seed, global token
 * index, layer, linear, column). The token index counts from the step's
 * first sequence, so one process and N ranks drop the same elements. */
static void apply_dropout(const decoder *d, float *x, int64_t N, int64_t in, int l, int lin) {
    /* Sites of the plain linears as they have always been; MLA's apart (bit 47). */
    const uint64_t site = lin < LIN_PLAIN
                              ? (uint64_t)(l * LIN_PLAIN + lin) << 48
                              : (uint64_t)(l * (LIN_COUNT - LIN_PLAIN) + lin - LIN_PLAIN) << 48 | 1ull << 47;
    if (!d->cp) {
        ht_kernels()->dropout(x, N, in, d->lora_dropout, d->dropout_seed, site, d->dropout_first * d->T);
        return;
    }
    /* Context parallelism: row n is token position(t) of sequence b of a sequence length cp_T x the group's size. */
    const int64_t Tg = (int64_t)d->T * d->cp_size;
    for (int64_t n = 0; n < N; n++) {
        const int64_t b = n / d->T, t = n % d->T, pos = ht_context_position(d->context, d->T, t);
        ht_kernels()->dropout(x + n * in, 1, in, d->lora_dropout, d->dropout_seed, site,
                              (d->dropout_first + b) * Tg + pos);
    }
}

static bool dropout_on(const decoder *d) { return d->lora_dropout > 0 && d->dropout_seed != 0; }

/* The adapter's input: x itself, or dropout(x) rebuilt in lora_x. */
static const void *adapter_input(const decoder *d, const void *x, int64_t N, int64_t in, int l, int lin, ht_dtype cd,
                                 ht_dtype precision) {
    if (!dropout_on(d)) return x;
    ht_kernels()->convert(d->lora_dx, HT_DTYPE_F32, x, cd, (size_t)(N * in));
    apply_dropout(d, d->lora_dx, N, in, l, lin);
    to_operand(d->lora_x, d->lora_dx, (size_t)(N * in), cd, precision);
    return d->lora_x;
}

/* y (N, out) += scale · (dropout(x) Aᵀ) Bᵀ, keeping h = dropout(x) Aᵀ (N, r) for backward. */
static void lora_forward(decoder *d, int l, int lin, float *y, const void *x, int64_t N) {
    const ht_param *A = d->layers[l].lora_a[lin], *Bp = d->layers[l].lora_b[lin];
    if (!A) return;
    int64_t out, in, R = d->lora_rank;
    linear_shape(d, lin, &out, &in);
    ht_dtype cd = A->compute_dtype, precision = A->compute_precision;
    const void *xin = adapter_input(d, x, N, in, l, lin, cd, precision);
    void *h = d->acts[l].lora_h[lin];
    ht_kernels()->gemm(false, true, N, R, in, 1.0f, xin, in, A->compute, in, cd, 0.0f, d->lora_h32, R);
    to_operand(h, d->lora_h32, (size_t)(N * R), cd, precision);
    ht_kernels()->gemm(false, true, N, out, R, d->lora_scale, h, R, Bp->compute, R, cd, 1.0f, y, out);
}

/* Given dy (N, out) and dy_op (dy as the GEMMs read it): B.grad += s dyᵀ h,
 * dh = s dy B, A.grad += dhᵀ dropout(x), dx += dropout'(dh A). */
static void lora_backward(decoder *d, int l, int lin, float *dx, const void *dy_op, const void *x, int64_t N) {
    const ht_param *A = d->layers[l].lora_a[lin], *Bp = d->layers[l].lora_b[lin];
    if (!A) return;
    int64_t out, in, R = d->lora_rank;
    linear_shape(d, lin, &out, &in);
    ht_dtype cd = A->compute_dtype, precision = A->compute_precision;
    const void *h = d->acts[l].lora_h[lin];
    if (Bp->grad) ht_kernels()->gemm(true, false, out, R, N, d->lora_scale, dy_op, out, h, R, cd, 1.0f, Bp->grad, R);
    ht_kernels()->gemm(false, false, N, R, out, d->lora_scale, dy_op, out, Bp->compute, R, cd, 0.0f, d->lora_h32, R);
    to_operand(d->lora_dh, d->lora_h32, (size_t)(N * R), cd, precision);
    if (A->grad) {
        const void *xin = adapter_input(d, x, N, in, l, lin, cd, precision);
        ht_kernels()->gemm(true, false, R, in, N, 1.0f, d->lora_dh, R, xin, in, cd, 1.0f, A->grad, in);
    }
    if (!dropout_on(d)) {
        ht_kernels()->gemm(false, false, N, in, R, 1.0f, d->lora_dh, R, A->compute, in, cd, 1.0f, dx, in);
        return;
    }
    ht_kernels()->gemm(false, false, N, in, R, 1.0f, d->lora_dh, R, A->compute, in, cd, 0.0f, d->lora_dx, in);
    apply_dropout(d, d->lora_dx, N, in, l, lin);
    ht_kernels()->add(dx, dx, d->lora_dx, N * in);
}

/* The precision of the layers' matmul operands: the compute dtype, or the
 * 16-bit precision FP32 operands are rounded to (ht_model_set_compute on a
 * kernel that runs 16-bit products in FP32). The attention's products take
 * theirs in it too. */
static ht_dtype operand_precision(const ht_model *m, const decoder *d) {
    ht_dtype cd = compute_dtype(d);
    return cd != HT_DTYPE_F32 ? cd : m->compute_precision;
}

/* The shape of every layer's attention call. */
static ht_attention_shape attention_shape(const decoder *d) {
    return (ht_attention_shape){
        .B = d->B, .T = d->T, .H = d->H, .KV = d->KVh, .Dk = d->Dk, .Dv = d->Dv, .scale = d->attn_scale};
}

/* Where each head's rotary dims lie: q (N, H, Dk) and k (N, KVh, Dk) have
 * them at the end of each head (all of a plain head); MLA's shared rotary
 * key is the last Dr of kv_a_proj_with_mqa's rows. */
static ht_rope_layout rope_q(const decoder *d) {
    return (ht_rope_layout){(int64_t)d->H * d->Dk, d->Dk, d->Dk - d->rope_dim, d->H, d->rope_dim, d->rope_interleave};
}
static ht_rope_layout rope_k(const decoder *d) {
    return (ht_rope_layout){(int64_t)d->KV * d->D, d->D, 0, d->KV, d->D, false};
}
static ht_rope_layout rope_kpe(const decoder *d, int64_t ld, int64_t offset) {
    return (ht_rope_layout){ld, 0, offset, 1, d->Dr, d->rope_interleave};
}

/* a->o (B, T, H, Dv) = softmax(s q kᵀ, causal) v, tiled (kernels/cpu/attention.c);
 * under context parallelism over every key of the sequences (model/context.c),
 * a->q, a->k, a->v and a->lse then left in its attention layout for backward.
 * With `track`, layer l's slot of head_max (of head_max_host under context
 * parallelism) gets each head's largest logit (before masking), which
 * fold_head_max adds to m->attn_max_logit after the last layer. */
static void attention_forward(ht_model *m, decoder *d, int l, layer_acts *a, bool track) {
    const size_t slot = (size_t)l * d->B * d->H;
    ht_attention_shape shape = attention_shape(d);
    if (m->cache_capacity > 0) {
        /* Generation: this forward's T keys and values join the layer's
         * cache after the P cached ones, and the queries (positions P ..)
         * attend to all P + T of them. */
        const int64_t P = m->cache_tokens, kd = (int64_t)d->KVh * d->Dk, vd = (int64_t)d->KVh * d->Dv;
        float *k = d->kcache + (size_t)l * m->cache_capacity * kd, *v = d->vcache + (size_t)l * m->cache_capacity * vd;
        ht_kernels()->copy(k + P * kd, a->k, (size_t)(d->T * kd) * sizeof(float));
        ht_kernels()->copy(v + P * vd, a->v, (size_t)(d->T * vd) * sizeof(float));
        shape.Tk = P + d->T, shape.q0 = P;
        ht_kernels()->attention_forward(a->o, a->lse, NULL, a->q, k, v, &shape, operand_precision(m, d), d->cache_work);
    } else if (d->cp)
        ht_cp_attention_forward(d->cp, &m->context, a->o, a->lse, track ? d->head_max_host + slot : NULL, a->q, a->k,
                                a->v, operand_precision(m, d));
    else
        ht_kernels()->attention_forward(a->o, a->lse, track ? d->head_max + slot : NULL, a->q, a->k, a->v, &shape,
                                        operand_precision(m, d), d->att_work);
}

/* m->attn_max_logit (L, H) raised to every layer's head maxima of this
 * forward, over the batch: one download for all layers where the kernels'
 * memory holds them. */
static void fold_head_max(ht_model *m, decoder *d) {
    const int64_t L = d->L, B = d->B, H = d->H;
    const float *hm = d->head_max_host;
    if (!d->cp) ht_kernels()->download(d->head_max_host, d->head_max, (size_t)(L * B * H) * sizeof(float));
    for (int64_t l = d->l0; l < d->l1; l++) { /* the stage's layers (the rest are other ranks') */
        float *max_logit = m->attn_max_logit + l * H;
        for (int64_t h = 0; h < H; h++)
            for (int64_t b = 0; b < B; b++) {
                const float x = hm[(l * B + b) * H + h];
                max_logit[h] = x > max_logit[h] ? x : max_logit[h];
            }
    }
}

/* ------------------------------------------------------------------ forward / backward */

/* Layer l's forward from its input acts[l].resid, keeping what its backward
 * reads, and next = its output (NULL: not written, as when backward
 * recomputes the layer). dln is its scratch. */
/* DeepseekV3RMSNorm's default eps: q_a_layernorm and kv_a_layernorm are
 * built without rms_norm_eps. */
static const float MLA_NORM_EPS = 1e-6f;

/* Multi-Latent Attention's q, k, v from ln1 (DeepseekV3Attention): q from
 * q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj; kv_a_proj_with_mqa's
 * latent -> kv_a_layernorm -> kv_b_proj gives each head's k_nope and v, its
 * last Dr the rotary key every head shares. */
static void mla_forward(decoder *d, int l, layer_acts *a, int64_t N, ht_dtype cd, ht_dtype round) {
    const layer_params *p = &d->layers[l];
    const int64_t H = d->H, Rq = d->Rq, Rkv = d->Rkv, Dn = d->Dn, Dr = d->Dr, Dk = d->Dk, Dv = d->Dv;
    if (p->qa_w) {
        linear_forward(a->qa, a->ln1, p->qa_w, NULL, N);
        lora_forward(d, l, LIN_QA, a->qa, a->ln1, N);
        ht_kernels()->rmsnorm_forward(a->qa_ln, cd, a->rstd_qa, a->qa, p->qa_ln->compute, p->qa_ln->compute_dtype, N,
                                      Rq, MLA_NORM_EPS);
        ht_kernels()->round_to(a->qa_ln, (size_t)(N * Rq), round);
        linear_forward(a->q, a->qa_ln, p->qb_w, NULL, N);
        lora_forward(d, l, LIN_QB, a->q, a->qa_ln, N);
    } else {
        linear_forward(a->q, a->ln1, p->q_w, NULL, N);
        lora_forward(d, l, LIN_Q, a->q, a->ln1, N);
    }
    linear_forward(d->kva, a->ln1, p->kva_w, NULL, N);
    lora_forward(d, l, LIN_KVA, d->kva, a->ln1, N);
    const ht_kernel_ops *K = ht_kernels();
    K->copy_rows(a->kv_lat, Rkv, d->kva, Rkv + Dr, N, Rkv, false); /* the latent, the first Rkv of each row */
    ht_kernels()->rmsnorm_forward(a->kv_ln, cd, a->rstd_kv, a->kv_lat, p->kva_ln->compute, p->kva_ln->compute_dtype, N,
                                  Rkv, MLA_NORM_EPS);
    ht_kernels()->round_to(a->kv_ln, (size_t)(N * Rkv), round);
    linear_forward(d->kvb, a->kv_ln, p->kvb_w, NULL, N);
    lora_forward(d, l, LIN_KVB, d->kvb, a->kv_ln, N);
    const ht_rope_layout lq = rope_q(d), lk = rope_kpe(d, Rkv + Dr, Rkv);
    ht_kernels()->rope_forward(a->q, d->rope_cos, d->rope_sin, d->B, d->T, &lq);
    ht_kernels()->rope_forward(d->kva, d->rope_cos, d->rope_sin, d->B, d->T, &lk);
    /* Each head's k = [its k_nope | the shared rotary key], v its own. */
    K->copy_rows(a->k, Dk, d->kvb, Dn + Dv, N * H, Dn, false);
    for (int64_t h = 0; h < H; h++) K->copy_rows(a->k + h * Dk + Dn, H * Dk, d->kva + Rkv, Rkv + Dr, N, Dr, false);
    K->copy_rows(a->v, Dv, d->kvb + Dn, Dn + Dv, N * H, Dv, false);
}

/* The gradients of mla_forward's params and ln1 (into dln, overwritten) from
 * attention's dq, dk, dv: the heads' rotary-key gradients sum into the one key. */
static void mla_backward(decoder *d, int l, layer_acts *a, int64_t N) {
    const layer_params *p = &d->layers[l];
    const int64_t H = d->H, Rq = d->Rq, Rkv = d->Rkv, Dn = d->Dn, Dr = d->Dr, Dk = d->Dk, Dv = d->Dv;
    const ht_rope_layout lq = rope_q(d), lk = rope_kpe(d, Dr, 0);
    const ht_kernel_ops *K = ht_kernels();
    K->rope_backward(d->dq, d->rope_cos, d->rope_sin, d->B, d->T, &lq);
    /* kv_b_proj's output gradient [dk_nope | dv] per head; the shared key's, summed over the heads in order. */
    K->copy_rows(d->kvb, Dn + Dv, d->dk, Dk, N * H, Dn, false);
    K->copy_rows(d->kvb + Dn, Dn + Dv, d->dv, Dv, N * H, Dv, false);
    for (int64_t h = 0; h < H; h++) K->copy_rows(d->dkpe, Dr, d->dk + h * Dk + Dn, H * Dk, N, Dr, h > 0);
    ht_kernels()->rope_backward(d->dkpe, d->rope_cos, d->rope_sin, d->B, d->T, &lk);
    const void *dy = linear_backward(d, d->dlat, 0.0f, d->kvb, a->kv_ln, p->kvb_w, NULL, N);
    lora_backward(d, l, LIN_KVB, d->dlat, dy, a->kv_ln, N);
    ht_kernels()->zero(d->dlat2, (size_t)(N * Rkv) * sizeof(float));
    ht_kernels()->rmsnorm_backward(d->dlat2, p->kva_ln->grad, d->dlat, a->kv_lat, p->kva_ln->compute,
                                   p->kva_ln->compute_dtype, a->rstd_kv, N, Rkv);
    K->copy_rows(d->kva, Rkv + Dr, d->dlat2, Rkv, N, Rkv, false);
    K->copy_rows(d->kva + Rkv, Rkv + Dr, d->dkpe, Dr, N, Dr, false);
    dy = linear_backward(d, d->dln, 0.0f, d->kva, a->ln1, p->kva_w, NULL, N);
    lora_backward(d, l, LIN_KVA, d->dln, dy, a->ln1, N);
    if (p->qa_w) {
        dy = linear_backward(d, d->dqa, 0.0f, d->dq, a->qa_ln, p->qb_w, NULL, N);
        lora_backward(d, l, LIN_QB, d->dqa, dy, a->qa_ln, N);
        ht_kernels()->zero(d->dqa2, (size_t)(N * Rq) * sizeof(float));
        ht_kernels()->rmsnorm_backward(d->dqa2, p->qa_ln->grad, d->dqa, a->qa, p->qa_ln->compute,
                                       p->qa_ln->compute_dtype, a->rstd_qa, N, Rq);
        dy = linear_backward(d, d->dln, 1.0f, d->dqa2, a->ln1, p->qa_w, NULL, N);
        lora_backward(d, l, LIN_QA, d->dln, dy, a->ln1, N);
    } else {
        dy = linear_backward(d, d->dln, 1.0f, d->dq, a->ln1, p->q_w, NULL, N);
        lora_backward(d, l, LIN_Q, d->dln, dy, a->ln1, N);
    }
}

static void layer_forward(ht_model *m, decoder *d, int l, float *next) {
    int B = d->B, T = d->T;
    int64_t N = (int64_t)B * T, C = d->C, F = d->F, QD = (int64_t)d->H * d->Dv;
    ht_dtype cd = compute_dtype(d);
    ht_dtype round = cd == HT_DTYPE_F32 ? m->compute_precision : HT_DTYPE_F32;
    const float eps = (float)m->config.rms_norm_eps;
    layer_params *p = &d->layers[l];
    layer_acts *a = &d->acts[l];
    const int64_t Ns = d->Ns; /* the residual stream's rows: N, or this rank's share (sequence parallelism) */
    ht_kernels()->rmsnorm_forward(a->ln1, cd, a->rstd1, a->resid, p->ln1->compute, p->ln1->compute_dtype, Ns, C, eps);
    ht_kernels()->round_to(a->ln1, (size_t)(Ns * C), round);
    if (d->mla) {
        mla_forward(d, l, a, N, cd, round);
    } else {
        const void *x = tp_gather_input(d, a->ln1);
        linear_forward(a->q, x, p->q_w, p->q_b, N);
        lora_forward(d, l, LIN_Q, a->q, x, N);
        linear_forward(a->k, x, p->k_w, p->k_b, N);
        lora_forward(d, l, LIN_K, a->k, x, N);
        linear_forward(a->v, x, p->v_w, p->v_b, N);
        lora_forward(d, l, LIN_V, a->v, x, N);
        const ht_rope_layout lq = rope_q(d), lk = rope_k(d);
        ht_kernels()->rope_forward(a->q, d->rope_cos, d->rope_sin, B, T, &lq);
        ht_kernels()->rope_forward(a->k, d->rope_cos, d->rope_sin, B, T, &lk);
    }
    /* a recomputation (next NULL) leaves the maxima alone: its forward's are kept */
    attention_forward(m, d, l, a, m->track_attn_max && next);
    ht_kernels()->convert(a->att, cd, a->o, HT_DTYPE_F32, (size_t)(N * QD));
    ht_kernels()->round_to(a->att, (size_t)(N * QD), round);
    linear_forward(d->dln, a->att, p->o_w, NULL, N); /* dln as (N, C) scratch */
    lora_forward(d, l, LIN_O, d->dln, a->att, N);
    ht_kernels()->add(a->resid_mid, a->resid, tp_reduce(d, d->dln), Ns * C);
    ht_kernels()->rmsnorm_forward(a->ln2, cd, a->rstd2, a->resid_mid, p->ln2->compute, p->ln2->compute_dtype, Ns, C,
                                  eps);
    ht_kernels()->round_to(a->ln2, (size_t)(Ns * C), round);
    if (p->sparse >= 0) { /* token by token: on the residual stream's rows */
        ht_moe_forward(d->moe, p->sparse, d->dln, a->ln2, Ns, round);
        if (next) ht_kernels()->add(next, a->resid_mid, d->dln, Ns * C);
        return;
    }
    const void *x = tp_gather_input(d, a->ln2);
    linear_forward(a->gate, x, p->gate_w, NULL, N);
    lora_forward(d, l, LIN_GATE, a->gate, x, N);
    linear_forward(a->up, x, p->up_w, NULL, N);
    lora_forward(d, l, LIN_UP, a->up, x, N);
    ht_kernels()->swiglu_forward(a->h, cd, a->gate, a->up, N * F);
    ht_kernels()->round_to(a->h, (size_t)(N * F), round);
    linear_forward(d->dln, a->h, p->down_w, NULL, N);
    lora_forward(d, l, LIN_DOWN, d->dln, a->h, N);
    const float *y = tp_reduce(d, d->dln);
    if (next) ht_kernels()->add(next, a->resid_mid, y, Ns * C);
}

/* The logits of tokens [r0, r0 + n) of lnf (every token's) into d->logits. fsdp_config.mix_precision.output_dtype:
 * they leave the model in that precision; the loss reads them in FP32 (the
 * backward pass treats the rounding as the identity). */
static void head_forward(const ht_model *m, decoder *d, const void *lnf, int64_t r0, int64_t n) {
    const int64_t C = d->C, V = d->V;
    const size_t row = (size_t)C * ht_dtype_size(compute_dtype(d));
    linear_forward(d->logits, (const char *)lnf + (size_t)r0 * row, d->head, NULL, n);
    if (m->output_dtype == HT_DTYPE_BF16 || m->output_dtype == HT_DTYPE_F16)
        ht_kernels()->round_to(d->logits, (size_t)(n * V), m->output_dtype);
}

/* The vocabulary-parallel cross-entropy of the n rows of d->logits (this
 * rank's slice of each row): each rank's row maxima, their max over the
 * group, then each rank's sums of exponentials rescaled to it and the
 * target logits (from the rank whose slice holds the target, 0 elsewhere)
 * summed over the group. rows get the whole rows' statistics, for
 * backward; returns the sum of the counted rows' losses, *count their count. */
static double tp_cross_entropy(decoder *d, const int32_t *targets, int64_t r0, int64_t n, int64_t *count) {
    const ht_tensor_parallel *tp = d->tp;
    const ht_kernel_ops *K = ht_kernels();
    ht_softmax_row *rows = d->softmax_rows + r0;
    K->softmax_partial(d->logits, d->targets + r0, n, d->V, d->v0, rows, d->tp_picked);
    /* The statistics on the host: where they are, or downloaded (and the whole rows' uploaded after). */
    ht_softmax_row *hr = rows;
    const float *picked = d->tp_picked;
    if (!K->host_memory) {
        K->download(hr = d->tp_rows, rows, (size_t)n * sizeof(ht_softmax_row));
        K->download(d->tp_picked_host, d->tp_picked, (size_t)n * sizeof(float));
        picked = d->tp_picked_host;
    }
    for (int64_t i = 0; i < n; i++) d->tp_max[i] = hr[i].max;
    tp->max(tp->ctx, d->tp_max, n);
    for (int64_t i = 0; i < n; i++) {
        const double mx = d->tp_max[i];
        d->tp_sums[i] = hr[i].sum > 0 ? hr[i].sum * exp((double)hr[i].max - mx) : 0.0;
        d->tp_sums[n + i] = picked[i];
    }
    tp->sum_f64(tp->ctx, d->tp_sums, 2 * n);
    double total = 0.0;
    int64_t counted = 0;
    for (int64_t i = 0; i < n; i++) {
        hr[i] = (ht_softmax_row){.sum = d->tp_sums[i], .max = d->tp_max[i]};
        if (targets[r0 + i] < 0) continue;
        total += log(d->tp_sums[i]) + (double)d->tp_max[i] - d->tp_sums[n + i];
        counted++;
    }
    if (hr != rows) K->upload(rows, hr, (size_t)n * sizeof(ht_softmax_row));
    *count = counted;
    return total;
}

/* m->input_dtype: a module's FP32 input (the hidden states, n values)
 * rounded as it enters, in place: what the module computes from and what
 * its backward reads. The gradient passes the rounding unchanged. */
static void cast_input(const ht_model *m, int module, float *x, int64_t n) {
    if (m->input_dtype && m->input_dtype[module] != HT_DTYPE_F32)
        ht_kernels()->round_to(x, (size_t)n, m->input_dtype[module]);
}

/* Context parallelism (m->context): the attention's scratch, and this
 * forward's rotary rows at the positions of the T tokens this rank holds of
 * each sequence. Without it, the tables themselves. */
static ht_status prepare_context(ht_model *m, decoder *d, int T, ht_error *err) {
    d->context = &m->context;
    d->cp_size = ht_context_size(&m->context);
    const int64_t half = d->rope_dim / 2, P = m->cache_capacity > 0 ? m->cache_tokens : 0;
    d->rope_cos = d->cos_t + P * half, d->rope_sin = d->sin_t + P * half; /* generation: from the cache's end */
    if (d->cp_size <= 1) {
        ht_cp_attention_free(d->cp);
        d->cp = NULL;
        return HT_OK;
    }
    const ht_attention_shape shape = attention_shape(d);
    ht_status s = ht_cp_attention_size(&d->cp, &m->context, &shape, err);
    if (s != HT_OK) return s;
    const size_t row = (size_t)half * sizeof(float);
    if (d->cp_T < T) {
        ht_kernels()->free(d->cp_cos);
        ht_kernels()->free(d->cp_sin);
        d->cp_cos = ht_kernels()->alloc((size_t)T * row);
        d->cp_sin = ht_kernels()->alloc((size_t)T * row);
        d->cp_T = d->cp_cos && d->cp_sin ? T : 0;
        if (!d->cp_T) return ht_fail(err, HT_ERR_OOM, "cannot allocate the rotary rows of %d tokens", T);
    }
    for (int64_t t = 0; t < T; t++) {
        const int64_t pos = ht_context_position(&m->context, T, t);
        ht_kernels()->copy(d->cp_cos + t * half, d->cos_t + pos * half, row);
        ht_kernels()->copy(d->cp_sin + t * half, d->sin_t + pos * half, row);
    }
    d->rope_cos = d->cp_cos, d->rope_sin = d->cp_sin;
    return HT_OK;
}

static ht_status decoder_forward(ht_model *m, const int32_t *inputs, const int32_t *targets, int B, int T, float *loss,
                                 ht_error *err) {
    decoder *d = m->impl;
    if (B <= 0 || T <= 0) return ht_fail(err, HT_ERR_INVALID, "forward: batch %d x %d is empty", B, T);
    /* Under context parallelism the sequences are the group's size times the T tokens this rank holds. */
    const bool cached = m->cache_capacity > 0;
    const int64_t Tg = cached ? m->cache_tokens + T : (int64_t)T * ht_context_size(&m->context);
    if (cached && (B != 1 || targets || Tg > m->cache_capacity))
        return ht_fail(err, HT_ERR_INVALID,
                       "forward with the key/value cache: batch %d x %d after %lld cached tokens%s; it takes one "
                       "sequence (batch 1), no targets, and %lld tokens in all",
                       B, T, (long long)m->cache_tokens, targets ? " with targets" : "", (long long)m->cache_capacity);
    if (Tg > m->config.max_position_embeddings)
        return ht_fail(err, HT_ERR_INVALID, "sequence length %lld is longer than model.max_position_embeddings (%d)",
                       (long long)Tg, m->config.max_position_embeddings);
    int64_t N = (int64_t)B * T, C = d->C, V = d->V, Vg = m->config.vocab_size;
    if (d->tp_size > 1 && !d->tp->sum)
        return ht_fail(err, HT_ERR_INVALID,
                       "forward: the model is rank %d of a tensor-parallel group of %d, but no collectives are "
                       "attached (ht_tensor_parallel_attach)",
                       d->tp->rank, d->tp_size);
    for (int64_t n = 0; n < N; n++) {
        if (inputs[n] < 0 || inputs[n] >= Vg)
            return ht_fail(err, HT_ERR_INVALID, "input token %d at position %lld is outside the vocabulary [0, %lld)",
                           inputs[n], (long long)n, (long long)Vg);
        if (targets && targets[n] >= Vg)
            return ht_fail(err, HT_ERR_INVALID, "target token %d at position %lld is outside the vocabulary [0, %lld)",
                           targets[n], (long long)n, (long long)Vg);
    }
    if (sequence_parallel(m, d) && N % d->tp_size != 0)
        return ht_fail(err, HT_ERR_INVALID,
                       "forward: %lld tokens (batch %d x %d) do not split over the %d ranks of sequence parallelism",
                       (long long)N, B, T, d->tp_size);
    d->Ns = sequence_parallel(m, d) ? N / d->tp_size : N;
    const int64_t Ns = d->Ns;
    if (m->slot < 0 || m->slot >= slots_of(m))
        return ht_fail(err, HT_ERR_INVALID, "forward: micro-batch slot %d of %d", m->slot, slots_of(m));
    select_chunk(m, d, chunk_of(m, m->slot));
    if (!d->has_embed && !m->stage_in)
        return ht_fail(err, HT_ERR_INVALID, "forward: pipeline stage of layers %d-%d has no input (m->stage_in)", d->l0,
                       d->l1 - 1);
    ht_status s = size_activations(m, d, B, T, err);
    if (s == HT_OK) select_slot(d, m->slot);
    if (s == HT_OK) s = prepare_context(m, d, T, err);
    if (s == HT_OK && d->moe) s = ht_moe_begin(d->moe, Ns, &m->experts, d->tp_size > 1 ? d->tp : NULL, err);
    if (s != HT_OK) return s;
    if (m->stage_sums_count && !d->has_embed) { /* the earlier stages' routing sums, added to from here */
        if (!m->stage_sums_in)
            return ht_fail(err, HT_ERR_INVALID, "forward: pipeline stage of layers %d-%d has no routing sums", d->l0,
                           d->l1 - 1);
        ht_moe_routing_set(d->moe, m->stage_sums_in);
    }
    size_t experts = 0;
    for (int k = 0; k < d->moe_count; k++) experts += ht_moe_activation_bytes(d->moes[k]);
    m->activation_bytes = d->activation_bytes + experts + ht_cp_attention_bytes(d->cp) +
                          (d->cp ? 2 * (size_t)d->cp_T * (size_t)(d->rope_dim / 2) * sizeof(float) : 0);
    d->dropout_seed = m->dropout_seed; /* backward redraws this forward's masks */
    d->dropout_first = m->dropout_first_sequence;
    ht_dtype cd = compute_dtype(d);
    /* Matmul inputs of a coarser precision than their FP32 storage are rounded where they are made. */
    ht_dtype round = cd == HT_DTYPE_F32 ? m->compute_precision : HT_DTYPE_F32;
    const float eps = (float)m->config.rms_norm_eps;

    /* Token embedding into the FP32 residual stream. */
    /* Token embedding into the FP32 residual stream: each token's row is on
     * the rank of its vocabulary slice (tensor parallelism), summed over the
     * group into the residual stream's rows. */
    ht_kernels()->upload(d->inputs, inputs, (size_t)N * sizeof(int32_t)); /* the caller's, host memory */
    if (targets && d->has_head) ht_kernels()->upload(d->targets, targets, (size_t)N * sizeof(int32_t));
    float *first = d->acts[d->l0].resid;
    if (d->has_embed) {
        ht_model_event(m, MOD_EMBED, HT_BEFORE_FORWARD);
        float *embedded = d->sp ? d->dln : first;
        ht_kernels()->embedding_forward(embedded, d->embed->compute, cd, d->inputs, N, C, d->v0, V);
        const float *rows = tp_reduce(d, embedded);
        if (rows != first) ht_kernels()->copy(first, rows, (size_t)(Ns * C) * sizeof(float));
        ht_model_event(m, MOD_EMBED, HT_AFTER_FORWARD);
    } else { /* a later pipeline stage: the previous one's output */
        ht_kernels()->copy(first, m->stage_in, (size_t)(Ns * C) * sizeof(float));
    }

    for (int l = d->l0; l < d->l1; l++) {
        ht_model_event(m, MOD_LAYER(l), HT_BEFORE_FORWARD);
        cast_input(m, MOD_LAYER(l), d->acts[l].resid, Ns * C);
        layer_forward(m, d, l, l + 1 < d->l1 ? d->acts[l + 1].resid : d->resid_final);
        ht_model_event(m, MOD_LAYER(l), HT_AFTER_FORWARD);
    }
    if (m->track_attn_max && !cached) fold_head_max(m, d);
    m->B = B;
    m->T = T;
    m->aux_loss = NAN;
    d->target_count = 0;
    if (!d->has_head) { /* an earlier pipeline stage: its output goes to the next */
        m->stage_out = d->resid_final;
        if (m->stage_sums_count) ht_moe_routing_get(d->moe, m->stage_sums);
        m->logits = NULL;
        if (loss) *loss = NAN;
        return HT_OK;
    }
    ht_model_event(m, MOD_NORM(d), HT_BEFORE_FORWARD);
    cast_input(m, MOD_NORM(d), d->resid_final, Ns * C);
    ht_kernels()->rmsnorm_forward(d->lnf, cd, d->rstdf, d->resid_final, d->norm->compute, d->norm->compute_dtype, Ns, C,
                                  eps);
    ht_kernels()->round_to(d->lnf, (size_t)(Ns * C), round);
    ht_model_event(m, MOD_NORM(d), HT_AFTER_FORWARD);
    ht_model_event(m, MOD_HEAD(d), HT_BEFORE_FORWARD);
    double sum = 0.0, mean = NAN;
    const void *lnf = tp_gather_input(d, d->lnf); /* every token's final norm */
    if (cached) {                                 /* generation: the last token's logits alone */
        head_forward(m, d, lnf, N - 1, 1);
        ht_model_event(m, MOD_HEAD(d), HT_AFTER_FORWARD);
        m->logits = d->logits;
        m->cache_tokens += T;
        if (loss) *loss = NAN;
        return HT_OK;
    }
    for (int64_t r0 = 0; r0 < N; r0 += d->head_rows) {
        const int64_t n = N - r0 < d->head_rows ? N - r0 : d->head_rows;
        head_forward(m, d, lnf, r0, n);
        if (!targets) continue;
        int64_t count = 0;
        if (d->tp_size > 1) {
            sum += tp_cross_entropy(d, targets, r0, n, &count);
        } else {
            mean = ht_kernels()->cross_entropy_forward(d->logits, d->targets + r0, n, V, &count, d->softmax_rows + r0);
            if (count) sum += mean * (double)count;
        }
        d->target_count += count;
    }
    ht_model_event(m, MOD_HEAD(d), HT_AFTER_FORWARD);
    /* One chunk: its mean as it is; several (or a vocabulary split over
     * ranks): their sum over every target. */
    if (d->head_rows < N || d->tp_size > 1) mean = d->target_count ? sum / (double)d->target_count : NAN;
    m->logits = d->head_rows == N ? d->logits : NULL;
    if (loss) *loss = targets ? (float)mean : NAN;
    if (d->moe && m->config.moe.output_router_logits) {
        /* the sequences' sums, not this rank's share's */
        if (d->cp) ht_moe_sum_routing(d->moe, m->context.sum, m->context.group_ctx);
        if (d->sp) ht_moe_sum_routing(d->moe, d->tp->sum_f64, d->tp->ctx);
        m->aux_loss = (float)ht_moe_aux_loss(d->moe);
        if (loss && targets) *loss = (float)(*loss + m->config.moe.router_aux_loss_coef * m->aux_loss);
    }
    return HT_OK;
}

/* Loss -> logits -> final norm: the gradient of the last layer's output into d->dresid. */
static void head_backward(ht_model *m, decoder *d, float scale) {
    const int64_t N = (int64_t)d->B * d->T, C = d->C, V = d->V;
    /* No target at all still runs backward (adding zeros): every rank runs
     * every module, so that parallel/'s collectives meet. */
    const float loss_scale = d->target_count ? scale / (float)d->target_count : 0.0f;
    ht_model_event(m, MOD_HEAD(d), HT_BEFORE_BACKWARD);
    const size_t lnf_row = (size_t)C * ht_dtype_size(compute_dtype(d));
    const void *lnf = tp_gather_input(d, d->lnf); /* every token's final norm again */
    for (int64_t r0 = 0; r0 < N; r0 += d->head_rows) {
        const int64_t n = N - r0 < d->head_rows ? N - r0 : d->head_rows;
        if (d->head_rows < N) head_forward(m, d, lnf, r0, n); /* chunks: the logits again, the same bits */
        /* dlogits (n, V), from the forward's row statistics (the same logits, bit for bit). */
        ht_kernels()->cross_entropy_backward(d->logits, d->targets + r0, n, V, d->v0, loss_scale,
                                             d->target_count ? d->softmax_rows + r0 : NULL);
        (void)linear_backward(d, d->dln + r0 * C, 0.0f, d->logits, (const char *)lnf + (size_t)r0 * lnf_row, d->head,
                              NULL, n);
    }
    const float *dnorm_out = tp_reduce(d, d->dln); /* every vocabulary slice's share of the final norm's gradient */
    ht_model_event(m, MOD_HEAD(d), HT_AFTER_BACKWARD);
    ht_model_event(m, MOD_NORM(d), HT_BEFORE_BACKWARD);
    ht_kernels()->zero(d->dresid, (size_t)(d->Ns * C) * sizeof(float));
    norm_backward(d, d->dresid, d->norm, dnorm_out, d->resid_final, d->rstdf);
    ht_model_event(m, MOD_NORM(d), HT_AFTER_BACKWARD);
}

static void decoder_backward(ht_model *m, float scale) {
    decoder *d = m->impl;
    select_chunk(m, d, chunk_of(m, m->slot));
    select_slot(d, m->slot);
    int B = d->B, T = d->T;
    int64_t N = (int64_t)B * T, C = d->C, V = d->V;
    const ht_moe_config *mc = &m->config.moe;
    /* The load-balancing loss counts every token, targets or not. */
    /* Context parallelism: every rank of the group has the whole sequences'
     * load-balancing loss, and its tokens' share of its gradient is summed
     * over the group with the cross-entropy's, whose each rank's is the
     * mean over its share: the group's size restores its weight. */
    const float aux_scale = d->moe && mc->output_router_logits
                                ? (float)(mc->router_aux_loss_coef * scale * (d->cp ? d->cp_size : 1))
                                : 0.0f;
    const ht_dtype round = compute_dtype(d) == HT_DTYPE_F32 ? m->compute_precision : HT_DTYPE_F32;

    if (d->has_head) {
        head_backward(m, d, scale);
    } else { /* an earlier pipeline stage: the gradient of its output, from the next */
        ht_kernels()->copy(d->dresid, m->stage_out_grad, (size_t)(d->Ns * C) * sizeof(float));
        if (m->stage_sums_count) ht_moe_routing_set(d->moe, m->stage_sums_grad); /* the whole model's */
    }

    for (int l = d->l1 - 1; l >= d->l0; l--) {
        ht_model_event(m, MOD_LAYER(l), HT_BEFORE_BACKWARD);
        /* model.recompute: the layer's activations again, from its kept input,
         * into the buffers the recomputed layers share (the same products in
         * the same order: the same bits). */
        if (recomputed(m, l)) layer_forward(m, d, l, NULL);
        layer_params *p = &d->layers[l];
        layer_acts *a = &d->acts[l];
        /* MLP block: next = resid_mid + down(silu(gate) * up). dresid flows to resid_mid unchanged. */
        const void *dy;
        const float *dx = d->dln;
        if (p->sparse >= 0) { /* token by token: on the residual stream's rows */
            ht_moe_backward(d->moe, p->sparse, d->dln, d->dresid, a->ln2, d->Ns, aux_scale, round);
        } else {
            dy = linear_backward(d, d->dh, 0.0f, tp_gather_grad(d, d->dresid), a->h, p->down_w, NULL, N);
            lora_backward(d, l, LIN_DOWN, d->dh, dy, a->h, N);
            ht_kernels()->swiglu_backward(d->dgate, d->dup, d->dh, a->gate, a->up, N * d->F);
            const void *x = tp_gather_input(d, a->ln2);
            dy = linear_backward(d, d->dln, 0.0f, d->dgate, x, p->gate_w, NULL, N);
            lora_backward(d, l, LIN_GATE, d->dln, dy, x, N);
            dy = linear_backward(d, d->dln, 1.0f, d->dup, x, p->up_w, NULL, N);
            lora_backward(d, l, LIN_UP, d->dln, dy, x, N);
            dx = tp_reduce(d, d->dln);
        }
        norm_backward(d, d->dresid, p->ln2, dx, a->resid_mid, a->rstd2);
        /* Attention block: resid_mid = resid + o_proj(attention(q, k, v)). */
        dy = linear_backward(d, d->datt, 0.0f, tp_gather_grad(d, d->dresid), a->att, p->o_w, NULL, N);
        lora_backward(d, l, LIN_O, d->datt, dy, a->att, N);
        const ht_attention_shape shape = attention_shape(d);
        if (d->cp)
            ht_cp_attention_backward(d->cp, &m->context, d->dq, d->dk, d->dv, d->datt, a->o, a->lse, a->q, a->k, a->v,
                                     operand_precision(m, d));
        else
            ht_kernels()->attention_backward(d->dq, d->dk, d->dv, d->datt, a->o, a->lse, a->q, a->k, a->v, &shape,
                                             operand_precision(m, d), d->att_work);
        if (d->mla) {
            mla_backward(d, l, a, N);
        } else {
            const ht_rope_layout lq = rope_q(d), lk = rope_k(d);
            ht_kernels()->rope_backward(d->dq, d->rope_cos, d->rope_sin, B, T, &lq);
            ht_kernels()->rope_backward(d->dk, d->rope_cos, d->rope_sin, B, T, &lk);
            const void *x = tp_gather_input(d, a->ln1);
            dy = linear_backward(d, d->dln, 0.0f, d->dq, x, p->q_w, p->q_b, N);
            lora_backward(d, l, LIN_Q, d->dln, dy, x, N);
            dy = linear_backward(d, d->dln, 1.0f, d->dk, x, p->k_w, p->k_b, N);
            lora_backward(d, l, LIN_K, d->dln, dy, x, N);
            dy = linear_backward(d, d->dln, 1.0f, d->dv, x, p->v_w, p->v_b, N);
            lora_backward(d, l, LIN_V, d->dln, dy, x, N);
        }
        norm_backward(d, d->dresid, p->ln1, tp_reduce(d, d->dln), a->resid, a->rstd1);
        ht_model_event(m, MOD_LAYER(l), HT_AFTER_BACKWARD);
    }

    /* Embedding: scatter-add rows (every token's gradient, into this rank's
     * vocabulary slice). Threads split the columns so no two write the same float. */
    if (!d->has_embed) { /* a later pipeline stage: the gradient of its input, to the previous */
        m->stage_in_grad = d->dresid;
        if (m->stage_sums_count) ht_moe_routing_get(d->moe, m->stage_sums);
        return;
    }
    ht_model_event(m, MOD_EMBED, HT_BEFORE_BACKWARD);
    if (d->embed->grad)
        ht_kernels()->embedding_backward(d->embed->grad, tp_gather_grad(d, d->dresid), d->inputs, N, C, d->v0, V);
    ht_model_event(m, MOD_EMBED, HT_AFTER_BACKWARD);
}

static void free_cache(decoder *d) {
    ht_kernels()->free(d->kcache);
    ht_kernels()->free(d->vcache);
    ht_kernels()->free(d->cache_work);
    d->kcache = d->vcache = d->cache_work = NULL;
}

static ht_status decoder_set_cache(ht_model *m, int64_t max_tokens, ht_error *err) {
    decoder *d = m->impl;
    free_cache(d);
    if (max_tokens <= 0) return HT_OK;
    const size_t keys = (size_t)d->L * (size_t)max_tokens * (size_t)d->KVh, threads = (size_t)omp_get_max_threads();
    d->kcache = ht_kernels()->alloc(keys * (size_t)d->Dk * sizeof(float));
    d->vcache = ht_kernels()->alloc(keys * (size_t)d->Dv * sizeof(float));
    d->cache_work = ht_kernels()->alloc(threads * ht_kernels()->attention_workspace_floats(max_tokens, d->Dk, d->Dv) *
                                        sizeof(float));
    if (d->kcache && d->vcache && d->cache_work) return HT_OK;
    free_cache(d);
    return ht_fail(err, HT_ERR_OOM, "cannot allocate a key/value cache of %lld tokens (%.1f MiB)",
                   (long long)max_tokens, (double)keys * (d->Dk + d->Dv) * sizeof(float) / (1 << 20));
}

static void decoder_free(ht_model *m) {
    decoder *d = m->impl;
    ht_free(m->recompute);
    ht_free(m->stage_sums);
    if (d) {
        free_cache(d);
        ht_kernels()->free(d->act_block);
        ht_free(d->head_max_host);
        ht_free(d->tp_host);
        for (int k = d->moe_count - 1; k >= 0; k--) ht_moe_free(d->moes[k]); /* the clones first: they share counts */
        free(d->moes);
        ht_free(d->slots);
        ht_free(d->all_acts);
        ht_free(d->layers);
        ht_kernels()->free(d->cos_t);
        ht_kernels()->free(d->sin_t);
        ht_kernels()->free(d->cp_cos);
        ht_kernels()->free(d->cp_sin);
        ht_cp_attention_free(d->cp);
        ht_free(d);
    }
    ht_free(m->modules);
    ht_free(m->input_dtype);
    ht_free(m->attn_max_logit);
    ht_params_free(&m->params);
    ht_free(m);
}

/* The tensor-parallel plan (ht_tensor_parallel, Megatron's layout): which
 * dim of each weight a rank holds a slice of, by the end of its name (a
 * sparse layer's shared expert is an MLP: its gate_proj, up_proj and
 * down_proj split as the dense one's); the rest whole on every rank: the
 * norms, a sparse layer's router, shared-expert gate and routed experts
 * (Megatron-Core's: experts split by expert parallelism, not by TP). */
static const struct {
    const char *suffix;
    int dim;
} TP_PLAN[] = {
    {"embed_tokens.weight", 0}, {"lm_head.weight", 0},   {"q_proj.weight", 0},  {"q_proj.bias", 0},
    {"k_proj.weight", 0},       {"k_proj.bias", 0},      {"v_proj.weight", 0},  {"v_proj.bias", 0},
    {"o_proj.weight", 1},       {"gate_proj.weight", 0}, {"up_proj.weight", 0}, {"down_proj.weight", 1},
};

static bool ends_with(const char *s, const char *suffix) {
    const size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

static ht_status decoder_set_tensor_parallel(ht_model *m, int size, int rank, ht_error *err) {
    decoder *d = m->impl;
    const ht_model_config *c = &m->config;
    const char *unsupported = d->mla             ? "Multi-Latent Attention (deepseek_v3)"
                              : d->lora_rank > 0 ? "LoRA adapters (model.lora)"
                                                 : NULL;
    if (unsupported)
        return ht_fail(err, HT_ERR_CONFIG,
                       "parallel.tensor_parallel_size %d: tensor parallelism of %s is not supported yet; expected 1",
                       size, unsupported);
    if (c->num_attention_heads % size || c->num_key_value_heads % size)
        return ht_fail(err, HT_ERR_CONFIG,
                       "parallel.tensor_parallel_size %d must divide model.num_attention_heads (%d) and "
                       "model.num_key_value_heads (%d): each rank holds whole heads",
                       size, c->num_attention_heads, c->num_key_value_heads);
    if (c->vocab_size < size || c->intermediate_size < size)
        return ht_fail(err, HT_ERR_CONFIG,
                       "parallel.tensor_parallel_size %d is larger than model.vocab_size (%d) or "
                       "model.intermediate_size (%d): every rank needs a slice of both",
                       size, c->vocab_size, c->intermediate_size);
    const int shared = c->moe.shared_expert_intermediate_size; /* a sparse layer's shared expert, split as an MLP */
    if (d->moe && shared > 0 && shared < size)
        return ht_fail(err, HT_ERR_CONFIG,
                       "parallel.tensor_parallel_size %d is larger than model.shared_expert_intermediate_size (%d): "
                       "every rank needs a slice of the shared expert",
                       size, shared);
    for (int i = 0; i < m->params.count; i++) {
        ht_param *p = &m->params.items[i];
        for (size_t k = 0; k < sizeof(TP_PLAN) / sizeof(TP_PLAN[0]); k++)
            if (ends_with(p->name, TP_PLAN[k].suffix)) ht_param_split(p, TP_PLAN[k].dim, rank, size);
    }
    d->H /= size;
    d->KV /= size;
    d->KVh = d->KV;
    int64_t f0, f1; /* every dense layer's slice of the MLP width: ht_param_split's */
    ht_param_rows_of(c->intermediate_size, rank, size, &f0, &f1);
    d->F = (int)(f1 - f0);
    d->V = (int)d->embed->shape[0];
    d->v0 = d->embed->tp_offset;
    d->tp = &m->tensor;
    d->tp_size = size;
    return HT_OK;
}

/* The declared model's part one pipeline stage holds: the params of its
 * layers, the embedding on the first stage, the final norm and the LM head
 * on the last; the rest dropped before anything is allocated. Every layer
 * keeps its module (its index, MOD_LAYER(l), is the same on every stage),
 * the other stages' with no params. */
static ht_status decoder_set_pipeline_stage(ht_model *m, const ht_pipeline_stage *st, ht_error *err) {
    decoder *d = m->impl;
    /* The load-balancing loss multiplies sums over every layer: they travel with the hidden states, forward
     * (each stage adding its layers') and back (the whole model's, for each stage's gradient). */
    ht_free(m->stage_sums);
    m->stage_sums = NULL;
    m->stage_sums_count =
        st->ranks * st->chunks > 1 && d->moe && m->config.moe.output_router_logits ? ht_moe_routing_count(d->moe) : 0;
    if (m->stage_sums_count && !(m->stage_sums = ht_alloc((size_t)m->stage_sums_count * sizeof(double))))
        return ht_fail(err, HT_ERR_OOM, "cannot split the model into pipeline stages");
    ht_param_store *ps = &m->params;
    bool *keep = malloc((size_t)(ps->count ? ps->count : 1) * sizeof(bool));
    if (!keep) return ht_fail(err, HT_ERR_OOM, "cannot split the model into pipeline stages");
    for (int i = 0; i < ps->count; i++) {
        const char *name = ps->items[i].name;
        int l = -1;
        if (sscanf(name, "model.layers.%d.", &l) == 1)
            keep[i] = ht_pipeline_holds_layer(st, l);
        else if (strcmp(name, "model.embed_tokens.weight") == 0) /* tied: the last stage's LM head too */
            keep[i] = st->first || (st->last && m->config.tie_word_embeddings);
        else
            keep[i] = st->last; /* model.norm.weight, lm_head.weight */
    }
    ht_params_retain(ps, keep);
    free(keep);
    if (d->moe) chunk_experts(m, st, 0, d->moe); /* its first chunk's (each slot's when sized) */
    ht_param *embed = ht_params_find(ps, "model.embed_tokens.weight");
    if (embed && m->config.tie_word_embeddings) embed->stage_tied = true, embed->stage_copy = !st->first;
    m->stage = *st;
    select_chunk(m, d, 0);
    memset(d->layers, 0, (size_t)d->L * sizeof(layer_params));
    ht_free(m->modules);
    ht_free(m->input_dtype);
    m->modules = NULL;
    m->input_dtype = NULL;
    return declare_modules(m, d, err); /* the pointers into the store again, and each module's params */
}

static const ht_model_ops decoder_ops = {
    .forward = decoder_forward,
    .backward = decoder_backward,
    .free = decoder_free,
    .activation_bytes = decoder_activation_bytes,
    .set_tensor_parallel = decoder_set_tensor_parallel,
    .set_cache = decoder_set_cache,
    .set_pipeline_stage = decoder_set_pipeline_stage,
};

ht_status ht_decoder_build(const ht_model_config *cfg, ht_dtype dtype, ht_model **out, ht_error *err) {
    ht_model *m = ht_alloc(sizeof(ht_model));
    decoder *d = ht_alloc(sizeof(decoder));
    if (!m || !d) {
        ht_free(m);
        ht_free(d);
        return ht_fail(err, HT_ERR_OOM, "cannot allocate the model");
    }
    m->ops = &decoder_ops;
    m->output_dtype = HT_DTYPE_F32;
    m->compute_precision = HT_DTYPE_F32;
    m->track_attn_max = true;
    m->keep_logits = true;
    m->head_chunk_bytes = (int64_t)ht_kernels()->lm_head_chunk_bytes; /* kernels.lm_head_chunk_mib: auto */
    m->context_capable = true;
    m->config = *cfg;
    m->impl = d;
    d->L = cfg->num_hidden_layers;
    d->C = cfg->hidden_size;
    d->F = cfg->intermediate_size;
    d->H = cfg->num_attention_heads;
    d->KV = cfg->num_key_value_heads;
    d->D = ht_model_config_head_dim(cfg);
    d->V = cfg->vocab_size;
    d->mla = ht_model_config_has_mla(cfg);
    d->Dk = d->Dv = d->rope_dim = d->D;
    d->KVh = d->KV;
    d->attn_scale = 1.0f / sqrtf((float)d->D);
    if (d->mla) {
        const ht_mla_config *a = &cfg->mla;
        d->Rq = a->q_lora_rank, d->Rkv = a->kv_lora_rank, d->Dn = a->qk_nope_head_dim, d->Dr = a->qk_rope_head_dim;
        d->Dk = d->Dn + d->Dr, d->Dv = a->v_head_dim, d->KVh = d->H, d->rope_dim = d->Dr;
        d->rope_interleave = a->rope_interleave;
        d->attn_scale = (float)ht_model_config_attention_scale(cfg);
    }
    d->tp_size = 1;
    d->lora_rank = cfg->lora.rank > 0 ? cfg->lora.rank : 0;
    d->lora_scale = (float)ht_lora_scale(&cfg->lora);
    d->lora_dropout = d->lora_rank ? (float)cfg->lora.dropout : 0.0f;
    d->layers = ht_alloc((size_t)d->L * sizeof(layer_params));
    d->l0 = 0, d->l1 = d->L, d->has_embed = d->has_head = true;
    m->stage = ht_pipeline_stage_of(d->L, 1, 1, 0);
    m->slots = 1;
    size_t table = (size_t)cfg->max_position_embeddings * (d->rope_dim / 2) * sizeof(float);
    d->cos_t = ht_kernels()->alloc(table);
    d->sin_t = ht_kernels()->alloc(table);
    m->attn_max_logit = ht_alloc((size_t)d->L * d->H * sizeof(float));
    int sparse = 0;
    for (int l = 0; l < d->L; l++) sparse += ht_model_config_layer_is_sparse(cfg, l);
    if (sparse) d->moe = ht_moe_new(cfg, sparse);
    if (d->moe && (d->moes = malloc(sizeof(ht_moe *)))) d->moes[0] = d->moe, d->moe_count = 1;
    m->expert_tokens = ht_moe_expert_tokens(d->moe);
    ht_status s = HT_OK;
    if (!d->layers || !d->cos_t || !d->sin_t || !m->attn_max_logit || (sparse && (!d->moe || !d->moes)))
        s = ht_fail(err, HT_ERR_OOM, "cannot allocate the model");
    if (s == HT_OK) s = declare_params(m, d, dtype, err);
    if (s == HT_OK) s = declare_modules(m, d, err);
    if (s != HT_OK) {
        decoder_free(m);
        return s;
    }
    ht_model_reset_attn_max(m);
    if ((s = fill_rope_tables(d, cfg, err)) != HT_OK) {
        decoder_free(m);
        return s;
    }
    d->rope_cos = d->cos_t, d->rope_sin = d->sin_t;
    *out = m;
    return HT_OK;
}
