/* The trainer on the CUDA backend (kernels.backend: cuda) against the same
 * run on the CPU's table: the parity docs/NUMERICS.md asks of a GPU run
 * ("The CUDA backend against the CPU's"). Each variant trains a few steps
 * on either table with training.dump_state, and
 * - every step's loss agrees within the training losses' bound (1e-5
 *   relative in float32, 2e-4 in bf16);
 * - step 1, from the same weights: every main_grad within 1e-6 in float32
 *   (the first-step contract; bf16 max(2^-12, FLOOR_FACTOR x the model's
 *   noise floor)), every param within 1e-5 (bf16 the seed's rtol 1e-2);
 * - the last step: every param within max(1e-5, FLOOR_FACTOR x its noise
 *   floor) (bf16 max(1e-2, ...)), the floor measured here on the CPU
 *   (harness.h);
 * - a checkpoint written on one table resumes on the other: one step from
 *   the same state, within the first step's bounds.
 * Qwen2's k_proj.bias is compared by its gradient alone and the elements
 * the first step leaves undetermined are left out of the params, as in the
 * sharded runs (docs/NUMERICS.md, "Sharded runs against one process").
 *
 * Where the build or the machine has no CUDA backend the test says so and
 * is skipped; test_cuda_trainer_emu runs it on the emulated device
 * (tests/emu/), and scripts/device-check.sh on the GPU. */
#include "harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hypertrain/config.h"
#include "hypertrain/kernels.h"
#include "hypertrain/train.h"

enum { MAX_STEPS = 8 };

static const char *const corpus_text =
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
    "it was the season of Darkness, it was the spring of hope, it was the winter of despair.\n";

/* What a variant trains. */
typedef struct variant {
    const char *name;
    bool f32;
    bool adamw; /* optimizer._target_=AdamW: AdamW updates every tensor (else Muon the matrices) */
    int steps;
    const char *sets[16]; /* "key=value", NULL-terminated */
} variant;

typedef struct run_losses {
    double loss[MAX_STEPS], grad_norm[MAX_STEPS];
    int first, last; /* the steps run: first + 1 .. last */
} run_losses;

static bool cuda_present(void) {
    ht_error err = {0};
    if (ht_kernels_cuda(&err)) return true;
    printf("CUDA backend not present (nothing to compare the CPU's trainer with): %s\n", err.msg);
    return false;
}

static void set_or_fail(ht_config *cfg, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void set_or_fail(ht_config *cfg, const char *fmt, ...) {
    char set[1600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(set, sizeof(set), fmt, ap);
    va_end(ap);
    ht_error err;
    assert_ht_ok(ht_config_set(cfg, set, &err), &err);
}

/* The variant's run on `backend` into dir/out, every step dumped: to step
 * `until` of its v->steps (the schedule's length), saving a checkpoint after step `save_at` (0: none), from the
 * checkpoint `restore` (NULL: fresh weights), every gradient times `factor`
 * (NULL: 1). */
static void train(const char *dir, const char *out, const char *backend, const variant *v, int until, int save_at,
                  const char *restore, const char *factor, run_losses *r) {
    ht_config *cfg = malloc(sizeof(ht_config));
    const tiny_model model = {.intermediate_size = 64, .num_hidden_layers = 2, .max_position_embeddings = 64};
    const char *base[] = {"training.local_batch_size=4", "training.global_batch_size=8", "training.eval_interval=0",
                          "training.log_interval=100",   "checkpoint.save_interval=0",   "training.dump_state=true",
                          "lr_scheduler.warmup_steps=0"};
    config_scratch_run(cfg, dir, model, 32, base, sizeof(base) / sizeof(base[0]));
    for (int i = 0; v->sets[i]; i++) set_or_fail(cfg, "%s", v->sets[i]);
    set_or_fail(cfg, "model_init_dtype=%s", v->f32 ? "float32" : "bfloat16");
    set_or_fail(cfg, "fsdp_config.mix_precision.param_dtype=%s", v->f32 ? "float32" : "bfloat16");
    set_or_fail(cfg, "kernels.backend=%s", backend);
    set_or_fail(cfg, "training.steps=%d", v->steps);
    set_or_fail(cfg, "checkpoint.output_dir=%s/%s", dir, out);
    if (restore) set_or_fail(cfg, "checkpoint.restore_from=%s", restore);
    if (factor) set_or_fail(cfg, "training.gradient_scaling_factor=%s", factor);
    ht_trainer *t = trainer_new(cfg);
    /* kernels.lm_head_chunk_mib: auto, the table's: 64 MiB on the CPU, 1 GiB on CUDA */
    assert_int_equal(t->model->head_chunk_bytes, (int64_t)ht_kernels()->lm_head_chunk_bytes);
    assert_int_equal(t->model->head_chunk_bytes, strcmp(backend, "cuda") == 0 ? (int64_t)1 << 30 : (int64_t)64 << 20);
    ht_error err;
    r->first = (int)t->step, r->last = until;
    for (int s = r->first; s < until; s++) {
        ht_step_stats st;
        assert_ht_ok(ht_trainer_step(t, &st, &err), &err);
        r->loss[s] = st.loss, r->grad_norm[s] = st.grad_norm;
        if (s + 1 == save_at) assert_ht_ok(ht_trainer_save_checkpoint(t, &err), &err);
    }
    trainer_delete(t);
    free(cfg);
    assert_ptr_equal(ht_kernels(), ht_kernels_cpu()); /* the trainer gave the table back */
}

static const char *state_file(const char *dir, const char *run, int step) {
    static char bufs[4][1400];
    static int next = 0;
    char *b = bufs[next++ % 4];
    snprintf(b, sizeof(bufs[0]), "%s/%s/state/step_%08d.safetensors", dir, run, step);
    return b;
}

/* What two runs' dumps are held to at one step. */
typedef struct dump_check {
    double grad_tol, tol;       /* main_grads, params */
    const tensor_errors *floor; /* the params' (with one: max(tol, FLOOR_FACTOR x floor) per tensor; NULL: tol) */
    int grads_step;      /* the reference's step whose main_grads leave params' elements undetermined (0: none) */
    double below;        /* ... those within this of their tensor's largest (0: UNDETERMINED_GRAD) */
    bool muon;           /* ... in AdamW's tensors alone (Muon's matrices compared whole) */
    tensor_errors *seen; /* the params' errors, by name (NULL: not kept) */
} dump_check;

/* The tensors AdamW updates under optimizer._target_=Muon: all but the matrices, and the matrices
 * optimizer.muon_config.adamw_include's default sends to it (the embedding, the LM head). */
static bool adamw_updated(const char *name, int ndim) {
    return ndim < 2 || strstr(name, "embed") || strstr(name, "lm_head");
}

static const char *const noise_driven = "self_attn.k_proj.bias"; /* Qwen2's: its gradient is compared alone */

/* dir/a's dump of `step` against dir/ref's, as `c` says: the main_grads' worst error in *grad (NULL: not
 * compared), the params' (but noise_driven's) returned; the elements left out added to *left_out. */
static double dump_error(const char *dir, const char *a, const char *ref, int step, const dump_check *c, double *grad,
                         int *left_out) {
    if (grad) {
        tensor_check g = {.prefix = "main_grad.", .tol = c->grad_tol};
        *grad = max_tensor_error(state_file(dir, a, step), state_file(dir, ref, step), &g);
        assert_true(g.tensors >= 9); /* 2 layers, the embedding, the norm, the head */
    }
    tensor_check p = {.prefix = "param.",
                      .skip = noise_driven,
                      .tol = c->tol,
                      .floor = c->floor,
                      .floor_factor = FLOOR_FACTOR,
                      .seen = c->seen,
                      .grads = c->grads_step ? state_file(dir, ref, c->grads_step) : NULL,
                      .undetermined_grad = c->below,
                      .undetermined_in = c->muon ? adamw_updated : NULL};
    double worst = max_tensor_error(state_file(dir, a, step), state_file(dir, ref, step), &p);
    assert_true(p.tensors >= 9);
    if (left_out) *left_out += p.undetermined;
    return worst;
}

/* Step s + 1's loss of `a` against `ref`'s, relative, within tol. */
static double losses_error(const char *name, const run_losses *a, const run_losses *ref, double tol) {
    double worst = 0;
    for (int s = a->first; s < a->last; s++) {
        double e = fabs(a->loss[s] - ref->loss[s]) / fabs(ref->loss[s]);
        if (!(e <= tol))
            fail_msg("%s, step %d: loss %.9g on the GPU, %.9g on the CPU (%.3g apart, bound %.3g)", name, s + 1,
                     a->loss[s], ref->loss[s], e, tol);
        worst = fmax(worst, e);
    }
    return worst;
}

/* The variant on either table, then the comparisons the header lists. */
static void check_variant(const variant *v) {
    const char *dir = scratch_dir(v->name);
    harness_write_corpus(dir, corpus_text, 60);
    run_losses cpu, cuda;
    train(dir, "cpu", "cpu", v, v->steps, 2, NULL, NULL, &cpu);
    train(dir, "cuda", "cuda", v, v->steps, 2, NULL, NULL, &cuda);
    const double loss_tol = v->f32 ? 1e-5 : 2e-4;
    double loss_err = losses_error(v->name, &cuda, &cpu, loss_tol);

    /* Step 1, from the same weights. float32: the first-step contract (main_grads 1e-6, params 1e-5; the
     * elements whose main_grad is within 1e-6 of their tensor's largest left out). bf16: main_grads within
     * 2^-12 (a product summed in another order flips an activation's bf16 rounding here and there:
     * docs/NUMERICS.md, the bf16 GEMM kernels' row) or FLOOR_FACTOR x their floor (the device's attention
     * tiles round P and dS against other running maxima); params within the seed's rtol 1e-2, the elements
     * whose main_grad is within that bound of their tensor's largest left out (AdamW's first step there,
     * lr g / (|g| + eps), may take either sign: 2 lr apart, 2.5e-2 of the embedding's largest entry). The
     * floors are measured on the CPU: step 1's main_grads, then the last step's params over the elements
     * compared. */
    tensor_errors *floor = calloc(1, sizeof(tensor_errors));
    tensor_errors *seen = calloc(1, sizeof(tensor_errors));
    double grad_floor_worst = 0, floor_worst = 0;
    /* bf16: the scaled gradients move backward's roundings, not forward's; runs whose bf16 products sum in
     * another order (the native kernel, where this CPU offers it: unscaled and with each factor) move both, as
     * the device does. Measured on the emulated device (AMD EPYC, AVX512-BF16): the unscaled native run
     * parts from the widened one by 1.5e-3 (main_grads, step 1), 5.9e-3 (params, step 1) and 1.5e-2
     * (params, step 4); the device by 2.0e-3, 6.0e-3 and 1.5e-2. */
    ht_gemm_choice offered;
    ht_error err = {0};
    const bool native = !v->f32 && ht_kernels_choose_gemm(HT_GEMM_KERNEL_NATIVE, HT_GEMM_KERNEL_WIDENED, 64, 64, 64,
                                                          &offered, &err) == HT_OK;
    if (!v->f32 && !native)
        printf("no native bf16 GEMM on this CPU (%s): the bf16 floor is the scaled gradients' alone\n", err.msg);
    variant other = *v;
    for (int i = 0; other.sets[i]; i++)
        if (strncmp(other.sets[i], "kernels.bf16_gemm=", 18) == 0) other.sets[i] = "kernels.bf16_gemm=native";
    char floor_runs[2 * NOISE_FLOOR_RUNS + 1][32];
    int nfloor = 0;
    for (int k = 0; k <= NOISE_FLOOR_RUNS; k++)
        for (int order = 0; order < 1 + native; order++) {
            if (k == NOISE_FLOOR_RUNS && !order) continue; /* the reference itself */
            snprintf(floor_runs[nfloor], sizeof(floor_runs[nfloor]), "floor%d%s", k, order ? "-native" : "");
            run_losses fl;
            train(dir, floor_runs[nfloor++], "cpu", order ? &other : v, v->steps, 0, NULL,
                  k < NOISE_FLOOR_RUNS ? noise_floor_factors[k] : NULL, &fl);
        }
    for (int k = 0; k < nfloor; k++) {
        tensor_check g = {.prefix = "main_grad.", .tol = INFINITY};
        grad_floor_worst =
            fmax(grad_floor_worst, max_tensor_error(state_file(dir, floor_runs[k], 1), state_file(dir, "cpu", 1), &g));
    }
    /* bf16: the model's floor for every tensor, FLOOR_FACTOR x its worst tensor's: the floor runs cannot
     * sample the device's attention (P and dS rounded to bf16 against its own running maxima) and every
     * main_grad lies downstream of it, so a tensor's own floor does not bound it (on the H200 the layer-1
     * o_proj weight's main_grad parted by 3.5e-4 at step 1, 2.4 x its own floor) */
    const double grad_tol = v->f32 ? 1e-6 : fmax(0x1p-12, FLOOR_FACTOR * grad_floor_worst);
    dump_check first = {.grad_tol = grad_tol, .tol = v->f32 ? 1e-5 : 1e-2, .grads_step = 1, .muon = !v->adamw};
    if (!v->f32) first.below = grad_tol;
    for (int k = 0; k < nfloor; k++) {
        dump_check c = first;
        c.tol = INFINITY, c.seen = floor;
        floor_worst = fmax(floor_worst, dump_error(dir, floor_runs[k], "cpu", v->steps, &c, NULL, NULL));
    }
    int left_out = 0;
    double grad1, param1 = dump_error(dir, "cuda", "cpu", 1, &first, &grad1, &left_out);
    /* the last step: each param within FLOOR_FACTOR x its floor where that is above the tolerance */
    dump_check last = first;
    last.floor = floor, last.seen = seen;
    if (!v->f32) {
        /* bf16 from step 2 on: the floor runs never change the order inside the CPU's attention kernel, nor can
         * they sample the device's, so a tensor fed by attention's scores may part by more than its own floor:
         * the layer-0 q_proj and k_proj weights at step 4, 1.18e-2 and 1.12e-2 from the CPU's, their floors
         * 5.9e-3 and 4.2e-3, the model's 1.5e-2 (a bf16 ulp of a tensor's largest entry is 3.9e-3). The
         * bound is the model's floor, FLOOR_FACTOR x its worst tensor's, for every tensor. */
        last.floor = NULL;
        last.tol = fmax(last.tol, FLOOR_FACTOR * floor_worst);
    }
    double param_last = dump_error(dir, "cuda", "cpu", v->steps, &last, NULL, &left_out);
    const char *nearest = "";
    double ratio = 0;
    for (int i = 0; i < seen->count; i++) {
        double r = seen->err[i] / fmax(last.tol, FLOOR_FACTOR * tensor_error_of(last.floor, seen->name[i]));
        if (r > ratio) ratio = r, nearest = seen->name[i];
    }
    printf("%s, %d steps on the GPU against the CPU: losses within %.3g (bound %.3g); step 1's main_grads within "
           "%.3g (bound %.3g%s; their floor %.3g), params %.3g (bound %.3g); step %d's params %.3g, at most %.0f%% "
           "of their bound (%s; floor %.3g); %d undetermined elements left out\n",
           v->name, v->steps, loss_err, loss_tol, grad1, grad_tol, v->f32 ? "" : ": 2 x the model's floor",
           grad_floor_worst, param1, first.tol, v->steps, param_last, 100 * ratio, nearest, floor_worst, left_out);

    /* a checkpoint of step 2 resumed on the other table: step 3 from the same state as the run that went on,
     * held to the first step's bounds (the undetermined elements by step 3's main_grads) */
    char from[1400];
    run_losses on;
    dump_check third = first;
    third.grads_step = 3;
    double l_a, g_a, p_a, l_b, g_b, p_b;
    snprintf(from, sizeof(from), "%s/cpu/step_00000002", dir);
    train(dir, "cpu-to-cuda", "cuda", v, 3, 0, from, NULL, &on);
    l_a = losses_error("resumed on the GPU", &on, &cpu, loss_tol);
    p_a = dump_error(dir, "cpu-to-cuda", "cpu", 3, &third, &g_a, NULL);
    snprintf(from, sizeof(from), "%s/cuda/step_00000002", dir);
    train(dir, "cuda-to-cpu", "cpu", v, 3, 0, from, NULL, &on);
    l_b = losses_error("resumed on the CPU", &on, &cuda, loss_tol);
    p_b = dump_error(dir, "cuda-to-cpu", "cuda", 3, &third, &g_b, NULL);
    printf("%s, step 2's checkpoint resumed for step 3: the CPU's on the GPU (loss %.3g, main_grads %.3g, params "
           "%.3g apart), the GPU's on the CPU (%.3g, %.3g, %.3g)\n",
           v->name, l_a, g_a, p_a, l_b, g_b, p_b);
    free(floor);
    free(seen);
}

static const variant qwen2_f32_muon = {
    .name = "cuda_trainer_qwen2_f32_muon", .f32 = true, .steps = 4, .sets = {"optimizer._target_=Muon", NULL}};
static const variant qwen2_f32_adamw = {.name = "cuda_trainer_qwen2_f32_adamw",
                                        .f32 = true,
                                        .adamw = true,
                                        .steps = 4,
                                        .sets = {"optimizer._target_=AdamW", NULL}};
static const variant qwen2_moe_f32 = {.name = "cuda_trainer_qwen2_moe_f32",
                                      .f32 = true,
                                      .steps = 4,
                                      .sets = {"model.name=qwen2_moe", "model.num_experts=4",
                                               "model.num_experts_per_tok=2", "model.moe_intermediate_size=32",
                                               "model.shared_expert_intermediate_size=64", NULL}};
/* bf16 with FP32 main params and Muon; head dim 32, so attention runs on the device's tensor-core kernel */
static const variant qwen2_bf16_muon = {.name = "cuda_trainer_qwen2_bf16_muon",
                                        .f32 = false,
                                        .steps = 4,
                                        .sets = {"optimizer._target_=Muon", "model.hidden_size=128",
                                                 "model.intermediate_size=256", "kernels.bf16_gemm=widened", NULL}};

/* DeepSeek-V3's grouped routing has no CUDA kernel yet: its first step is
 * refused, naming the backend, never a call through an empty entry. */
static void test_deepseek_v3_refused_on_cuda(void **state) {
    (void)state;
    if (!cuda_present()) skip();
    const char *dir = scratch_dir("cuda_trainer_deepseek_refused");
    harness_write_corpus(dir, corpus_text, 60);
    ht_config *cfg = malloc(sizeof(ht_config));
    const tiny_model model = {.intermediate_size = 64, .num_hidden_layers = 2, .max_position_embeddings = 64};
    const char *sets[] = {"model.name=deepseek_v3",      "model.n_routed_experts=4",
                          "model.num_experts_per_tok=2", "model.n_group=2",
                          "model.topk_group=1",          "model.moe_intermediate_size=16",
                          "model.q_lora_rank=16",        "model.kv_lora_rank=16",
                          "model.qk_nope_head_dim=8",    "model.qk_rope_head_dim=8",
                          "model.v_head_dim=8",          "model.first_k_dense_replace=1",
                          "model.attention_bias=false",  "model_init_dtype=float32",
                          "kernels.backend=cuda",        "training.steps=1",
                          "training.eval_interval=0",    "checkpoint.save_interval=0"};
    config_scratch_run(cfg, dir, model, 32, sets, sizeof(sets) / sizeof(sets[0]));
    ht_trainer *t = trainer_new(cfg);
    ht_step_stats st;
    ht_error err = {0};
    assert_int_equal(ht_trainer_step(t, &st, &err), HT_ERR_CONFIG);
    if (!strstr(err.msg, "grouped expert routing has no kernel in the cuda backend"))
        fail_msg("not the refusal: %s", err.msg);
    trainer_delete(t);
    free(cfg);
}

/* What a training step costs in the host's waits for the device
 * (ht_kernels_cuda_waits), each a gap in the device's queue: one a
 * micro-batch (its loss, read back), one before the gradients are summed,
 * one for the clipping's norm and one after the update; with experts one
 * more a micro-batch and sparse layer (the routed rows' counts size the
 * expert products on the host), two with the load-balancing loss (its
 * probabilities' sums). Nothing else: a batch's tokens go up from
 * pageable memory without a wait, and one process's gathers of a Muon
 * matrix (a group of one) are device copies, not round trips through the
 * host (before: two a matrix, with the matrix's bytes). Step 2 (step 1 also
 * plans and times each product), 2 micro-batches a step, nothing dumped. */
static void test_host_waits_a_step(void **state) {
    (void)state;
    if (!cuda_present()) skip();
    static const struct {
        const char *name, *sets[8];
        int routing; /* the routing's reads a micro-batch: per sparse layer one, two with the load-balancing loss */
    } runs[] = {
        {"bf16 Muon", {"optimizer._target_=Muon", "model_init_dtype=bfloat16", NULL}, 0},
        {"f32 AdamW", {"optimizer._target_=AdamW", "model_init_dtype=float32", NULL}, 0},
        {"f32 Qwen2-MoE Muon",
         {"optimizer._target_=Muon", "model_init_dtype=float32", "model.name=qwen2_moe", "model.num_experts=4",
          "model.num_experts_per_tok=2", "model.moe_intermediate_size=32", NULL},
         2},
        {"bf16 Qwen2-MoE Muon with its load-balancing loss",
         {"optimizer._target_=Muon", "model_init_dtype=bfloat16", "model.name=qwen2_moe", "model.num_experts=4",
          "model.num_experts_per_tok=2", "model.moe_intermediate_size=32", "model.output_router_logits=true", NULL},
         4},
    };
    enum { MICRO = 2 };
    for (size_t i = 0; i < sizeof(runs) / sizeof(runs[0]); i++) {
        char name[64];
        snprintf(name, sizeof(name), "cuda_trainer_waits%zu", i);
        const char *dir = scratch_dir(name);
        harness_write_corpus(dir, corpus_text, 60);
        ht_config *cfg = malloc(sizeof(ht_config));
        const tiny_model model = {.intermediate_size = 32, .num_hidden_layers = 2, .max_position_embeddings = 32};
        const char *sets[] = {"training.local_batch_size=2",
                              "training.global_batch_size=4",
                              "training.eval_interval=0",
                              "training.log_interval=1",
                              "checkpoint.save_interval=0",
                              "kernels.backend=cuda",
                              "training.steps=2",
                              "training.max_norm=1.0"};
        config_scratch_run(cfg, dir, model, 16, sets, sizeof(sets) / sizeof(sets[0]));
        for (int k = 0; runs[i].sets[k]; k++) set_or_fail(cfg, "%s", runs[i].sets[k]);
        ht_trainer *t = trainer_new(cfg);
        ht_error err = {0};
        const int64_t bound = MICRO * (1 + runs[i].routing) + 3;
        int64_t most = 0;
        for (int step = 0; step < 2; step++) {
            const int64_t before = ht_kernels_cuda_waits();
            ht_step_stats st;
            assert_ht_ok(ht_trainer_step(t, &st, &err), &err);
            const int64_t waits = ht_kernels_cuda_waits() - before;
            if (step > 0 && waits > bound)
                fail_msg("%s, step %d: the host waited for the device %lld times, more than %lld", runs[i].name,
                         step + 1, (long long)waits, (long long)bound);
            if (step > 0 && waits > most) most = waits;
        }
        printf("%s: the host waits for the device %lld times a step (at most %lld)\n", runs[i].name, (long long)most,
               (long long)bound);
        trainer_delete(t);
        free(cfg);
    }
}

static void test_qwen2_float32_muon(void **state) {
    (void)state;
    if (!cuda_present()) skip();
    check_variant(&qwen2_f32_muon);
}

static void test_qwen2_float32_adamw(void **state) {
    (void)state;
    if (!cuda_present()) skip();
    check_variant(&qwen2_f32_adamw);
}

static void test_qwen2_moe_float32(void **state) {
    (void)state;
    if (!cuda_present()) skip();
    check_variant(&qwen2_moe_f32);
}

static void test_qwen2_bf16_muon(void **state) {
    (void)state;
    if (!cuda_present()) skip();
    check_variant(&qwen2_bf16_muon);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_deepseek_v3_refused_on_cuda), cmocka_unit_test(test_host_waits_a_step),
        cmocka_unit_test(test_qwen2_float32_muon),          cmocka_unit_test(test_qwen2_float32_adamw),
        cmocka_unit_test(test_qwen2_moe_float32),           cmocka_unit_test(test_qwen2_bf16_muon),
    };
    if (getenv("HT_TEST_FILTER")) cmocka_set_test_filter(getenv("HT_TEST_FILTER"));
    /* the bf16 bounds are the own attention kernels' (docs/NUMERICS.md); cuDNN's is test_kernels' */
    ht_kernels_cuda_set_attention(HT_CUDA_ATTENTION_OWN);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
