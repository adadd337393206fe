/* The sparse MLP block as transformers' Qwen2MoeSparseMoeBlock and
 * DeepseekV3MoE compute it, with a hand-written backward.
 *
 *   qwen2_moe:
 *   p    = softmax(x Wrᵀ)                     (N, E) FP32, the router
 *   sel  = the k largest p of each token, w their probabilities
 *          (divided by their sum with norm_topk_prob)
 *   y    = Σ_j w_j · down_e(silu(gate_e x) · up_e x)    e = sel_j, summed in expert order
 *        + sigmoid(x wsᵀ) · shared(x)
 *
 *   deepseek_v3 (DeepseekV3TopkRouter; Wr and the bias b are FP32 whatever
 *   the model dtype, x widened to FP32 for the router's product):
 *   s    = sigmoid(x Wrᵀ)                     (N, E) FP32
 *   sel  = the k largest s + b among the experts of the topk_group best of
 *          n_group groups (a group scored by its two largest s + b)
 *   w_j  = s_sel_j (unbiased), / (Σ_j s_sel_j + 1e-20) with norm_topk_prob,
 *          × routed_scaling_factor
 *   y    = Σ_j w_j · expert_e(x) + shared_experts(x)    (ungated; none when n_shared_experts is 0)
 *
 *   Backward reaches Wr and x through the chosen weights only (see
 *   ht_moe_route_grouped_backward): the choice, and so b, has no gradient
 *   (docs/NUMERICS.md, "DeepSeekMoE routing and the aux-loss-free bias update").
 *
 * The routed part runs as grouped GEMMs: every (token, choice) pair is a
 * row, the rows are sorted by expert (a stable counting sort, tokens in
 * order within an expert), and each expert multiplies its rows at once.
 * An expert that no token chose does nothing. Shapes: N tokens, C hidden,
 * E experts, k choices, A = N·k rows, I the expert width, S the shared
 * expert's. Matmul operands are in the compute dtype (cd), as in the dense
 * decoder; everything else is FP32. */
#include "model/moe.h"

#include <math.h>
#include <string.h>

#include "hypertrain/kernels.h"

typedef struct moe_acts {
    /* the tokens' side: this rank's N tokens and their A = N·k rows, sent in expert order */
    float *probs;   /* (N, E) router probabilities */
    int32_t *sel;   /* (N, k) the chosen experts, by decreasing probability */
    float *weight;  /* (N, k) their weights */
    float *psum;    /* (N) the chosen probabilities' sum (norm_topk_prob) */
    int32_t *pos;   /* (A) each (token, choice)'s row in expert order */
    int32_t *token; /* (A) each row's token */
    int64_t *offs;  /* (E + 1) each expert's first row */
    void *xs;       /* (A, C) cd each row's input */
    float *ye;      /* (A, C) each row's expert output, before its weight */
    float *z;       /* (N) the shared expert gate's logit */
    float *sg, *su; /* (Nall, S) the shared expert's gate and up products (every token's: Nall) */
    void *sh;       /* (Nall, S) cd */
    float *so;      /* (N, C) the shared expert's output, before its gate */
    /* the experts' side: the R rows this rank's experts receive, by local
     * expert, then by source rank (without expert parallelism: the rows
     * above, R = A, and exs / eye are xs / ye) */
    int64_t R;
    int64_t *eoffs;  /* (El + 1) each local expert's first row */
    int64_t *counts; /* (P, El) the rows each source rank sends each local expert */
    int32_t *perm;   /* (cap) each row's place in the received order (source rank, then expert) */
    void *exs;       /* (cap, C) cd */
    float *eg, *eu;  /* (cap, I) the gate and up products */
    void *eh;        /* (cap, I) cd silu(g) · u */
    float *eye;      /* (cap, C) */
} moe_acts;

struct ht_moe {
    int E, k, I, S, C, layers;
    /* The sparse layers [first, end) this rank computes (pipeline parallelism: its stage's; all as built):
     * only theirs have activations. */
    int first, end;
    bool shares_tokens; /* tokens is another instance's (ht_moe_clone) */
    bool norm_topk;
    /* deepseek_v3: grouped sigmoid routing with the correction bias, the weights scaled, ungated shared experts */
    bool deepseek;
    int n_group, topk_group;
    float scaling;
    int64_t *tokens;        /* (layers, E) deepseek_v3: rows routed to each expert since last zeroed */
    ht_moe_params *params;  /* (layers) */
    moe_acts *acts;         /* (layers) */
    ht_expert_parallel *ep; /* NULL: every expert here */
    int P, El, e0;          /* the group's size, the experts per rank, this rank's first */
    int64_t N, cap;         /* the tokens the buffers hold, and the most rows the experts can receive */
    /* Tensor parallelism (NULL: none): the shared expert is a dense MLP in
     * Megatron's layout (S above is this rank's slice of its width), the
     * router and the routed experts whole, token by token on the rows the
     * block is given. Under sequence parallelism those are this rank's
     * N of the group's Nall tokens: the shared expert's input is gathered
     * to every token (x_all) and its output reduce-scattered back; without
     * it Nall = N and the output is summed over the group. */
    const ht_tensor_parallel *tp;
    int64_t Nall;
    void *x_all;    /* (Nall, C) cd (sequence parallelism) */
    float *so_all;  /* (Nall, C) the shared expert's partial output (sequence parallelism) */
    float *dso_all; /* (Nall, C) its output's gradient at every token (sequence parallelism) */
    float *dx_sh;   /* (Nall, C) the partial gradient of its input (tensor parallelism) */
    size_t cd;      /* the compute dtype's size they were carved for */
    void *block;
    size_t bytes;
    /* this forward's load-balancing sums over every sparse layer */
    double *count;    /* (E) rows routed to each expert */
    double *prob_sum; /* (E) router probabilities (with the load-balancing loss alone: else 0) */
    bool prob_sums;   /* model.output_router_logits: the probabilities read by the host and summed */
    int64_t rows;     /* tokens seen, summed over layers */
    /* scratch */
    float *dw;         /* (N, k) */
    float *dp;         /* (N, E) */
    float *dye;        /* (A, C) */
    float *dh, *dg;    /* (cap, I) */
    float *du;         /* (cap, I) */
    float *dexs;       /* (cap, C) the experts' input gradients */
    float *dxs;        /* (A, C) the same, back on the tokens' side */
    float *dso;        /* (N, C) */
    float *dsh, *dsg;  /* (N, S) */
    float *dsu;        /* (N, S) */
    float *dz;         /* (N) */
    float *xr;         /* (N, C) x widened to the router's dtype (deepseek_v3's FP32 router; NULL: x as it is) */
    float *stage;      /* (cap, C) rows in received order (exchange) */
    void *op_a, *op_b; /* (max(cap, N) · max(C, I, S, E)) cd: gradients as GEMM operands */
    float *aux_grad;   /* (E) the load-balancing loss's gradient per unit of each probability */
    /* Host memory: the routing as the host reads it to sort the rows and
     * size the experts' products (downloaded from the kernels' sel and
     * probs; pos, token and perm made here and uploaded), and the index
     * arrays no kernel reads (each layer's offs, eoffs, counts). */
    void *host_block;
    int32_t *sel_h;   /* (A) */
    float *probs_h;   /* (N, E) qwen2_moe's load-balancing sums */
    int32_t *pos_h;   /* (A) */
    int32_t *token_h; /* (A) */
    int32_t *perm_h;  /* (cap) */
    float *aux_h;     /* (E) */
};

static bool parallel(const ht_moe *moe) { return moe->P > 1; }

/* ------------------------------------------------------------------ params */

/* The shared expert's width: Qwen2-MoE's own, DeepSeek-V3's n_shared_experts experts side by side. */
static int64_t shared_width(const ht_model_config *cfg) {
    const ht_moe_config *mc = &cfg->moe;
    return ht_model_config_is_deepseek(cfg) ? (int64_t)mc->n_shared_experts * mc->moe_intermediate_size
                                            : mc->shared_expert_intermediate_size;
}

bool ht_moe_declare(ht_param_store *ps, const char *module, const ht_model_config *cfg, ht_dtype dtype) {
    const ht_moe_config *mc = &cfg->moe;
    const int64_t E = mc->num_experts, C = cfg->hidden_size, I = mc->moe_intermediate_size, S = shared_width(cfg);
    typedef struct {
        const char *suffix;
        int ndim;
        int64_t shape[3];
        bool fixed; /* never trained: no gradient, main param or optimizer state */
    } decl;
    const decl qwen[] = {
        {"mlp.gate.weight", 2, {E, C}, false},
        {"mlp.experts.gate_up_proj", 3, {E, 2 * I, C}, false},
        {"mlp.experts.down_proj", 3, {E, C, I}, false},
        {"mlp.shared_expert.gate_proj.weight", 2, {S, C}, false},
        {"mlp.shared_expert.up_proj.weight", 2, {S, C}, false},
        {"mlp.shared_expert.down_proj.weight", 2, {C, S}, false},
        {"mlp.shared_expert_gate.weight", 2, {1, C}, false},
    };
    /* transformers' DeepseekV3MoE in state_dict() order. The router and its
     * correction bias (a persistent buffer, zeros at init) are FP32 whatever
     * the model dtype (ht_model_config_keeps_fp32); the bias moves only by the
     * aux-loss-free update (ht_model_update_expert_bias). n_shared_experts 0:
     * transformers builds (0, C) shared experts that compute nothing; none here. */
    const decl deepseek[] = {
        {"mlp.experts.gate_up_proj", 3, {E, 2 * I, C}, false},
        {"mlp.experts.down_proj", 3, {E, C, I}, false},
        {"mlp.gate.weight", 2, {E, C}, false},
        {"mlp.gate.e_score_correction_bias", 1, {E}, true},
        {"mlp.shared_experts.gate_proj.weight", 2, {S, C}, false},
        {"mlp.shared_experts.up_proj.weight", 2, {S, C}, false},
        {"mlp.shared_experts.down_proj.weight", 2, {C, S}, false},
    };
    const bool ds = ht_model_config_is_deepseek(cfg);
    const decl *list = ds ? deepseek : qwen;
    const size_t n = ds ? sizeof(deepseek) / sizeof(deepseek[0]) : sizeof(qwen) / sizeof(qwen[0]);
    char name[HT_PARAM_NAME_MAX + 64];
    for (size_t i = 0; i < n; i++) {
        if (S == 0 && strstr(list[i].suffix, "shared_expert")) continue;
        snprintf(name, sizeof(name), "%s.%s", module, list[i].suffix);
        const bool keep = ht_model_config_keeps_fp32(cfg, name);
        ht_param *p = ht_params_add(ps, name, list[i].ndim, list[i].shape, keep ? HT_DTYPE_F32 : dtype);
        if (!p) return false;
        p->keep_fp32 = keep;
        p->trainable = !list[i].fixed;
    }
    return true;
}

static ht_param *find(ht_param_store *ps, const char *module, const char *suffix) {
    char name[HT_PARAM_NAME_MAX + 64];
    snprintf(name, sizeof(name), "%s.%s", module, suffix);
    return ht_params_find(ps, name);
}

void ht_moe_bind(ht_moe *moe, int index, ht_param_store *ps, const char *module) {
    ht_moe_params *p = &moe->params[index];
    const char *shared = moe->deepseek ? "mlp.shared_experts" : "mlp.shared_expert";
    char name[64];
    p->router = find(ps, module, "mlp.gate.weight");
    p->bias = find(ps, module, "mlp.gate.e_score_correction_bias");
    p->gate_up = find(ps, module, "mlp.experts.gate_up_proj");
    p->down = find(ps, module, "mlp.experts.down_proj");
    snprintf(name, sizeof(name), "%s.gate_proj.weight", shared);
    p->sh_gate = find(ps, module, name);
    snprintf(name, sizeof(name), "%s.up_proj.weight", shared);
    p->sh_up = find(ps, module, name);
    snprintf(name, sizeof(name), "%s.down_proj.weight", shared);
    p->sh_down = find(ps, module, name);
    p->sh_expert_gate = find(ps, module, "mlp.shared_expert_gate.weight");
}

const ht_moe_params *ht_moe_params_of(const ht_moe *moe, int index) { return &moe->params[index]; }

ht_moe *ht_moe_new(const ht_model_config *cfg, int layers) {
    ht_moe *moe = ht_alloc(sizeof(ht_moe));
    if (!moe) return NULL;
    const ht_moe_config *mc = &cfg->moe;
    moe->E = mc->num_experts;
    moe->k = mc->num_experts_per_tok;
    moe->I = mc->moe_intermediate_size;
    moe->S = (int)shared_width(cfg);
    moe->C = cfg->hidden_size;
    moe->norm_topk = mc->norm_topk_prob;
    moe->prob_sums = mc->output_router_logits;
    moe->deepseek = ht_model_config_is_deepseek(cfg);
    moe->n_group = mc->n_group;
    moe->topk_group = mc->topk_group;
    moe->scaling = (float)mc->routed_scaling_factor; /* torch multiplies an FP32 tensor by it in FP32 */
    moe->layers = layers;
    moe->first = 0, moe->end = layers;
    moe->params = ht_alloc((size_t)(layers ? layers : 1) * sizeof(ht_moe_params));
    moe->acts = ht_alloc((size_t)(layers ? layers : 1) * sizeof(moe_acts));
    moe->count = ht_alloc((size_t)moe->E * 2 * sizeof(double) + 64);
    moe->tokens = ht_alloc((size_t)(layers ? layers : 1) * (size_t)moe->E * sizeof(int64_t));
    if (!moe->params || !moe->acts || !moe->count || !moe->tokens) {
        ht_moe_free(moe);
        return NULL;
    }
    memset(moe->tokens, 0, (size_t)(layers ? layers : 1) * (size_t)moe->E * sizeof(int64_t));
    moe->prob_sum = moe->count + moe->E;
    return moe;
}

void ht_moe_free(ht_moe *moe) {
    if (!moe) return;
    ht_kernels()->free(moe->block);
    ht_free(moe->host_block);
    ht_free(moe->params);
    ht_free(moe->acts);
    ht_free(moe->count);
    if (!moe->shares_tokens) ht_free(moe->tokens);
    ht_free(moe);
}

void ht_moe_set_layers(ht_moe *moe, int first, int end) { moe->first = first, moe->end = end; }

ht_moe *ht_moe_clone(const ht_moe *moe) {
    ht_moe *c = ht_alloc(sizeof(ht_moe));
    const size_t layers = (size_t)(moe->layers ? moe->layers : 1);
    if (!c) return NULL;
    *c = (ht_moe){.E = moe->E,
                  .k = moe->k,
                  .I = moe->I,
                  .S = moe->S,
                  .C = moe->C,
                  .layers = moe->layers,
                  .first = moe->first,
                  .end = moe->end,
                  .shares_tokens = true,
                  .norm_topk = moe->norm_topk,
                  .prob_sums = moe->prob_sums,
                  .deepseek = moe->deepseek,
                  .n_group = moe->n_group,
                  .topk_group = moe->topk_group,
                  .scaling = moe->scaling,
                  .tokens = moe->tokens};
    c->params = ht_alloc(layers * sizeof(ht_moe_params));
    c->acts = ht_alloc(layers * sizeof(moe_acts));
    c->count = ht_alloc((size_t)moe->E * 2 * sizeof(double) + 64);
    if (!c->params || !c->acts || !c->count) {
        ht_moe_free(c);
        return NULL;
    }
    memcpy(c->params, moe->params, layers * sizeof(ht_moe_params));
    c->prob_sum = c->count + c->E;
    return c;
}

size_t ht_moe_activation_bytes(const ht_moe *moe) { return moe ? moe->bytes : 0; }

int64_t *ht_moe_expert_tokens(ht_moe *moe) { return moe ? moe->tokens : NULL; }

/* ------------------------------------------------------------------ buffers */

/* The expert activations' sizes for N tokens of this rank (Nall with
 * sequence parallelism's gathered ones), P ranks of expert parallelism,
 * operands of cd bytes, S the shared expert's width here: what
 * ht_moe_begin carves, and what a plan counts before it. */
enum { MOE_PER_LAYER = 22, MOE_SCRATCH = 22, MOE_HOST_LAYER = 3, MOE_HOST_SCRATCH = 6 };
typedef struct moe_sizes {
    size_t per_layer[MOE_PER_LAYER], scratch[MOE_SCRATCH], host_layer[MOE_HOST_LAYER], host_scratch[MOE_HOST_SCRATCH];
    size_t total, host_total; /* the kernels' memory, the host's */
    int64_t cap;
} moe_sizes;

static void size_moe(const ht_moe *moe, int64_t N, int64_t Nall, int P, size_t cd, bool widen, ht_dtype rdt, bool sp,
                     bool split, int64_t S, moe_sizes *z) {
    const int64_t E = moe->E, El = moe->E / P, k = moe->k, I = moe->I, C = moe->C, A = N * k;
    /* Every rank of the group may send all its rows to one rank's experts. */
    const int64_t cap = A * P, rows = cap > Nall ? cap : Nall;
    int64_t wide = C > I ? C : I;
    wide = wide > S ? wide : S;
    wide = wide > E ? wide : E;
    const size_t op = (size_t)(rows * wide) * cd;
    const bool own = P > 1; /* the experts' side has its own rows */
    const size_t per_layer[MOE_PER_LAYER] = {
        (size_t)(N * E) * 4,
        (size_t)(N * k) * 4,
        (size_t)(N * k) * 4,
        (size_t)N * 4,
        (size_t)A * 4,
        (size_t)A * 4,
        0, /* offs: host memory, below */
        (size_t)(A * C) * cd,
        (size_t)(A * C) * 4,
        (size_t)N * 4,
        (size_t)(Nall * S) * 4,
        (size_t)(Nall * S) * 4,
        (size_t)(Nall * S) * cd,
        (size_t)(N * C) * 4, /* probs .. so */
        0,
        0, /* eoffs, counts: host memory, below */
        own ? (size_t)cap * 4 : 0,
        own ? (size_t)(cap * C) * cd : 0,
        (size_t)(cap * I) * 4,
        (size_t)(cap * I) * 4,
        (size_t)(cap * I) * cd,
        own ? (size_t)(cap * C) * 4 : 0, /* eoffs .. eye */
    };
    const size_t scratch[MOE_SCRATCH] = {
        (size_t)(N * k) * 4,
        (size_t)(N * E) * 4,
        (size_t)(A * C) * 4,
        (size_t)(cap * I) * 4,
        (size_t)(cap * I) * 4,
        (size_t)(cap * I) * 4,
        (size_t)(cap * C) * 4,
        own ? (size_t)(A * C) * 4 : 0,
        (size_t)(N * C) * 4,
        (size_t)(Nall * S) * 4,
        (size_t)(Nall * S) * 4,
        (size_t)(Nall * S) * 4,
        (size_t)N * 4,
        widen ? (size_t)(N * C) * ht_dtype_size(rdt) : 0,
        own ? (size_t)(cap * C) * 4 : 0,
        op,
        op,
        sp ? (size_t)(Nall * C) * cd : 0,
        sp ? (size_t)(Nall * C) * 4 : 0,
        sp ? (size_t)(Nall * C) * 4 : 0,
        split ? (size_t)(Nall * C) * 4 : 0, /* tensor parallelism: x_all, so_all, dso_all, dx_sh */
        (size_t)E * 4,                      /* aux_grad */
    };
    /* the host's: per layer offs, eoffs, counts; then sel_h .. aux_h */
    const size_t host_layer[MOE_HOST_LAYER] = {(size_t)(E + 1) * 8, (size_t)(El + 1) * 8, (size_t)(P * El) * 8};
    /* sel_h .. perm_h stage what the host reads and writes only where the kernels' memory is not the host's */
    const size_t st = ht_kernels()->host_memory ? 0 : 1;
    const size_t host_scratch[MOE_HOST_SCRATCH] = {st * (size_t)A * 4, st * (size_t)(N * E) * 4, st * (size_t)A * 4,
                                                   st * (size_t)A * 4, st * (size_t)cap * 4,     (size_t)E * 4};
    memcpy(z->per_layer, per_layer, sizeof(per_layer));
    memcpy(z->scratch, scratch, sizeof(scratch));
    memcpy(z->host_layer, host_layer, sizeof(host_layer));
    memcpy(z->host_scratch, host_scratch, sizeof(host_scratch));
    z->cap = cap;
    z->total = z->host_total = 0;
    const size_t held = (size_t)(moe->end - moe->first); /* the sparse layers with activations here */
    for (int i = 0; i < MOE_PER_LAYER; i++) z->total += held * ht_align64(per_layer[i]);
    for (int i = 0; i < MOE_SCRATCH; i++) z->total += ht_align64(scratch[i]);
    for (int i = 0; i < MOE_HOST_LAYER; i++) z->host_total += held * ht_align64(host_layer[i]);
    for (int i = 0; i < MOE_HOST_SCRATCH; i++) z->host_total += ht_align64(host_scratch[i]);
}

size_t ht_moe_plan_bytes(const ht_moe *moe, int64_t N, int ep_size, int tp_size, bool sequence, size_t cd) {
    if (!moe || moe->end <= moe->first) return 0;
    const ht_param *router = moe->params[moe->first].router, *sh = moe->params[moe->first].sh_gate;
    /* a router kept in FP32 reads its own copy of x where the experts compute in 16 bits */
    const ht_dtype rdt = router && router->keep_fp32 ? HT_DTYPE_F32 : (cd == 4 ? HT_DTYPE_F32 : HT_DTYPE_BF16);
    const bool split = tp_size > 1, sp = split && sequence;
    moe_sizes z;
    size_moe(moe, N, sp ? N * tp_size : N, ep_size > 1 ? ep_size : 1, cd, ht_dtype_size(rdt) != cd, rdt, sp, split,
             sh ? sh->shape[0] : moe->S, &z);
    return z.total;
}

ht_status ht_moe_begin(ht_moe *moe, int64_t N, ht_expert_parallel *ep, const ht_tensor_parallel *tp, ht_error *err) {
    memset(moe->count, 0, (size_t)moe->E * 2 * sizeof(double));
    moe->rows = 0;
    if (moe->end <= moe->first) return HT_OK;
    const int P = ep && ep->size > 1 ? ep->size : 1;
    if (moe->E % P != 0)
        return ht_fail(err, HT_ERR_CONFIG,
                       "model.num_experts (%d) must be a multiple of parallel.expert_parallel_size (%d): each rank "
                       "of an expert-parallel group holds the same number of experts",
                       moe->E, P);
    /* A backend without DeepSeekMoE's grouped routing (the CUDA table has none yet) refuses, never calls NULL. */
    if (moe->deepseek && (!ht_kernels()->moe_route_grouped || !ht_kernels()->moe_route_grouped_backward))
        return ht_fail(err, HT_ERR_CONFIG,
                       "deepseek_v3's grouped expert routing has no kernel in the %s backend yet (kernels.backend): "
                       "expected kernels.backend cpu for this model",
                       ht_kernels()->name);
    moe->ep = P > 1 ? ep : NULL;
    moe->El = moe->E / P;
    moe->e0 = P > 1 ? ep->rank * moe->El : 0;
    /* The compute dtype is the experts' (deepseek_v3's router is FP32 whatever it is). */
    const ht_moe_params *first = &moe->params[moe->first];
    const ht_dtype cdt = first->gate_up->compute_dtype, rdt = first->router->compute_dtype;
    const size_t cd = ht_dtype_size(cdt);
    const bool widen = rdt != cdt; /* the router reads x in its own dtype */
    moe->tp = tp && tp->size > 1 ? tp : NULL;
    const bool split = moe->tp != NULL, sp = split && moe->tp->sequence;
    const int64_t Nall = sp ? N * moe->tp->size : N;
    /* The shared expert's width here: its slice under tensor parallelism. */
    if (first->sh_gate) moe->S = (int)first->sh_gate->shape[0];
    if (moe->block && moe->N == N && moe->Nall == Nall && moe->cd == cd && moe->P == P && (moe->xr != NULL) == widen &&
        (moe->dx_sh != NULL) == split)
        return HT_OK;
    moe->P = P;
    ht_kernels()->free(moe->block);
    moe->block = NULL;
    moe_sizes z;
    size_moe(moe, N, Nall, P, cd, widen, rdt, sp, split, moe->S, &z);
    const size_t *per_layer = z.per_layer, *scratch = z.scratch, *host_layer = z.host_layer,
                 *host_scratch = z.host_scratch, total = z.total, host_total = z.host_total;
    const int64_t cap = z.cap;
    const bool own = P > 1;
    ht_free(moe->host_block);
    char *p = ht_kernels()->alloc(total), *h = ht_alloc(host_total);
    moe->host_block = h;
    if (!p || !h) {
        ht_kernels()->free(p);
        ht_free(h);
        moe->host_block = NULL;
        return ht_fail(err, HT_ERR_OOM, "cannot allocate %.1f MiB of expert activations for %lld tokens",
                       (double)(total + host_total) / (1 << 20), (long long)N);
    }
    moe->block = p;
    ht_arena host = {.base = h};
    for (int l = moe->first; l < moe->end; l++) {
        moe->acts[l].offs = ht_arena_take(&host, host_layer[0]);
        moe->acts[l].eoffs = ht_arena_take(&host, host_layer[1]);
        moe->acts[l].counts = ht_arena_take(&host, host_layer[2]);
    }
    moe->sel_h = ht_arena_take(&host, host_scratch[0]);
    moe->probs_h = ht_arena_take(&host, host_scratch[1]);
    moe->pos_h = ht_arena_take(&host, host_scratch[2]);
    moe->token_h = ht_arena_take(&host, host_scratch[3]);
    moe->perm_h = ht_arena_take(&host, host_scratch[4]);
    moe->aux_h = ht_arena_take(&host, host_scratch[5]);
    ht_arena arena = {.base = p};
    for (int l = moe->first; l < moe->end; l++) {
        moe_acts *a = &moe->acts[l];
        a->probs = ht_arena_take(&arena, per_layer[0]);
        a->sel = ht_arena_take(&arena, per_layer[1]);
        a->weight = ht_arena_take(&arena, per_layer[2]);
        a->psum = ht_arena_take(&arena, per_layer[3]);
        a->pos = ht_arena_take(&arena, per_layer[4]);
        a->token = ht_arena_take(&arena, per_layer[5]);
        (void)ht_arena_take(&arena, per_layer[6]);
        a->xs = ht_arena_take(&arena, per_layer[7]);
        a->ye = ht_arena_take(&arena, per_layer[8]);
        a->z = ht_arena_take(&arena, per_layer[9]);
        a->sg = ht_arena_take(&arena, per_layer[10]);
        a->su = ht_arena_take(&arena, per_layer[11]);
        a->sh = ht_arena_take(&arena, per_layer[12]);
        a->so = ht_arena_take(&arena, per_layer[13]);
        (void)ht_arena_take(&arena, per_layer[14]);
        (void)ht_arena_take(&arena, per_layer[15]);
        a->perm = own ? ht_arena_take(&arena, per_layer[16]) : NULL;
        a->exs = own ? ht_arena_take(&arena, per_layer[17]) : a->xs;
        a->eg = ht_arena_take(&arena, per_layer[18]);
        a->eu = ht_arena_take(&arena, per_layer[19]);
        a->eh = ht_arena_take(&arena, per_layer[20]);
        a->eye = own ? ht_arena_take(&arena, per_layer[21]) : a->ye;
    }
    moe->dw = ht_arena_take(&arena, scratch[0]);
    moe->dp = ht_arena_take(&arena, scratch[1]);
    moe->dye = ht_arena_take(&arena, scratch[2]);
    moe->dh = ht_arena_take(&arena, scratch[3]);
    moe->dg = ht_arena_take(&arena, scratch[4]);
    moe->du = ht_arena_take(&arena, scratch[5]);
    moe->dexs = ht_arena_take(&arena, scratch[6]);
    moe->dxs = own ? ht_arena_take(&arena, scratch[7]) : moe->dexs;
    moe->dso = ht_arena_take(&arena, scratch[8]);
    moe->dsh = ht_arena_take(&arena, scratch[9]);
    moe->dsg = ht_arena_take(&arena, scratch[10]);
    moe->dsu = ht_arena_take(&arena, scratch[11]);
    moe->dz = ht_arena_take(&arena, scratch[12]);
    moe->xr = widen ? ht_arena_take(&arena, scratch[13]) : NULL;
    moe->stage = own ? ht_arena_take(&arena, scratch[14]) : NULL;
    moe->op_a = ht_arena_take(&arena, scratch[15]);
    moe->op_b = ht_arena_take(&arena, scratch[16]);
    moe->x_all = sp ? ht_arena_take(&arena, scratch[17]) : NULL;
    moe->so_all = sp ? ht_arena_take(&arena, scratch[18]) : NULL;
    moe->dso_all = sp ? ht_arena_take(&arena, scratch[19]) : NULL;
    moe->dx_sh = split ? ht_arena_take(&arena, scratch[20]) : NULL;
    moe->aux_grad = ht_arena_take(&arena, scratch[21]);
    moe->N = N;
    moe->Nall = Nall;
    moe->cap = cap;
    moe->cd = cd;
    moe->bytes = total;
    return HT_OK;
}

/* ------------------------------------------------------------------ helpers */

/* Expert e's (rows, cols) matrix of a 3-D param, as the GEMMs read it. */
static const void *expert_matrix(const ht_param *p, int64_t e, int64_t row0) {
    const size_t elem = ht_dtype_size(p->compute_dtype);
    return (const char *)p->compute + ((size_t)(e * p->shape[1] + row0) * (size_t)p->shape[2]) * elem;
}

static float *expert_grad(const ht_param *p, int64_t e, int64_t row0) {
    return p->grad ? p->grad + (size_t)(e * p->shape[1] + row0) * (size_t)p->shape[2] : NULL;
}

/* An FP32 gradient as a GEMM operand of the weights' dtype (cd), rounded to
 * `round` where cd is FP32 storage of a coarser precision. */
static const void *operand(void *dst, const float *src, int64_t n, ht_dtype cd, ht_dtype round) {
    if (cd != HT_DTYPE_F32) {
        ht_kernels()->convert(dst, cd, src, HT_DTYPE_F32, (size_t)n);
        return dst;
    }
    if (round == HT_DTYPE_F32) return src;
    ht_kernels()->copy(dst, src, (size_t)n * sizeof(float));
    ht_kernels()->round_to(dst, (size_t)n, round);
    return dst;
}

static const void *rows_at(const void *base, int64_t row, int64_t width, ht_dtype dtype) {
    return (const char *)base + (size_t)(row * width) * ht_dtype_size(dtype);
}

/* ------------------------------------------------------------------ forward */

/* The host's view of `bytes` of the kernels' memory: that memory itself
 * where the host may read it (the CPU's), else a download into `stage`. */
static const void *host_view(const void *mem, void *stage, size_t bytes) {
    if (ht_kernels()->host_memory) return mem;
    ht_kernels()->download(stage, mem, bytes);
    return stage;
}

/* Where the host writes an index array the kernels read: in place on the
 * CPU, else into `stage`, uploaded by done_writing. */
static int32_t *host_out(int32_t *mem, int32_t *stage) { return ht_kernels()->host_memory ? mem : stage; }
static void done_writing(int32_t *mem, const int32_t *stage, int64_t n) {
    if (!ht_kernels()->host_memory) ht_kernels()->upload(mem, stage, (size_t)n * sizeof(int32_t));
}

/* The rows in expert order, on the host from the choices (sel, the host's
 * view): offs, each row's token and each choice's row. */
static void sort_rows(const ht_moe *moe, moe_acts *a, const int32_t *sel, int64_t N) {
    const int E = moe->E, k = moe->k;
    int64_t *offs = a->offs;
    int32_t *pos = host_out(a->pos, moe->pos_h), *token = host_out(a->token, moe->token_h);
    memset(offs, 0, (size_t)(E + 1) * sizeof(int64_t));
    for (int64_t i = 0; i < N * k; i++) offs[sel[i] + 1]++;
    for (int e = 0; e < E; e++) offs[e + 1] += offs[e];
    int64_t next[E];
    memcpy(next, offs, (size_t)E * sizeof(int64_t));
    for (int64_t i = 0; i < N * k; i++) {
        int64_t r = next[sel[i]]++;
        pos[i] = (int32_t)r;
        token[r] = (int32_t)(i / k);
    }
    done_writing(a->pos, pos, N * k);
    done_writing(a->token, token, N * k);
}

/* y (rows, out) = x (rows, in) · Wᵀ for a 2-D weight. */
static void linear(float *y, const void *x, const ht_param *w, int64_t rows) {
    int64_t out = w->shape[0], in = w->shape[1];
    ht_kernels()->gemm(false, true, rows, out, in, 1.0f, x, in, w->compute, in, w->compute_dtype, 0.0f, y, out);
}

/* ------------------------------------------------------------------ expert parallelism */

/* The group's all-to-all of rows of row_bytes: send_rows[q] to rank q, recv_rows[q] from it. */
static void exchange_rows(ht_moe *moe, const void *send, const int64_t *send_rows, void *recv, const int64_t *recv_rows,
                          size_t row_bytes) {
    const int P = moe->P;
    int64_t sb[P], rb[P];
    for (int q = 0; q < P; q++) {
        sb[q] = send_rows[q] * (int64_t)row_bytes;
        rb[q] = recv_rows[q] * (int64_t)row_bytes;
    }
    double t0 = ht_time_seconds();
    moe->ep->exchange(moe->ep->ctx, send, sb, recv, rb);
    moe->ep->seconds += ht_time_seconds() - t0;
}

/* The rows this rank sends each rank (its rows are in expert order, and
 * rank q holds experts [q·El, (q + 1)·El)), and those it receives. */
static void rows_per_rank(const ht_moe *moe, const moe_acts *a, int64_t *to, int64_t *from) {
    for (int q = 0; q < moe->P; q++) {
        to[q] = a->offs[(q + 1) * moe->El] - a->offs[q * moe->El];
        from[q] = 0;
        for (int el = 0; el < moe->El; el++) from[q] += a->counts[q * moe->El + el];
    }
}

/* The rows of this rank's tokens to their experts' ranks: exs gets the rows
 * this rank's experts compute, by local expert and then by source rank. */
static void dispatch(ht_moe *moe, moe_acts *a, size_t row_bytes) {
    const int P = moe->P, El = moe->El;
    int64_t sendc[moe->E], eight[P], to[P], from[P];
    for (int e = 0; e < moe->E; e++) sendc[e] = a->offs[e + 1] - a->offs[e];
    for (int q = 0; q < P; q++) eight[q] = El;
    exchange_rows(moe, sendc, eight, a->counts, eight, sizeof(int64_t));
    rows_per_rank(moe, a, to, from);
    a->eoffs[0] = 0;
    for (int el = 0; el < El; el++) {
        int64_t n = 0;
        for (int q = 0; q < P; q++) n += a->counts[q * El + el];
        a->eoffs[el + 1] = a->eoffs[el] + n;
    }
    a->R = a->eoffs[El];
    /* perm: expert-side row -> received row (source rank q's rows for its experts, in expert order). */
    int32_t *perm = host_out(a->perm, moe->perm_h);
    int64_t qoff = 0;
    for (int q = 0; q < P; q++) {
        int64_t r = qoff;
        for (int el = 0; el < El; el++) {
            int64_t at = a->eoffs[el];
            for (int qq = 0; qq < q; qq++) at += a->counts[qq * El + el];
            for (int64_t i = 0; i < a->counts[q * El + el]; i++) perm[at + i] = (int32_t)(r + i);
            r += a->counts[q * El + el];
        }
        qoff += from[q];
    }
    done_writing(a->perm, perm, a->R);
    exchange_rows(moe, a->xs, to, moe->stage, from, row_bytes);
    ht_kernels()->gather_rows(a->exs, moe->stage, a->perm, a->R, row_bytes);
}

/* The experts' rows of width bytes (src, expert-side order) back to the
 * ranks of their tokens, into dst in this rank's send order. */
static void combine(ht_moe *moe, const moe_acts *a, const void *src, void *dst, size_t row_bytes) {
    int64_t to[moe->P], from[moe->P];
    rows_per_rank(moe, a, to, from);
    ht_kernels()->scatter_rows(moe->stage, src, a->perm, a->R, row_bytes);
    exchange_rows(moe, moe->stage, from, dst, to, row_bytes);
}

/* ------------------------------------------------------------------ forward */

/* x as the router reads it: in its own dtype (deepseek_v3's FP32 router
 * widens the compute dtype's values, exactly, as transformers'
 * hidden_states.type(torch.float32) does). */
static const void *router_input(ht_moe *moe, const ht_param *router, const void *x, ht_dtype cd, int64_t N) {
    if (!moe->xr) return x;
    ht_kernels()->convert(moe->xr, router->compute_dtype, x, cd, (size_t)(N * moe->C));
    return moe->xr;
}

/* The shared expert's input at every token: x, or (sequence parallelism) x gathered over the group. */
static const void *shared_input(const ht_moe *moe, const void *x) {
    if (!moe->x_all) return x;
    const size_t bytes = (size_t)(moe->N * moe->C) * moe->cd;
    moe->tp->all_gather(moe->tp->ctx, x, moe->x_all, (int64_t)bytes);
    return moe->x_all;
}

/* Tensor parallelism: the shared expert's partial sums part (Nall, C)
 * completed into out (N, C): summed over the group (part is out), or
 * reduce-scattered onto this rank's rows. */
static void shared_reduce(const ht_moe *moe, float *part, float *out) {
    if (!moe->tp) return;
    if (moe->tp->sequence)
        moe->tp->reduce_scatter(moe->tp->ctx, part, out, moe->N * moe->C);
    else
        moe->tp->sum(moe->tp->ctx, part, moe->N * moe->C);
    if (!moe->tp->sequence && part != out) ht_kernels()->copy(out, part, (size_t)(moe->N * moe->C) * sizeof(float));
}

void ht_moe_forward(ht_moe *moe, int index, float *y, const void *x, int64_t N, ht_dtype round) {
    const ht_moe_params *p = &moe->params[index];
    moe_acts *a = &moe->acts[index];
    const int64_t E = moe->E, El = moe->El, k = moe->k, I = moe->I, S = moe->S, C = moe->C, A = N * k;
    const ht_dtype cd = p->gate_up->compute_dtype;
    const size_t cds = ht_dtype_size(cd);

    /* The router and its load-balancing sums, read by the host; every
     * router counts the tokens each expert was routed (the experts' load in
     * the metrics; deepseek_v3's aux-loss-free bias update). */
    const int32_t *sel;
    linear(a->probs, router_input(moe, p->router, x, cd, N), p->router, N);
    if (moe->deepseek) {
        ht_kernels()->moe_route_grouped(a->probs, a->sel, a->weight, a->psum, p->bias->compute, N, moe->E, moe->k,
                                        moe->n_group, moe->topk_group, moe->norm_topk, moe->scaling);
        sel = host_view(a->sel, moe->sel_h, (size_t)(N * k) * sizeof(int32_t));
    } else {
        ht_kernels()->moe_route(a->probs, a->sel, a->weight, a->psum, N, moe->E, moe->k, moe->norm_topk);
        sel = host_view(a->sel, moe->sel_h, (size_t)(N * k) * sizeof(int32_t));
        if (moe->prob_sums) { /* the load-balancing loss's: without it, no download of the probabilities */
            const float *probs = host_view(a->probs, moe->probs_h, (size_t)(N * E) * sizeof(float));
            for (int64_t n = 0; n < N; n++)
                for (int64_t e = 0; e < E; e++) moe->prob_sum[e] += probs[n * E + e];
        }
    }
    int64_t *tokens = moe->tokens + (size_t)index * (size_t)E; /* the experts' load, and DeepSeek's bias update */
    for (int64_t i = 0; i < N * k; i++) {
        moe->count[sel[i]] += 1.0;
        tokens[sel[i]]++;
    }
    moe->rows += N;

    /* Routed experts: the rows in expert order, to the experts' ranks, one
     * GEMM per local expert and product, the outputs back. */
    sort_rows(moe, a, sel, N);
    ht_kernels()->gather_rows(a->xs, x, a->token, A, (size_t)C * cds);
    if (parallel(moe)) {
        dispatch(moe, a, (size_t)C * cds);
    } else {
        memcpy(a->eoffs, a->offs, (size_t)(E + 1) * sizeof(int64_t));
        a->R = A;
    }
    for (int64_t e = 0; e < El; e++) {
        int64_t r0 = a->eoffs[e], n = a->eoffs[e + 1] - r0;
        if (n == 0) continue;
        const void *xe = rows_at(a->exs, r0, C, cd);
        ht_kernels()->gemm_ragged(false, true, n, I, C, 1.0f, xe, C, expert_matrix(p->gate_up, e, 0), C, cd, 0.0f,
                                  a->eg + r0 * I, I);
        ht_kernels()->gemm_ragged(false, true, n, I, C, 1.0f, xe, C, expert_matrix(p->gate_up, e, I), C, cd, 0.0f,
                                  a->eu + r0 * I, I);
    }
    ht_kernels()->swiglu_forward(a->eh, cd, a->eg, a->eu, a->R * I);
    ht_kernels()->round_to(a->eh, (size_t)(a->R * I), round);
    for (int64_t e = 0; e < El; e++) {
        int64_t r0 = a->eoffs[e], n = a->eoffs[e + 1] - r0;
        if (n == 0) continue;
        ht_kernels()->gemm_ragged(false, true, n, C, I, 1.0f, rows_at(a->eh, r0, I, cd), I,
                                  expert_matrix(p->down, e, 0), I, cd, 0.0f, a->eye + r0 * C, C);
    }
    if (parallel(moe)) combine(moe, a, a->eye, a->ye, (size_t)C * sizeof(float));

    /* The shared expert(s) (at every token, tensor parallelism's slice of
     * their width) and (qwen2_moe) its gate (on this rank's rows). */
    if (p->sh_expert_gate) linear(a->z, x, p->sh_expert_gate, N);
    if (S > 0) {
        const int64_t Na = moe->Nall;
        const void *xa = shared_input(moe, x);
        linear(a->sg, xa, p->sh_gate, Na);
        linear(a->su, xa, p->sh_up, Na);
        ht_kernels()->swiglu_forward(a->sh, cd, a->sg, a->su, Na * S);
        ht_kernels()->round_to(a->sh, (size_t)(Na * S), round);
        float *part = moe->so_all ? moe->so_all : a->so;
        linear(part, a->sh, p->sh_down, Na);
        shared_reduce(moe, part, a->so);
    }

    /* y = the weighted expert outputs, added in expert order as transformers
     * does (index_add_ per expert), plus the (gated) shared output. */
    ht_kernels()->moe_combine(y, a->ye, a->pos, a->sel, a->weight, p->sh_expert_gate ? a->z : NULL,
                              S > 0 ? a->so : NULL, N, k, C);
}

int ht_moe_routing_count(const ht_moe *moe) { return moe ? 2 * moe->E + 1 : 0; }

void ht_moe_routing_get(const ht_moe *moe, double *sums) {
    memcpy(sums, moe->count, (size_t)(2 * moe->E) * sizeof(double)); /* count (E), then prob_sum (E) */
    sums[2 * moe->E] = (double)moe->rows;
}

void ht_moe_routing_set(ht_moe *moe, const double *sums) {
    memcpy(moe->count, sums, (size_t)(2 * moe->E) * sizeof(double));
    moe->rows = (int64_t)sums[2 * moe->E];
}

void ht_moe_sum_routing(ht_moe *moe, void (*sum)(void *ctx, double *buf, int64_t n), void *ctx) {
    double buf[ht_moe_routing_count(moe)];
    ht_moe_routing_get(moe, buf);
    sum(ctx, buf, ht_moe_routing_count(moe));
    ht_moe_routing_set(moe, buf);
}

double ht_moe_aux_loss(const ht_moe *moe) {
    if (moe->rows == 0) return 0.0;
    double sum = 0.0, R = (double)moe->rows;
    for (int e = 0; e < moe->E; e++) sum += (moe->count[e] / R) * (moe->prob_sum[e] / R);
    return sum * moe->E;
}

/* ------------------------------------------------------------------ backward */

/* Given dy (rows, out): W.grad += dyᵀ x and dx = dx_beta · dx + dy W, dy
 * read as the GEMM operand dy_op. A frozen weight has no grad. */
static void linear_backward(float *dx, float dx_beta, const void *dy_op, const void *x, const ht_param *w,
                            int64_t rows) {
    int64_t out = w->shape[0], in = w->shape[1];
    if (w->grad)
        ht_kernels()->gemm(true, false, out, in, rows, 1.0f, dy_op, out, x, in, w->compute_dtype, 1.0f, w->grad, in);
    ht_kernels()->gemm(false, false, rows, in, out, 1.0f, dy_op, out, w->compute, in, w->compute_dtype, dx_beta, dx,
                       in);
}

void ht_moe_backward(ht_moe *moe, int index, float *dx, const float *dy, const void *x, int64_t N, float aux_scale,
                     ht_dtype round) {
    const ht_moe_params *p = &moe->params[index];
    moe_acts *a = &moe->acts[index];
    const int64_t E = moe->E, El = moe->El, k = moe->k, I = moe->I, S = moe->S, C = moe->C, A = N * k;
    const ht_dtype cd = p->gate_up->compute_dtype;
    const float *z = p->sh_expert_gate ? a->z : NULL, *so = S > 0 ? a->so : NULL;

    /* The combination y = sum of w_j ye_j + s so, s = sigmoid(z) (1 when
     * ungated): dso, dz, d w_j = dy · ye_j and each row's output gradient w_j dy. */
    ht_kernels()->moe_combine_backward(moe->dso, moe->dz, moe->dw, moe->dye, dy, a->ye, so, z, a->pos, a->weight, N, k,
                                       C);
    float beta = 0.0f; /* dx is written by its first product, then added to */
    if (S > 0) {       /* at every token (Nall), the partial gradient of x completed over the group */
        const int64_t Na = moe->Nall;
        const float *dso = moe->dso;
        if (moe->dso_all) {
            moe->tp->all_gather(moe->tp->ctx, moe->dso, moe->dso_all, N * C * (int64_t)sizeof(float));
            dso = moe->dso_all;
        }
        const void *op = operand(moe->op_a, dso, Na * C, cd, round);
        if (p->sh_down->grad)
            ht_kernels()->gemm(true, false, C, S, Na, 1.0f, op, C, a->sh, S, cd, 1.0f, p->sh_down->grad, S);
        ht_kernels()->gemm(false, false, Na, S, C, 1.0f, op, C, p->sh_down->compute, S, cd, 0.0f, moe->dsh, S);
        ht_kernels()->swiglu_backward(moe->dsg, moe->dsu, moe->dsh, a->sg, a->su, Na * S);
        const void *xa = shared_input(moe, x);
        float *dxa = moe->dx_sh ? moe->dx_sh : dx;
        linear_backward(dxa, 0.0f, operand(moe->op_a, moe->dsg, Na * S, cd, round), xa, p->sh_gate, Na);
        linear_backward(dxa, 1.0f, operand(moe->op_a, moe->dsu, Na * S, cd, round), xa, p->sh_up, Na);
        shared_reduce(moe, dxa, dx);
        beta = 1.0f;
    }
    if (z) {
        linear_backward(dx, beta, operand(moe->op_a, moe->dz, N, cd, round), x, p->sh_expert_gate, N);
        beta = 1.0f;
    }

    /* The router. qwen2_moe: the chosen probabilities' gradient (through the
     * normalisation), the load-balancing loss's on every probability
     * (E · count_e / R² per unit of aux), then the softmax. deepseek_v3: the
     * chosen weights' through the scaling, the normalisation and the sigmoid,
     * in FP32 against the FP32 router and x widened (its operands are not
     * rounded: the router's precision is FP32). */
    if (moe->deepseek) {
        ht_kernels()->moe_route_grouped_backward(moe->dp, a->probs, a->sel, a->weight, moe->dw, a->psum, N, (int)E,
                                                 (int)k, moe->norm_topk, moe->scaling);
    } else {
        const double R = (double)moe->rows;
        for (int64_t e = 0; e < E; e++) moe->aux_h[e] = (float)(aux_scale * (double)E * moe->count[e] / (R * R));
        ht_kernels()->upload(moe->aux_grad, moe->aux_h, (size_t)E * sizeof(float));
        ht_kernels()->moe_route_backward(moe->dp, a->probs, a->sel, a->weight, moe->dw, a->psum,
                                         aux_scale != 0.0f ? moe->aux_grad : NULL, N, (int)E, (int)k, moe->norm_topk);
    }
    const ht_param *r = p->router;
    const ht_dtype rround = r->compute_precision == HT_DTYPE_F32 ? HT_DTYPE_F32 : round;
    linear_backward(dx, beta, operand(moe->op_a, moe->dp, N * E, r->compute_dtype, rround),
                    router_input(moe, r, x, cd, N), r, N);

    /* Routed experts: the output gradients to the experts' ranks, one GEMM
     * per local expert and product, the input gradients back. */
    const void *dye = operand(moe->op_a, moe->dye, A * C, cd, round);
    if (parallel(moe)) {
        int64_t to[moe->P], from[moe->P];
        const size_t row = (size_t)C * ht_dtype_size(cd);
        rows_per_rank(moe, a, to, from);
        exchange_rows(moe, dye, to, moe->stage, from, row);
        ht_kernels()->gather_rows(moe->op_b, moe->stage, a->perm, a->R, row);
        dye = moe->op_b;
    }
    for (int64_t e = 0; e < El; e++) {
        int64_t r0 = a->eoffs[e], n = a->eoffs[e + 1] - r0;
        if (n == 0) continue;
        const void *dye_e = rows_at(dye, r0, C, cd);
        if (p->down->grad)
            ht_kernels()->gemm_ragged(true, false, C, I, n, 1.0f, dye_e, C, rows_at(a->eh, r0, I, cd), I, cd, 1.0f,
                                      expert_grad(p->down, e, 0), I);
        ht_kernels()->gemm_ragged(false, false, n, I, C, 1.0f, dye_e, C, expert_matrix(p->down, e, 0), I, cd, 0.0f,
                                  moe->dh + r0 * I, I);
    }
    ht_kernels()->swiglu_backward(moe->dg, moe->du, moe->dh, a->eg, a->eu, a->R * I);
    const void *dg = operand(moe->op_a, moe->dg, a->R * I, cd, round);
    const void *du = operand(moe->op_b, moe->du, a->R * I, cd, round);
    for (int64_t e = 0; e < El; e++) {
        int64_t r0 = a->eoffs[e], n = a->eoffs[e + 1] - r0;
        if (n == 0) continue;
        const void *xe = rows_at(a->exs, r0, C, cd), *dg_e = rows_at(dg, r0, I, cd), *du_e = rows_at(du, r0, I, cd);
        if (p->gate_up->grad) {
            ht_kernels()->gemm_ragged(true, false, I, C, n, 1.0f, dg_e, I, xe, C, cd, 1.0f,
                                      expert_grad(p->gate_up, e, 0), C);
            ht_kernels()->gemm_ragged(true, false, I, C, n, 1.0f, du_e, I, xe, C, cd, 1.0f,
                                      expert_grad(p->gate_up, e, I), C);
        }
        float *dexs = moe->dexs + r0 * C;
        ht_kernels()->gemm_ragged(false, false, n, C, I, 1.0f, dg_e, I, expert_matrix(p->gate_up, e, 0), C, cd, 0.0f,
                                  dexs, C);
        ht_kernels()->gemm_ragged(false, false, n, C, I, 1.0f, du_e, I, expert_matrix(p->gate_up, e, I), C, cd, 1.0f,
                                  dexs, C);
    }
    if (parallel(moe)) combine(moe, a, moe->dexs, moe->dxs, (size_t)C * sizeof(float));
    ht_kernels()->moe_scatter_add(dx, moe->dxs, a->pos, N, k, C);
}

/* ------------------------------------------------------------------ the aux-loss-free bias update */

static bool ends_with(const char *s, const char *tail) {
    size_t n = strlen(s), t = strlen(tail);
    return n >= t && strcmp(s + n - t, tail) == 0;
}

bool ht_model_config_keeps_fp32(const ht_model_config *cfg, const char *name) {
    return ht_model_config_is_deepseek(cfg) &&
           (ends_with(name, ".mlp.gate.weight") || ends_with(name, ".mlp.gate.e_score_correction_bias"));
}

int ht_model_config_sparse_layers(const ht_model_config *cfg) {
    int n = 0;
    for (int l = 0; l < cfg->num_hidden_layers; l++) n += ht_model_config_layer_is_sparse(cfg, l);
    return n;
}

void ht_model_reset_expert_tokens(ht_model *m) {
    if (!m->expert_tokens) return;
    memset(m->expert_tokens, 0,
           (size_t)ht_model_config_sparse_layers(&m->config) * (size_t)m->config.moe.num_experts * sizeof(int64_t));
}

/* docs/NUMERICS.md, "DeepSeekMoE routing and the aux-loss-free bias update".
 * As Megatron-Core computes it (megatron/core/transformer/moe/moe_utils.py,
 * get_updated_expert_bias, called once per global batch by
 * finalize_model_grads' _update_router_expert_bias with
 * moe_router_bias_update_rate; the counts all-reduced over TP x CP x DP, the
 * bias an FP32 buffer):
 *
 *   average_tokens = tokens_per_expert.sum(-1, keepdim=True) / E
 *   offset         = average_tokens - tokens_per_expert
 *   expert_bias    = expert_bias + sign(offset) * rate        (sign(0) = 0)
 *
 * Megatron holds the counts in FP32; here they are exact integers, and
 * sign(Σ/E − c) is taken as sign(Σ − E·c), which is the same sign wherever
 * Megatron's FP32 arithmetic is exact (Σ < 2^24 routed rows a step). The
 * update itself is Megatron's FP32 operations: bias + (±1 · (float)rate). */
void ht_model_update_expert_bias(ht_model *m, const double *tokens, double rate) {
    const ht_model_config *cfg = &m->config;
    const int E = cfg->moe.num_experts;
    const float step = (float)rate;
    int sparse = 0;
    for (int l = 0; l < cfg->num_hidden_layers; l++) {
        if (!ht_model_config_layer_is_sparse(cfg, l)) continue;
        const double *t = tokens + (size_t)sparse++ * (size_t)E;
        char name[HT_PARAM_NAME_MAX];
        snprintf(name, sizeof(name), "model.layers.%d.mlp.gate.e_score_correction_bias", l);
        ht_param *p = ht_params_find(&m->params, name);
        if (!p || p->dtype != HT_DTYPE_F32) continue;
        double total = 0.0;
        for (int e = 0; e < E; e++) total += t[e];
        float b[E]; /* this rank's rows of the bias, on the host */
        const size_t bytes = (size_t)(p->row1 - p->row0) * sizeof(float);
        ht_params_download(&m->params, b, p->data, bytes);
        for (int64_t e = p->row0; e < p->row1; e++) {
            const double offset = total - (double)E * t[e]; /* E x (mean - count) */
            const float sign = offset > 0 ? 1.0f : offset < 0 ? -1.0f : 0.0f;
            b[e - p->row0] = b[e - p->row0] + sign * step;
        }
        ht_params_upload(&m->params, p->data, b, bytes);
    }
}
