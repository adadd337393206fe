/* The trainer end to end on a tiny model and a small corpus: the loss falls,
 * the metrics, plot and final weights are written and load back; and the
 * `hypertrain` command refuses bad input with a clear error, exit status
 * non-zero and nothing written. */
#include "harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <glob.h>
#include <sys/stat.h>

#include "hypertrain/ckpt.h"
#include "hypertrain/config.h"
#include "hypertrain/kernels.h"
#include "hypertrain/train.h"
#include "train/events.h"

static const char *corpus =
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
    "it was the season of Darkness, it was the spring of hope, it was the winter of despair.\n";

/* The corpus 60 times into dir/corpus.txt. */
static void write_corpus(const char *dir) { harness_write_corpus(dir, corpus, 60); }

/* A tiny byte-level model on the corpus in `dir`, writing into dir/run. */
static void tiny_config(ht_config *cfg, const char *dir) {
    const char *sets[] = {
        "optimizer._target_=AdamW",
        "optimizer.adamw_config.adamw_lr=0.01",
        "lr_scheduler.type=ConstantWarmUpLR",
        "lr_scheduler.warmup_steps=2",
        "training.steps=40",
        "training.local_batch_size=4",
        "training.global_batch_size=8",
        "training.log_interval=10",
        "training.eval_interval=20",
        "training.eval_batches=4",
        "model_init_dtype=float32",
        "fsdp_config.mix_precision.param_dtype=float32",
    };
    const tiny_model model = {.intermediate_size = 64, .num_hidden_layers = 2, .max_position_embeddings = 64};
    config_scratch_run(cfg, dir, model, 32, sets, sizeof(sets) / sizeof(sets[0]));
}

/* A segmented Newton-Schulz schedule runs its own length: three iterations
 * with muon_ns_steps at its default 5 (shorter than 5 only when ns_steps is
 * given, which validation refuses, naming both keys). */
static void test_segmented_schedule_runs_its_own_length(void **state) {
    (void)state;
    const char *dir = scratch_dir("train_ns_segments");
    write_corpus(dir);
    ht_config *cfg = malloc(sizeof(ht_config));
    tiny_config(cfg, dir);
    ht_error err;
    assert_ht_ok(ht_config_set(cfg, "optimizer._target_=Muon", &err), &err);
    assert_ht_ok(ht_config_set(cfg, "optimizer.muon_config.muon_ns_variant=custom", &err), &err);
    assert_ht_ok(ht_config_set(cfg, "optimizer.muon_config.muon_ns_coefficients=[[[3.4445, -4.775, 2.0315], 3]]", &err),
                 &err);
    ht_trainer *t = trainer_new(cfg);
    assert_non_null(t->optimizer.muon);
    assert_int_equal(t->optimizer.muon->config.schedule.steps, 3);
    assert_true(t->optimizer.muon->config.schedule.coeffs[2][1] == -4.775);
    trainer_delete(t);
    assert_ht_ok(ht_config_set(cfg, "optimizer.muon_config.muon_ns_steps=5", &err), &err);
    assert_int_equal(ht_config_validate(cfg, 1, &err), HT_ERR_CONFIG);
    assert_non_null(strstr(err.msg, "muon_ns_steps"));
    free(cfg);
}

/* optimizer.muon_config.muon_ns_form gram reaches Muon and changes its
 * arithmetic, not its result: three steps of the tiny model (its 64 x 32
 * MLP matrices take the Gram form) give other bits than the standard form,
 * within 1e-4 relative of them in every param (each step's update within
 * the FP32 Newton-Schulz bound of docs/NUMERICS.md, times lr). */
static void test_gram_form_in_the_trainer(void **state) {
    (void)state;
    const char *dir = scratch_dir("train_ns_gram");
    write_corpus(dir);
    ht_config *cfg = malloc(sizeof(ht_config));
    tiny_config(cfg, dir);
    ht_error err;
    assert_ht_ok(ht_config_set(cfg, "optimizer._target_=Muon", &err), &err);
    ht_trainer *t[2] = {NULL, NULL};
    for (int form = 0; form < 2; form++) {
        if (form) assert_ht_ok(ht_config_set(cfg, "optimizer.muon_config.muon_ns_form=gram", &err), &err);
        t[form] = trainer_new(cfg);
        assert_true(t[form]->optimizer.muon->config.schedule.form == (form ? HT_NS_FORM_GRAM : HT_NS_FORM_STANDARD));
        for (int k = 0; k < 3; k++) {
            ht_step_stats st;
            assert_ht_ok(ht_trainer_step(t[form], &st, &err), &err);
        }
    }
    const ht_param_store *a = &t[0]->model->params, *b = &t[1]->model->params;
    bool differ = false;
    double worst = 0;
    for (int i = 0; i < a->count; i++) {
        const size_t n = (size_t)ht_param_local_numel(&a->items[i]);
        differ = differ || memcmp(a->items[i].data, b->items[i].data, n * sizeof(float)) != 0;
        worst = fmax(worst, rel_max_err(b->items[i].data, a->items[i].data, n));
    }
    printf("  Gram form vs the standard form after 3 steps: params within %.3g\n", worst);
    if (!differ) fail_msg("muon_ns_form gram left every bit as the standard form's: it did not reach Muon");
    if (worst > 1e-4) fail_msg("the Gram form's params are %.3g from the standard form's (limit 1e-4)", worst);
    trainer_delete(t[0]);
    trainer_delete(t[1]);
    free(cfg);
}

/* Whether two trainers hold the same weights and FP32 main params, bit for
 * bit (the main params read through ht_param_main_read, however held). */
static void assert_same_state(const ht_trainer *a, const ht_trainer *b, int step) {
    const ht_param_store *x = &a->model->params, *y = &b->model->params;
    for (int i = 0; i < x->count; i++) {
        const ht_param *p = &x->items[i], *q = &y->items[i];
        const int64_t n = ht_param_local_numel(p);
        if (memcmp(p->data, q->data, (size_t)n * ht_dtype_size(p->dtype)) != 0)
            fail_msg("step %d: %s's weights differ", step, p->name);
        if (!p->trainable) continue;
        float *u = malloc((size_t)n * sizeof(float)), *v = malloc((size_t)n * sizeof(float));
        ht_param_main_read(p, 0, n, u);
        ht_param_main_read(q, 0, n, v);
        if (memcmp(u, v, (size_t)n * sizeof(float)) != 0) fail_msg("step %d: %s's main params differ", step, p->name);
        free(u);
        free(v);
    }
}

/* optimizer.main_param_storage residual16: a bf16 weight with the low 16
 * bits of its FP32 main param beside it is the FP32 copy, bit for bit:
 * every step's loss, weights and main params equal a copy's (Muon with
 * torch's arithmetic (ema), AdamW and QK-clip updating them; test_dist runs
 * the sum style), in half the main params' bytes; and a
 * checkpoint of either resumes into the other with the same steps after. */
static void test_residual16_is_the_fp32_copy_bit_for_bit(void **state) {
    (void)state;
    const char *dir = scratch_dir("train_residual16");
    write_corpus(dir);
    ht_config *cfg = malloc(sizeof(ht_config));
    tiny_config(cfg, dir);
    ht_error err;
    const char *sets[] = {"optimizer._target_=Muon",
                          "model_init_dtype=bfloat16",
                          "fsdp_config.mix_precision.param_dtype=bfloat16",
                          "optimizer.muon_config.muon_lr=0.05",
                          "optimizer.muon_config.qk_clip_enabled=true",
                          "optimizer.muon_config.qk_clip_threshold=2",
                          "optimizer.muon_config.muon_momentum_style=ema"};
    for (size_t k = 0; k < sizeof(sets) / sizeof(sets[0]); k++) assert_ht_ok(ht_config_set(cfg, sets[k], &err), &err);
    char set[1200];
    ht_trainer *t[2];
    for (int r = 0; r < 2; r++) {
        snprintf(set, sizeof(set), "checkpoint.output_dir=%s/run_%s", dir, r ? "residual16" : "fp32");
        assert_ht_ok(ht_config_set(cfg, set, &err), &err);
        assert_ht_ok(ht_config_set(cfg,
                                   r ? "optimizer.main_param_storage=residual16" : "optimizer.main_param_storage=fp32",
                                   &err),
                     &err);
        t[r] = trainer_new(cfg);
    }
    const ht_param_store *a = &t[0]->model->params, *b = &t[1]->model->params;
    size_t halves = 0;
    for (int i = 0; i < b->count; i++) {
        const ht_param *p = &b->items[i];
        if (!p->trainable || p->dtype == HT_DTYPE_F32) continue;
        assert_null(p->main_param);
        assert_non_null(p->main_low);
        halves += ht_align64((size_t)ht_param_local_numel(p) * sizeof(uint16_t));
    }
    printf("  main params: %zu bytes as FP32 copies, %zu as residual16\n", a->main_bytes, b->main_bytes);
    assert_true(halves > 0 && b->main_bytes == halves && a->main_bytes >= 2 * halves - 64 * (size_t)b->count);
    int64_t ties = 0;
    for (int step = 1; step <= 8; step++) {
        ht_step_stats s[2];
        for (int r = 0; r < 2; r++) assert_ht_ok(ht_trainer_step(t[r], &s[r], &err), &err);
        if (memcmp(&s[0].loss, &s[1].loss, sizeof(double)) != 0)
            fail_msg("step %d: loss %.17g with FP32 copies, %.17g with residual16", step, s[0].loss, s[1].loss);
        assert_same_state(t[0], t[1], step);
        /* The listed ties are the copies' values of low half 0x8000 under an odd high half. */
        for (int i = 0; i < b->count; i++) {
            const ht_param *p = &a->items[i], *q = &b->items[i];
            if (!q->main_low) continue;
            int64_t want = 0;
            for (int64_t k = 0; k < ht_param_local_numel(p); k++) {
                uint32_t bits;
                memcpy(&bits, &p->main_param[k], 4);
                want += (bits & 0x1ffff) == 0x18000;
            }
            if (q->main_tie_count != want)
                fail_msg("step %d: %s lists %lld ties, its copy has %lld", step, q->name, (long long)q->main_tie_count,
                         (long long)want);
            ties += want;
        }
    }
    printf("  8 steps: losses, weights and main params equal; %lld ties listed along the way\n", (long long)ties);
    /* Each checkpoint resumes into the other storage. */
    for (int r = 0; r < 2; r++) assert_ht_ok(ht_trainer_save_checkpoint(t[r], &err), &err);
    ht_trainer *u[2];
    for (int r = 0; r < 2; r++) {
        snprintf(set, sizeof(set), "checkpoint.output_dir=%s/resumed_%d", dir, r);
        assert_ht_ok(ht_config_set(cfg, set, &err), &err);
        snprintf(set, sizeof(set), "checkpoint.restore_from=%s/run_%s/step_00000008", dir, r ? "residual16" : "fp32");
        assert_ht_ok(ht_config_set(cfg, set, &err), &err);
        assert_ht_ok(ht_config_set(cfg,
                                   r ? "optimizer.main_param_storage=fp32" : "optimizer.main_param_storage=residual16",
                                   &err),
                     &err);
        u[r] = trainer_new(cfg);
        assert_same_state(t[r], u[r], 8);
    }
    for (int step = 9; step <= 10; step++) {
        ht_step_stats s[4];
        for (int r = 0; r < 2; r++) {
            assert_ht_ok(ht_trainer_step(t[r], &s[r], &err), &err);
            assert_ht_ok(ht_trainer_step(u[r], &s[2 + r], &err), &err);
            if (memcmp(&s[r].loss, &s[2 + r].loss, sizeof(double)) != 0)
                fail_msg("step %d: the resumed loss differs", step);
            assert_same_state(t[r], u[r], step);
        }
    }
    for (int r = 0; r < 2; r++) {
        trainer_delete(t[r]);
        trainer_delete(u[r]);
    }
    free(cfg);
}

/* MFU with Newton-Schulz: Muon's iterations are GEMM work the model's FLOPs
 * leave out. The tiny model's Muon matrices per layer (q and o 32 x 32, k
 * and v 16 x 32, gate, up and down 64 x 32 or 32 x 64) at 5 iterations of
 * 4 r^2 c + 2 r^3 come to 14,581,760 FLOPs a step on two layers; the step's
 * mfu_with_ns is its mfu plus them over the step's seconds and the rate.
 * AdamW alone has none, and no second figure. */
static void test_mfu_with_newton_schulz(void **state) {
    (void)state;
    const char *dir = scratch_dir("train_mfu_ns");
    write_corpus(dir);
    ht_config *cfg = malloc(sizeof(ht_config));
    tiny_config(cfg, dir);
    ht_error err;
    for (int muon = 0; muon < 2; muon++) {
        assert_ht_ok(ht_config_set(cfg, muon ? "optimizer._target_=Muon" : "optimizer._target_=AdamW", &err), &err);
        ht_trainer *t = trainer_new(cfg);
        t->gemm_gflops = 1000;
        ht_step_stats st;
        assert_ht_ok(ht_trainer_step(t, &st, &err), &err);
        const double ns = ht_optimizer_ns_flops(&t->optimizer);
        printf("  %s: Newton-Schulz %.0f FLOPs a step, MFU %.6f, with Newton-Schulz %.6f\n", muon ? "Muon" : "AdamW",
               ns, st.mfu, st.mfu_with_ns);
        assert_true(ns == (muon ? 14581760.0 : 0.0));
        if (muon)
            assert_true(fabs(st.mfu_with_ns - (st.mfu + ns / st.seconds / 1e12)) <= 1e-12 * st.mfu_with_ns);
        else
            assert_true(st.mfu_with_ns == 0.0);
        trainer_delete(t);
    }
    free(cfg);
}

/* kernels.lm_head_chunk_mib: auto is the kernel table's bound (the CPU's and the fenced one's 64 MiB), a
 * number its MiB, 0 no chunks. */
static void test_lm_head_chunk_bound(void **state) {
    (void)state;
    const char *dir = scratch_dir("train_lm_head_chunk");
    write_corpus(dir);
    ht_config *cfg = malloc(sizeof(ht_config));
    tiny_config(cfg, dir);
    ht_error err;
    const char *sets[] = {"kernels.backend=cpu", "kernels.backend=fenced", "kernels.lm_head_chunk_mib=3",
                          "kernels.lm_head_chunk_mib=0"};
    const int64_t want[] = {(int64_t)64 << 20, (int64_t)64 << 20, (int64_t)3 << 20, 0};
    for (int i = 0; i < 4; i++) {
        assert_ht_ok(ht_config_set(cfg, sets[i], &err), &err);
        ht_trainer *t = trainer_new(cfg);
        assert_int_equal(t->model->head_chunk_bytes, want[i]);
        trainer_delete(t);
    }
    free(cfg);
}

/* An MFU above 100% is no measurement (the peak was timed on a busy machine,
 * or is not what these products reach): metrics.jsonl carries no "mfu" then,
 * and the step line says n/a, never "MFU 111.8%". The peak is set as low as
 * such a start would measure it. */
static void test_an_mfu_above_the_peak_is_not_reported(void **state) {
    (void)state;
    const char *dir = scratch_dir("train_mfu_peak");
    write_corpus(dir);
    ht_config *cfg = malloc(sizeof(ht_config));
    tiny_config(cfg, dir);
    ht_error err;
    assert_ht_ok(ht_config_set(cfg, "training.steps=3", &err), &err);
    ht_trainer *t = trainer_new(cfg);
    t->gemm_gflops = 1e-9;
    assert_ht_ok(ht_trainer_run(t, &err), &err);
    char path[1400];
    snprintf(path, sizeof(path), "%s/run/metrics.jsonl", dir);
    char *text = read_text(path);
    assert_non_null(strstr(text, "\"tokens_per_s\""));
    if (strstr(text, "\"mfu\"")) fail_msg("an MFU above 100%% was written:\n%s", text);
    free(text);
    trainer_delete(t);
    free(cfg);
}

/* Little-endian integers of an event file. */
static uint64_t le(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

/* training.tensorboard's framing: CRC-32C against its published values
 * (RFC 3720's, and the usual "123456789"), and an event file read back
 * record by record: each length and each Event under its masked CRC, the
 * file_version first, a resumed file's SessionLog START at its first step,
 * one scalar's tag and float where protobuf puts them. A file the disk
 * refuses is an error that names it. */
static void test_tensorboard_event_framing(void **state) {
    (void)state;
    unsigned char zeros[32] = {0}, ones[32];
    memset(ones, 0xff, sizeof(ones));
    assert_int_equal(ht_crc32c("123456789", 9, 0), 0xE3069283u);
    assert_int_equal(ht_crc32c(zeros, 32, 0), 0x8A9136AAu);
    assert_int_equal(ht_crc32c(ones, 32, 0), 0x62A8AB43u);
    assert_int_equal(ht_crc32c("6789", 4, ht_crc32c("12345", 5, 0)), 0xE3069283u); /* chained */
    const char *dir = scratch_dir("train_tensorboard_framing");
    ht_events w;
    ht_error err;
    assert_ht_ok(ht_events_open(&w, dir, 5, &err), &err);
    assert_non_null(strstr(w.path, "/events.out.tfevents."));
    ht_events_begin(&w, 7);
    ht_events_scalar(&w, "train/loss", 2.5);
    ht_events_scalar(&w, "left/out", NAN);
    assert_ht_ok(ht_events_end(&w, &err), &err);
    char path[sizeof(w.path)];
    snprintf(path, sizeof(path), "%s", w.path);
    assert_ht_ok(ht_events_close(&w, &err), &err);
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    unsigned char buf[1024];
    size_t n = fread(buf, 1, sizeof(buf), f);
    fclose(f);
    int records = 0;
    const unsigned char *data[3] = {0};
    size_t lens[3] = {0};
    for (size_t at = 0; at < n; records++) {
        assert_true(at + 12 <= n && records < 3);
        uint64_t len = le(buf + at, 8);
        assert_int_equal(le(buf + at + 8, 4), ht_events_masked_crc(buf + at, 8));
        assert_true(at + 16 + len <= n);
        assert_int_equal(le(buf + at + 12 + len, 4), ht_events_masked_crc(buf + at + 12, len));
        data[records] = buf + at + 12, lens[records] = len;
        at += 16 + len;
    }
    assert_int_equal(records, 3);
    /* Event{1: wall_time (fixed64), 3: "brain.Event:2"} */
    assert_int_equal(data[0][0], 0x09);
    assert_int_equal(lens[0], 9 + 2 + 13);
    assert_memory_equal(data[0] + 11, "brain.Event:2", 13);
    /* Event{1: wall_time, 2: step 5, 7: SessionLog{1: START}} */
    const unsigned char start[] = {0x10, 5, 0x3a, 2, 0x08, 1};
    assert_int_equal(lens[1], 9 + sizeof(start));
    assert_memory_equal(data[1] + 9, start, sizeof(start));
    /* Event{1: wall_time, 2: step 7, 5: Summary{1: Value{1: "train/loss", 2: 2.5f}}}; the NaN left out */
    const unsigned char scalar[] = {0x10, 7,   0x2a, 19,  0x0a, 17,  0x0a, 10, 't', 'r',  'a', 'i',
                                    'n',  '/', 'l',  'o', 's',  's', 0x15, 0,  0,   0x20, 0x40};
    assert_int_equal(lens[2], 9 + sizeof(scalar));
    assert_memory_equal(data[2] + 9, scalar, sizeof(scalar));

    /* A full disk: the flush fails, naming the file. */
    assert_ht_ok(ht_events_open(&w, dir, 1, &err), &err);
    fclose(w.f);
    w.f = fopen("/dev/full", "w");
    assert_non_null(w.f);
    ht_events_begin(&w, 1);
    ht_events_scalar(&w, "train/loss", 1.0);
    assert_ht_ok(ht_events_end(&w, &err), &err); /* buffered */
    assert_int_equal(ht_events_flush(&w, &err), HT_ERR_IO);
    assert_non_null(strstr(err.msg, "events.out.tfevents."));
    assert_non_null(strstr(err.msg, "No space left on device"));
    assert_int_equal(ht_events_close(&w, &err), HT_ERR_IO);
}

/* The plot: the loss panel and, on the same step axis, the learning rates,
 * the gradient norm and the tokens a second, each axis labelled; a null
 * (an fp16 step skipped on overflow has no norm) is left out, never a point
 * at 0; a run with validation points alone is the loss panel alone. */
static void test_plot_panels(void **state) {
    (void)state;
    const char *dir = scratch_dir("train_plot_panels");
    char metrics[1300], svg[1300];
    snprintf(metrics, sizeof(metrics), "%s/metrics.jsonl", dir);
    snprintf(svg, sizeof(svg), "%s/loss.svg", dir);
    const char *lines = "{\"step\": 0, \"val_loss\": 5.5}\n"
                        "{\"step\": 1, \"loss\": 5.4, \"lr\": 1e-4, \"muon_lr\": 2e-3, \"grad_norm\": 1.5, "
                        "\"tokens_per_s\": 1000.0}\n"
                        "{\"step\": 2, \"loss\": 5.0, \"lr\": 2e-4, \"muon_lr\": 4e-3, \"grad_norm\": null, "
                        "\"tokens_per_s\": 1200.0}\n"
                        "{\"step\": 3, \"loss\": 4.5, \"lr\": 3e-4, \"muon_lr\": 6e-3, \"grad_norm\": 1.25, "
                        "\"tokens_per_s\": 1100.0}\n";
    write_file(metrics, lines, strlen(lines));
    ht_error err;
    assert_ht_ok(ht_plot_metrics(metrics, svg, &err), &err);
    char *text = read_text(svg);
    const char *labels[] = {">cross-entropy (nats/token)<",
                            ">AdamW lr<",
                            ">Muon lr<",
                            ">gradient norm<",
                            ">tokens / s<",
                            ">optimizer step<",
                            ">validation loss<"};
    for (size_t i = 0; i < sizeof(labels) / sizeof(labels[0]); i++)
        if (!strstr(text, labels[i])) fail_msg("no %s in the plot:\n%s", labels[i], text);
    /* the step labels once, under the last panel: "3" at the end of the axis */
    int steps = 0;
    for (const char *p = text; (p = strstr(p, "text-anchor=\"middle\">3<")) != NULL; p++) steps++;
    assert_int_equal(steps, 1);
    free(text);
    const char *alone = "{\"step\": 0, \"val_loss\": 5.5}\n{\"step\": 4, \"val_loss\": 4.0}\n";
    write_file(metrics, alone, strlen(alone));
    assert_ht_ok(ht_plot_metrics(metrics, svg, &err), &err);
    text = read_text(svg);
    assert_non_null(strstr(text, ">cross-entropy (nats/token)<"));
    assert_null(strstr(text, ">gradient norm<"));
    free(text);
}

static void test_training_lowers_validation_loss(void **state) {
    (void)state;
    const char *dir = scratch_dir("train_tiny");
    write_corpus(dir);
    ht_config *cfg = malloc(sizeof(ht_config));
    tiny_config(cfg, dir);
    ht_trainer *t = trainer_new(cfg);
    ht_error err;
    double before, after;
    assert_ht_ok(ht_trainer_evaluate(t, &before, &err), &err);
    assert_ht_ok(ht_trainer_run(t, &err), &err);
    assert_ht_ok(ht_trainer_evaluate(t, &after, &err), &err);
    printf("validation loss %.4f -> %.4f\n", before, after);
    assert_true(before > 4.5);         /* ~ln(256) at initialisation */
    assert_true(after < before - 2.0); /* a repetitive text is learned quickly */

    char path[1400];
    snprintf(path, sizeof(path), "%s/run/metrics.jsonl", dir);
    char *text = read_text(path);
    int lines = 0;
    for (size_t i = 0; text[i]; i++) lines += text[i] == '\n';
    assert_true(lines >= 40 + 3); /* every step and every evaluation */
    assert_non_null(strstr(text, "\"tokens_per_s\""));
    const char *mfu = strstr(text, "\"mfu\": ");
    assert_non_null(mfu);
    /* against the rate of a product of at least 512 a side: 9-14% here (against its own 128 x 32 x 32
     * products' rate, 49 GFLOP/s where 512 a side runs at 150, this model read 28-55%) */
    assert_true(atof(mfu + 7) > 0.0 && atof(mfu + 7) < 1.0);
    /* The model FLOPs it counts: 6 per weight of every matmul (2-D params but the embedding; the head once) plus
     * attention's causal half, 6 L T H D. */
    const ht_param_store *ps = &t->model->params;
    const ht_model_config *a = &t->model->config;
    double matmul = a->tie_word_embeddings ? (double)a->vocab_size * a->hidden_size : 0.0;
    for (int i = 0; i < ps->count; i++)
        if (ps->items[i].ndim == 2 && !strstr(ps->items[i].name, "embed_tokens"))
            matmul += (double)ht_param_numel(&ps->items[i]);
    double want = 6 * matmul + 6.0 * a->num_hidden_layers * 32 * a->num_attention_heads * ht_model_config_head_dim(a);
    assert_true(fabs(ht_model_flops_per_token(a, 32) - want) <= 1e-9 * want);
    assert_non_null(strstr(text, "\"val_loss\""));
    free(text);
    snprintf(path, sizeof(path), "%s/run/loss.svg", dir);
    assert_true(path_exists(path));

    /* The final weights load back into a fresh model and give the same logits. */
    snprintf(path, sizeof(path), "%s/run/final", dir);
    ht_model_config arch;
    assert_ht_ok(ht_hf_read_config(path, &arch, &err), &err);
    ht_model *copy;
    assert_ht_ok(ht_model_build(&arch, HT_DTYPE_F32, 7, &copy, &err), &err);
    assert_ht_ok(ht_hf_load_weights(path, &copy->params, &err), &err);
    copy->output_dtype = t->model->output_dtype; /* fsdp_config.mix_precision.output_dtype of the run */
    int32_t in[2 * 16], tg[2 * 16];
    for (int i = 0; i < 32; i++) in[i] = tg[i] = (int32_t)corpus[i];
    float l1, l2;
    assert_ht_ok(ht_model_forward(t->model, in, tg, 2, 16, &l1, &err), &err);
    assert_ht_ok(ht_model_forward(copy, in, tg, 2, 16, &l2, &err), &err);
    if (l1 != l2) fail_msg("trained model loss %.9g, reloaded final weights %.9g", l1, l2);
    ht_model_free(copy);
    trainer_delete(t);
    free(cfg);
}

/* The trainer on the fenced backend (kernels/fenced.c: the CPU's kernels on
 * memory the host cannot touch between entries) gives the CPU's run bit for
 * bit: every byte the layers touch goes through the table's entries, as on
 * a GPU. A host access would fault at the line that made it. Each variant
 * runs `steps` steps on either table; the losses, gradient norms and final
 * weights must be the same bits. */
typedef struct fenced_run {
    double loss[8], grad_norm[8];
    void *weights; /* every param's data, one after another */
    size_t bytes;
} fenced_run;

/* `steps` steps on K's table, or (steps 0, saving) ht_trainer_run's whole run. */
static void run_on(const ht_kernel_ops *K, const char *dir, const char *const *sets, int nsets, int steps,
                   fenced_run *out) {
    ht_config *cfg = malloc(sizeof(ht_config));
    tiny_config(cfg, dir);
    ht_error err;
    for (int i = 0; i < nsets; i++) assert_ht_ok(ht_config_set(cfg, sets[i], &err), &err);
    const char *backend = K == ht_kernels_fenced() ? "kernels.backend=fenced" : "kernels.backend=cpu";
    assert_ht_ok(ht_config_set(cfg, backend, &err), &err);
    ht_trainer *t = trainer_new(cfg);
    assert_ptr_equal(ht_kernels(), K);
    if (steps == 0) assert_ht_ok(ht_trainer_run(t, &err), &err);
    for (int s = 0; s < steps; s++) {
        ht_step_stats st;
        assert_ht_ok(ht_trainer_step(t, &st, &err), &err);
        out->loss[s] = st.loss, out->grad_norm[s] = st.grad_norm;
    }
    const ht_param_store *ps = &t->model->params;
    out->bytes = 0;
    for (int i = 0; i < ps->count; i++)
        out->bytes += (size_t)ht_param_local_numel(&ps->items[i]) * ht_dtype_size(ps->items[i].dtype);
    out->weights = malloc(out->bytes);
    char *at = out->weights;
    for (int i = 0; i < ps->count; i++) {
        size_t n = (size_t)ht_param_local_numel(&ps->items[i]) * ht_dtype_size(ps->items[i].dtype);
        ht_kernels()->download(at, ps->items[i].data, n);
        at += n;
    }
    trainer_delete(t);
    free(cfg);
    assert_ptr_equal(ht_kernels(), ht_kernels_cpu()); /* the trainer gave the table back */
}

static void same_run_on_both(const char *name, const char *const *sets, int nsets, int steps) {
    const char *dir = scratch_dir(name);
    write_corpus(dir);
    fenced_run cpu, fenced;
    run_on(ht_kernels_cpu(), dir, sets, nsets, steps, &cpu);
    run_on(ht_kernels_fenced(), dir, sets, nsets, steps, &fenced);
    for (int s = 0; s < steps; s++)
        if (memcmp(&cpu.loss[s], &fenced.loss[s], sizeof(double)) ||
            memcmp(&cpu.grad_norm[s], &fenced.grad_norm[s], sizeof(double)))
            fail_msg("%s, step %d: loss %.17g, grad norm %.17g on the fenced backend; %.17g, %.17g on the CPU", name,
                     s + 1, fenced.loss[s], fenced.grad_norm[s], cpu.loss[s], cpu.grad_norm[s]);
    assert_int_equal(cpu.bytes, fenced.bytes);
    if (memcmp(cpu.weights, fenced.weights, cpu.bytes)) fail_msg("%s: the final weights differ", name);
    printf("%s: %d steps on the fenced backend, the CPU's bits (loss %.6f -> %.6f)\n", name, steps, cpu.loss[0],
           cpu.loss[steps - 1]);
    free(cpu.weights), free(fenced.weights);
}

/* A checkpoint written on one table resumes on the other: bf16 with FP32
 * main params and Muon, saved after 2 steps (its optimizer state, main
 * params and loader position), then 2 more steps resumed, which must be the
 * bits of the CPU's own resume of its own checkpoint. */
static void test_checkpoints_between_the_cpu_and_the_fenced_backend(void **state) {
    (void)state;
    const char *dir = scratch_dir("fenced_ckpt");
    write_corpus(dir);
    char out[3][1200], from[3][1300];
    const ht_kernel_ops *writer[3] = {ht_kernels_cpu(), ht_kernels_cpu(), ht_kernels_fenced()};
    const ht_kernel_ops *reader[3] = {ht_kernels_cpu(), ht_kernels_fenced(), ht_kernels_cpu()};
    const char *label[3] = {"cpu -> cpu", "cpu -> fenced", "fenced -> cpu"};
    fenced_run runs[3];
    for (int i = 0; i < 3; i++) {
        snprintf(out[i], sizeof(out[i]), "checkpoint.output_dir=%s/saved%d", dir, i);
        const char *save[] = {"training.steps=2",          "checkpoint.save_interval=2",
                              "model_init_dtype=bfloat16", "fsdp_config.mix_precision.param_dtype=bfloat16",
                              "optimizer._target_=Muon",   out[i]};
        fenced_run saved;
        run_on(writer[i], dir, save, 6, 0, &saved);
        free(saved.weights);
        snprintf(from[i], sizeof(from[i]), "checkpoint.restore_from=%s/saved%d/step_00000002", dir, i);
        snprintf(out[i], sizeof(out[i]), "checkpoint.output_dir=%s/resumed%d", dir, i);
        const char *resume[] = {"training.steps=4",
                                "checkpoint.save_interval=0",
                                "model_init_dtype=bfloat16",
                                "fsdp_config.mix_precision.param_dtype=bfloat16",
                                "optimizer._target_=Muon",
                                out[i],
                                from[i]};
        run_on(reader[i], dir, resume, 7, 2, &runs[i]);
    }
    for (int i = 1; i < 3; i++) {
        for (int s = 0; s < 2; s++)
            if (memcmp(&runs[i].loss[s], &runs[0].loss[s], sizeof(double)))
                fail_msg("%s: resumed step %d's loss is %.17g, the CPU's own resume %.17g", label[i], s + 3,
                         runs[i].loss[s], runs[0].loss[s]);
        assert_int_equal(runs[i].bytes, runs[0].bytes);
        if (memcmp(runs[i].weights, runs[0].weights, runs[0].bytes))
            fail_msg("%s: the weights after the resumed steps differ", label[i]);
        printf("%s: resumed bit for bit (loss %.6f, %.6f)\n", label[i], runs[i].loss[0], runs[i].loss[1]);
    }
    for (int i = 0; i < 3; i++) free(runs[i].weights);
}

/* Whether two files hold the same bytes. */
static bool same_file(const char *a, const char *b) {
    FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
    bool same = fa && fb;
    while (same) {
        int ca = fgetc(fa), cb = fgetc(fb);
        same = ca == cb;
        if (ca == EOF) break;
    }
    if (fa) fclose(fa);
    if (fb) fclose(fb);
    return same;
}

/* The final folder written from the fenced table (LoRA merged into the
 * weights, the adapters alone in PEFT's layout) is the CPU's byte for
 * byte, and a run from those Hugging Face weights (model.from_pretrained)
 * gives the CPU's bits on either table. */
static void test_final_weights_and_pretrained_on_the_fenced_backend(void **state) {
    (void)state;
    const char *dir = scratch_dir("fenced_final");
    write_corpus(dir);
    const ht_kernel_ops *tables[2] = {ht_kernels_cpu(), ht_kernels_fenced()};
    char out[2][1200];
    for (int i = 0; i < 2; i++) {
        snprintf(out[i], sizeof(out[i]), "checkpoint.output_dir=%s/run%d", dir, i);
        const char *sets[] = {"training.steps=2",
                              "model_init_dtype=bfloat16",
                              "fsdp_config.mix_precision.param_dtype=bfloat16",
                              "model.lora.rank=4",
                              "model.lora.target_modules=[q_proj, down_proj]",
                              out[i]};
        fenced_run r;
        run_on(tables[i], dir, sets, 6, 0, &r);
        free(r.weights);
    }
    const char *files[] = {"final/model.safetensors", "final/adapter/adapter_model.safetensors", "final/config.json"};
    for (size_t f = 0; f < sizeof(files) / sizeof(files[0]); f++) {
        char a[1400], b[1400];
        snprintf(a, sizeof(a), "%s/run0/%s", dir, files[f]);
        snprintf(b, sizeof(b), "%s/run1/%s", dir, files[f]);
        if (!same_file(a, b)) fail_msg("%s differs between the CPU's run and the fenced backend's", files[f]);
    }
    char from[1300];
    snprintf(from, sizeof(from), "model.from_pretrained=%s/run0/final", dir);
    const char *pre[] = {"training.steps=2", "model_init_dtype=bfloat16",
                         "fsdp_config.mix_precision.param_dtype=bfloat16", from};
    same_run_on_both("fenced_from_pretrained", pre, 4, 2);
}

static void test_trainer_on_the_fenced_backend(void **state) {
    (void)state;
    const char *adamw[] = {"training.steps=3", "training.eval_interval=0", "training.dump_state=true"};
    same_run_on_both("fenced_adamw_f32", adamw, 3, 3);
    /* bf16 weights with their FP32 main params, Muon on the matrices (QK-clip on), AdamW on the rest */
    const char *muon[] = {"training.steps=3",
                          "model_init_dtype=bfloat16",
                          "fsdp_config.mix_precision.param_dtype=bfloat16",
                          "optimizer._target_=Muon",
                          "optimizer.muon_config.qk_clip_enabled=true",
                          "optimizer.muon_config.qk_clip_threshold=0.5",
                          "training.max_grad_norm=0.5"};
    same_run_on_both("fenced_muon_bf16", muon, 7, 3);
    /* fp16 with its loss scaler, the first step overflowing */
    const char *fp16[] = {"training.steps=3", "model_init_dtype=float16",
                          "fsdp_config.mix_precision.param_dtype=float16", "training.loss_scale_initial=1e30"};
    same_run_on_both("fenced_fp16", fp16, 4, 3);
    /* bf16 without main params (updates through FP32 blocks of the model's values), Muon without Nesterov,
     * QK-clip rescaling those values, an evaluation every step, the layers recomputed */
    const char *plain[] = {"training.steps=2",
                           "model_init_dtype=bfloat16",
                           "fsdp_config.mix_precision.param_dtype=bfloat16",
                           "optimizer.fp32_main_params=false",
                           "optimizer._target_=Muon",
                           "optimizer.muon_config.muon_nesterov=false",
                           "optimizer.muon_config.qk_clip_enabled=true",
                           "optimizer.muon_config.qk_clip_threshold=0.5",
                           "training.eval_interval=1",
                           "model.recompute=true"};
    same_run_on_both("fenced_no_main_params", plain, 10, 2);
    /* Qwen2-MoE: the router, the experts' ragged products, the shared expert, the load-balancing loss */
    const char *moe[] = {"training.steps=2",
                         "model.name=qwen2_moe",
                         "model.num_experts=4",
                         "model.num_experts_per_tok=2",
                         "model.moe_intermediate_size=16",
                         "model.shared_expert_intermediate_size=32",
                         "model.output_router_logits=true",
                         "optimizer._target_=Muon"};
    same_run_on_both("fenced_qwen2_moe", moe, 8, 2);
    /* DeepSeek-V3: Multi-Latent Attention, grouped routing with its bias and the bias update, shared experts */
    const char *dsv3[] = {"training.steps=2",
                          "model.name=deepseek_v3",
                          "model.n_routed_experts=4",
                          "model.num_experts_per_tok=2",
                          "model.n_group=2",
                          "model.topk_group=1",
                          "model.moe_intermediate_size=16",
                          "model.q_lora_rank=16",
                          "model.kv_lora_rank=16",
                          "model.qk_nope_head_dim=8",
                          "model.qk_rope_head_dim=8",
                          "model.v_head_dim=8",
                          "model.first_k_dense_replace=1",
                          "model.moe_router_bias_update_rate=0.001",
                          "model.attention_bias=false"};
    same_run_on_both("fenced_deepseek_v3", dsv3, 15, 2);
    /* LoRA adapters with dropout on the frozen base */
    const char *lora[] = {"training.steps=2", "model.lora.rank=4", "model.lora.alpha=8", "model.lora.dropout=0.1",
                          "model.lora.target_modules=[q_proj, v_proj, up_proj]"};
    same_run_on_both("fenced_lora", lora, 5, 2);
}

/* QK-clip in the trainer: with a threshold every head exceeds, each step
 * rescales all of them; with one none reaches, or when off, none. */
static int clipped_heads_after_one_step(const char *dir, const char *enabled, const char *threshold) {
    ht_config *cfg = malloc(sizeof(ht_config));
    tiny_config(cfg, dir);
    ht_error err;
    char set[128];
    assert_ht_ok(ht_config_set(cfg, "optimizer._target_=Muon", &err), &err);
    snprintf(set, sizeof(set), "optimizer.muon_config.qk_clip_enabled=%s", enabled);
    assert_ht_ok(ht_config_set(cfg, set, &err), &err);
    snprintf(set, sizeof(set), "optimizer.muon_config.qk_clip_threshold=%s", threshold);
    assert_ht_ok(ht_config_set(cfg, set, &err), &err);
    ht_trainer *t = trainer_new(cfg);
    ht_step_stats st;
    assert_ht_ok(ht_trainer_step(t, &st, &err), &err);
    trainer_delete(t);
    free(cfg);
    return st.qk_clipped_heads;
}

static void test_qk_clip_in_the_trainer(void **state) {
    (void)state;
    const char *dir = scratch_dir("train_qk_clip");
    write_corpus(dir);
    assert_int_equal(clipped_heads_after_one_step(dir, "true", "0.001"), 2 * 4); /* 2 layers x 4 heads */
    assert_int_equal(clipped_heads_after_one_step(dir, "true", "1.0e9"), 0);
    assert_int_equal(clipped_heads_after_one_step(dir, "false", "0.001"), 0);
}

/* The README's training command on its own config and corpus, cut to two
 * steps: the default config, the fortunes text and every output still work. */
/* Trains configs/<name> for 2 steps into dir/run; returns the log. */
static char *run_shipped_config(const char *name, const char *dir) {
    char args[4096], path[1300], *log;
    snprintf(args, sizeof(args),
             "train '%s/configs/%s' --set training.steps=2 --set training.eval_batches=1 "
             "--set checkpoint.output_dir='%s/run'",
             HT_SOURCE_DIR, name, dir);
    snprintf(path, sizeof(path), "%s/log.txt", dir);
    int rc = run_hypertrain(NULL, args, path, false, &log);
    if (rc != 0) fail_msg("configs/%s failed:\n%s", name, log);
    const char *outputs[] = {"final/config.json", "final/model.safetensors", "metrics.jsonl", "loss.svg", "latest"};
    for (size_t i = 0; i < sizeof(outputs) / sizeof(outputs[0]); i++) {
        snprintf(path, sizeof(path), "%s/run/%s", dir, outputs[i]);
        if (!path_exists(path)) fail_msg("configs/%s wrote no %s", name, path);
    }
    return log;
}

static void test_default_config_runs(void **state) {
    (void)state;
    free(run_shipped_config("default.yaml", scratch_dir("default_run")));
}

/* configs/qwen2_moe_tiny.yaml (the README's MoE run): the routers to AdamW,
 * the experts to Muon, and a Hugging Face export transformers reads: one
 * tensor per expert, config.json of a Qwen2MoeForCausalLM. */
static void test_moe_config_runs(void **state) {
    (void)state;
    const char *dir = scratch_dir("moe_run");
    char *log = run_shipped_config("qwen2_moe_tiny.yaml", dir);
    assert_non_null(strstr(log, "AdamW  model.layers.1.mlp.gate.weight"));
    assert_non_null(strstr(log, "Muon   model.layers.1.mlp.experts.gate_up_proj                  8x256x192"));
    free(log);
    char path[1300], *text;
    ht_error err;
    snprintf(path, sizeof(path), "%s/run/final/config.json", dir);
    text = read_text(path);
    assert_non_null(strstr(text, "\"Qwen2MoeForCausalLM\""));
    assert_non_null(strstr(text, "\"mlp_only_layers\": [0]"));
    free(text);
    ht_safetensors *st;
    snprintf(path, sizeof(path), "%s/run/final/model.safetensors", dir);
    assert_ht_ok(ht_safetensors_open(path, &st, &err), &err);
    assert_non_null(ht_safetensors_find(st, "model.layers.3.mlp.experts.7.down_proj.weight"));
    assert_null(ht_safetensors_find(st, "model.layers.0.mlp.experts.0.down_proj.weight")); /* dense */
    ht_safetensors_close(st);
}

/* ------------------------------------------------------------------ the command on bad input */

/* Runs `hypertrain train DIR/run.yaml extra`, the file written from cfg_text first unless that is NULL;
 * returns the exit status, and stderr, what the command says to its user, in `out` (cut to n - 1 bytes). */
static int run_cli(const char *dir, const char *cfg_text, const char *extra, char *out, size_t n) {
    char log_path[1200], args[8192], *log;
    snprintf(log_path, sizeof(log_path), "%s/stderr.txt", dir);
    if (cfg_text) write_run_yaml(dir, "%s", cfg_text);
    snprintf(args, sizeof(args), "train '%s/run.yaml' %s", dir, extra ? extra : "");
    int rc = run_hypertrain(NULL, args, log_path, true, &log);
    snprintf(out, n, "%s", log);
    free(log);
    return rc;
}

/* A scratch directory with the small corpus, and the data section that reads it (seq_len 16). */
static const char *tiny_data(const char *name, char *data, size_t n) {
    const char *dir = scratch_dir(name);
    write_corpus(dir);
    snprintf(data, n, "  dataset_type: text_bytes\n  path: %s/corpus.txt\n  seq_len: 16\n", dir);
    return dir;
}

/* The tiny model of the command-line tests: one layer. */
static const tiny_model one_layer = {.intermediate_size = 64, .num_hidden_layers = 1, .max_position_embeddings = 64};

/* run.yaml of a 2-step run of the one-layer model (`model_extra`: lines of its model section, from line 3) on
 * `data_lines`, writing into dir/out. */
static char *tiny_yaml(const char *dir, const char *data_lines, const char *model_extra) {
    static char buf[8192];
    snprintf(buf, sizeof(buf),
             "model:\n  name: qwen2\n%s%s"
             "model_init_dtype: float32\n"
             "data:\n%s"
             "optimizer:\n  _target_: AdamW\n"
             "training:\n  steps: 2\n  local_batch_size: 2\n  global_batch_size: 2\n"
             "checkpoint:\n  output_dir: %s/out\n",
             model_extra ? model_extra : "", tiny_model_yaml(one_layer), data_lines, dir);
    return buf;
}

static void expect_refused(const char *dir, const char *yaml, const char *extra, const char *needle1,
                           const char *needle2) {
    static char msg[1 << 17];
    char out[1200];
    int rc = run_cli(dir, yaml, extra, msg, sizeof(msg));
    if (rc == 0) fail_msg("hypertrain accepted bad input; stderr: %s", msg);
    if (!strstr(msg, needle1) || (needle2 && !strstr(msg, needle2)))
        fail_msg("the error does not name '%s'%s%s: %s", needle1, needle2 ? " and " : "", needle2 ? needle2 : "", msg);
    snprintf(out, sizeof(out), "%s/out", dir);
    if (path_exists(out)) fail_msg("hypertrain wrote %s although it refused the input", out);
}

/* What the log says of the FP32 main params, with and without them: the
 * optimizer's line, the memory line and tools.memory_profile's table count
 * the copies a bf16 run keeps, and none (0.0 MiB) with fp32_main_params false. */
static void test_memory_log_with_and_without_main_params(void **state) {
    (void)state;
    static char msg[1 << 17];
    char data[2048];
    const char *dir = tiny_data("train_main_log", data, sizeof(data));
    const char *bf16 = "--set model_init_dtype=bfloat16 --set fsdp_config.mix_precision.param_dtype=bfloat16 "
                       "--set optimizer._target_=Muon --set tools.memory_profile.enable=true";
    char run[1024];
    snprintf(run, sizeof(run), "%s --set optimizer.fp32_main_params=true", bf16);
    int rc = run_cli(dir, tiny_yaml(dir, data, NULL), run, msg, sizeof(msg));
    if (rc != 0) fail_msg("the run with main params failed: %s", msg);
    if (!strstr(msg, "FP32 main params: on; 15 low-precision params with their own FP32 copy (0.1 MiB)") ||
        !strstr(msg, "FP32 main params 0.1, main_grad 0.1") || !strstr(msg, "Memory rank 0:   FP32 main params   "))
        fail_msg("the main params' log lines: %s", msg);
    snprintf(run, sizeof(run), "%s --set optimizer.fp32_main_params=false --set checkpoint.output_dir=%s/out_off", bf16,
             dir);
    rc = run_cli(dir, NULL, run, msg, sizeof(msg));
    if (rc != 0) fail_msg("the run without main params failed: %s", msg);
    if (!strstr(msg, "FP32 main params: off (optimizer.fp32_main_params false): no FP32 copies (0.0 MiB); 15 "
                     "low-precision params updated in their own dtype") ||
        !strstr(msg, "FP32 main params 0.0, main_grad 0.1") ||
        !strstr(msg, "Memory rank 0:   FP32 main params (off: no copies)         0.0    0.0%"))
        fail_msg("the log lines without main params: %s", msg);
}

/* A trace file against Chrome's trace-event format, parsed with the
 * project's JSON reader: {"traceEvents": [...]}, every event a "ph" of "X"
 * (a span: "name", "cat", "ts", "dur" >= 0, "pid" = rank, "tid", "args") or
 * "M" (metadata); each track's spans in time order, each one inside the span
 * enclosing it where they overlap. Counts the spans whose name starts with
 * each of `names` into counts[], and those with "bytes" in *with_bytes. */
static void check_trace(const char *path, int rank, const char *const *names, int *counts, int n, int *with_bytes) {
    char *text = read_text(path);
    ht_json *root;
    ht_error err;
    assert_ht_ok(ht_json_parse(text, strlen(text), path, &root, &err), &err);
    free(text);
    const ht_json *events = ht_json_get(root, "traceEvents");
    assert_non_null(events);
    assert_int_equal(events->type, HT_JSON_ARRAY);
    double open_end[16][64], last_ts[16]; /* each track's spans still open at the last start, innermost last */
    int open[16] = {0};
    for (int k = 0; k < 16; k++) last_ts[k] = -1;
    memset(counts, 0, (size_t)n * sizeof(int));
    *with_bytes = 0;
    for (size_t i = 0; i < events->count; i++) {
        const ht_json *e = &events->items[i], *ph = ht_json_get(e, "ph"), *name = ht_json_get(e, "name"),
                      *pid = ht_json_get(e, "pid"), *tid = ht_json_get(e, "tid"), *args = ht_json_get(e, "args");
        assert_true(ph && ph->type == HT_JSON_STRING && name && name->type == HT_JSON_STRING);
        assert_true(pid && pid->type == HT_JSON_NUMBER && pid->number == rank);
        assert_true(tid && tid->type == HT_JSON_NUMBER && tid->number >= 0 && tid->number < 16);
        assert_true(args && args->type == HT_JSON_OBJECT);
        if (strcmp(ph->string, "M") == 0) continue;
        assert_string_equal(ph->string, "X");
        const ht_json *ts = ht_json_get(e, "ts"), *dur = ht_json_get(e, "dur"), *cat = ht_json_get(e, "cat");
        assert_true(ts && ts->type == HT_JSON_NUMBER && dur && dur->type == HT_JSON_NUMBER && dur->number >= 0);
        assert_true(cat && cat->type == HT_JSON_STRING);
        const int k = (int)tid->number;
        if (ts->number < last_ts[k])
            fail_msg("%s: %s at %.3f before the span before it (%.3f)", path, name->string, ts->number, last_ts[k]);
        last_ts[k] = ts->number;
        const double end = ts->number + dur->number, slack = 0.002; /* the microseconds' last printed digit */
        while (open[k] > 0 && open_end[k][open[k] - 1] <= ts->number + slack) open[k]--;
        if (open[k] > 0 && end > open_end[k][open[k] - 1] + slack)
            fail_msg("%s: %s (%.3f to %.3f) overlaps the end of the span it starts in (%.3f)", path, name->string,
                     ts->number, end, open_end[k][open[k] - 1]);
        assert_true(open[k] < 64);
        open_end[k][open[k]++] = end;
        for (int j = 0; j < n; j++) counts[j] += strncmp(name->string, names[j], strlen(names[j])) == 0;
        const ht_json *bytes = ht_json_get(args, "bytes");
        *with_bytes += bytes && bytes->type == HT_JSON_NUMBER && bytes->number > 0;
    }
    ht_json_free(root);
}

/* training.trace on the steps it names: each rank's trace_rank{r}.json holds
 * the phases of those steps (and the checkpoint and evaluation after one),
 * each kernel entry (the profiled table), and on 2 ranks each FSDP unit's
 * all-gather and reduce-scatter on their tracks and the collectives, with
 * their bytes; the steps not named are not in it. With tensorboard on, only
 * rank 0 writes an event file. */
static void test_trace_of_named_steps(void **state) {
    (void)state;
    char data[2048], msg[1 << 16], path[1400];
    const char *dir = tiny_data("train_trace", data, sizeof(data));
    const char *yaml = tiny_yaml(dir, data, NULL);
    const char *names[] = {"step",
                           "forward",
                           "backward",
                           "gradient sync",
                           "optimizer",
                           "checkpoint",
                           "evaluation",
                           "gemm",
                           "all-gather model.layers.0",
                           "reduce-scatter model.layers.0",
                           "all_reduce_f64"};
    const int n = sizeof(names) / sizeof(names[0]);
    int counts[16], with_bytes;
    int rc = run_cli(dir, yaml,
                     "--set training.steps=3 --set 'training.trace=[2]' --set checkpoint.save_interval=2 "
                     "--set training.eval_interval=2",
                     msg, sizeof(msg));
    if (rc != 0) fail_msg("the traced run failed: %s", msg);
    snprintf(path, sizeof(path), "%s/out/trace_rank0.json", dir);
    check_trace(path, 0, names, counts, n, &with_bytes);
    const int one_rank[] = {1, 1, 1, 1, 1, 1, 1, -1, 0, 0, 0}; /* -1: some */
    for (int j = 0; j < n; j++)
        if (one_rank[j] >= 0 ? counts[j] != one_rank[j] : counts[j] == 0)
            fail_msg("%d spans named %s in %s", counts[j], names[j], path);

    snprintf(path, sizeof(path), "rm -rf '%s/out'", dir);
    assert_int_equal(system(path), 0);
    char args[2048], log_path[1300], *log;
    snprintf(args, sizeof(args),
             "train '%s/run.yaml' --set training.steps=2 --set training.global_batch_size=4 "
             "--set 'training.trace=true' --set training.tensorboard=true",
             dir);
    snprintf(log_path, sizeof(log_path), "%s/mpirun.txt", dir);
    rc = run_hypertrain(MPIRUN "-np 2 ", args, log_path, false, &log);
    if (rc != 0) fail_msg("the 2-rank traced run failed: %s", log);
    free(log);
    for (int r = 0; r < 2; r++) {
        snprintf(path, sizeof(path), "%s/out/trace_rank%d.json", dir, r);
        check_trace(path, r, names, counts, n, &with_bytes);
        const int two_ranks[] = {2, 2, 2, 2, 2, 0, 0, -1, -1, -1, -1};
        for (int j = 0; j < n; j++)
            if (two_ranks[j] >= 0 ? counts[j] != two_ranks[j] : counts[j] == 0)
                fail_msg("%d spans named %s in %s", counts[j], names[j], path);
        assert_true(with_bytes >= counts[8] + counts[9] + counts[10]);
    }
    glob_t g;
    snprintf(path, sizeof(path), "%s/out/tensorboard/events.out.tfevents.*", dir);
    assert_int_equal(glob(path, 0, NULL, &g), 0);
    assert_int_equal(g.gl_pathc, 1);
    globfree(&g);
}

/* An fp16 run whose first steps overflow (an absurd initial loss scale):
 * the skipped steps' grad_norm is null, not "-nan", so metrics.jsonl stays
 * JSON and the plot is drawn; a resume keeps those lines. A line in the middle
 * of metrics.jsonl that is not JSON stops a resume, naming it; a last line
 * cut by a kill is dropped with a warning. */
static void test_fp16_metrics_and_their_resume(void **state) {
    (void)state;
    char data[2048], msg[1 << 16], path[1400];
    const char *dir = tiny_data("train_fp16_metrics", data, sizeof(data));
    const char *yaml = tiny_yaml(dir, data, NULL);
    const char *fp16 = "--set model_init_dtype=float16 --set fsdp_config.mix_precision.param_dtype=float16 "
                       "--set training.loss_scale_initial=1e30 --set checkpoint.save_interval=1";
    int rc = run_cli(dir, yaml, fp16, msg, sizeof(msg));
    if (rc != 0) fail_msg("the fp16 run failed: %s", msg);
    assert_non_null(strstr(msg, "skipped: gradient overflow"));
    snprintf(path, sizeof(path), "%s/out/metrics.jsonl", dir);
    char *text = read_text(path);
    assert_non_null(strstr(text, "\"grad_norm\": null"));
    assert_null(strstr(text, "nan"));
    free(text);
    snprintf(path, sizeof(path), "%s/out/loss.svg", dir);
    assert_true(path_exists(path));

    /* Resume to step 3: steps 1 and 2 stay. Then a broken middle line refuses, a cut last line warns. */
    char resume[1200];
    snprintf(resume, sizeof(resume), "%s --set training.steps=3 --set checkpoint.restore_from=latest", fp16);
    rc = run_cli(dir, NULL, resume, msg, sizeof(msg));
    if (rc != 0) fail_msg("the resume failed: %s", msg);
    snprintf(path, sizeof(path), "%s/out/metrics.jsonl", dir);
    text = read_text(path);
    size_t len = strlen(text);
    assert_non_null(strstr(text, "{\"step\": 2, \"loss\""));
    assert_non_null(strstr(text, "{\"step\": 3, \"loss\""));
    char *broken = malloc(len + 64);
    char *second = strchr(text, '\n') + 1;
    snprintf(broken, len + 64, "%.*s{not json\n%s", (int)(second - text), text, second);
    write_file(path, broken, strlen(broken));
    snprintf(resume, sizeof(resume), "%s --set training.steps=4 --set checkpoint.restore_from=latest", fp16);
    rc = run_cli(dir, NULL, resume, msg, sizeof(msg));
    assert_int_equal(rc, 1);
    assert_non_null(strstr(msg, "metrics.jsonl: line 2 is not a JSON object"));
    snprintf(broken, len + 64, "%s{\"step\": 3, \"lo", text);
    write_file(path, broken, strlen(broken));
    rc = run_cli(dir, NULL, resume, msg, sizeof(msg));
    if (rc != 0) fail_msg("the resume after a cut last line failed: %s", msg);
    assert_non_null(strstr(msg, "was cut short"));
    free(broken);
    free(text);
}

static void test_cli_bad_input(void **state) {
    (void)state;
    const char *dir = scratch_dir("cli_bad");
    write_corpus(dir);
    char data[2048], model[2048], args[1500], path[1400], cmd[8192];

    /* A missing config file. */
    snprintf(args, sizeof(args), "train '%s/nowhere.yaml'", dir);
    snprintf(path, sizeof(path), "%s/nowhere.txt", dir);
    assert_int_not_equal(run_hypertrain(NULL, args, path, false, NULL), 0);

    /* A directory where the config file should be: a sentence, exit 1, no huge allocation. */
    ht_error err;
    snprintf(path, sizeof(path), "%s/dir.yaml", dir);
    assert_ht_ok(ht_make_dirs(path, &err), &err);
    snprintf(args, sizeof(args), "train '%s'", path);
    snprintf(path, sizeof(path), "%s/dir.txt", dir);
    char *said;
    assert_int_equal(run_hypertrain(NULL, args, path, false, &said), 1);
    assert_non_null(strstr(said, "dir.yaml: expected a file, found a directory"));
    free(said);

    /* kernels.backend: cuda where this build or machine has none (several ranks on the fenced backend: test_dist). */
    snprintf(data, sizeof(data), "  dataset_type: text_bytes\n  path: %s/corpus.txt\n  seq_len: 16\n", dir);
    if (!ht_kernels_cuda(&err))
        expect_refused(dir, tiny_yaml(dir, data, NULL), "--set kernels.backend=cuda",
                       "kernels.backend: cuda: ", "expected cpu on this machine");

    /* Qwen2-MoE's keys on a dense model, experts per token beyond the experts, expert parallelism on one rank. */
    snprintf(data, sizeof(data), "  dataset_type: text_bytes\n  path: %s/corpus.txt\n  seq_len: 16\n", dir);
    expect_refused(dir, tiny_yaml(dir, data, "  num_experts_per_tok: 2\n"), NULL,
                   "run.yaml:3: model.num_experts_per_tok", "applies to model.name qwen2_moe");
    expect_refused(dir, tiny_yaml(dir, data, "  mlp_only_layers: [a]\n"), NULL, "model.mlp_only_layers",
                   "layer indices");
    expect_refused(dir, tiny_yaml(dir, data, NULL), "--set model.name=qwen2_moe --set model.num_experts=3",
                   "model.num_experts_per_tok must be between 1 and model.num_experts (3)", NULL);
    expect_refused(dir, tiny_yaml(dir, data, NULL),
                   "--set model.name=qwen2_moe --set model.num_experts=4 --set model.num_experts_per_tok=2 "
                   "--set parallel.expert_parallel_size=2",
                   "parallel.expert_parallel_size (--set): 2 does not divide the 1 ranks", NULL);
    expect_refused(dir, tiny_yaml(dir, data, NULL),
                   "--set parallel.expert_parallel_size=1 --set model.lora.rank=2 "
                   "--set model.name=qwen2_moe --set model.num_experts=4 --set model.num_experts_per_tok=2 "
                   "--set model.lora.target_modules=[up_proj]",
                   "\"up_proj\" selects model.layers.0.mlp.up_proj, but layer 0 is sparse", "adapters on experts");

    /* A data path that does not exist. */
    snprintf(data, sizeof(data), "  dataset_type: text_bytes\n  path: %s/missing.txt\n  seq_len: 16\n", dir);
    expect_refused(dir, tiny_yaml(dir, data, NULL), NULL, "missing.txt", NULL);

    /* A sequence longer than max_position_embeddings. */
    snprintf(data, sizeof(data), "  dataset_type: text_bytes\n  path: %s/corpus.txt\n  seq_len: 65\n", dir);
    expect_refused(dir, tiny_yaml(dir, data, NULL), NULL, "max_position_embeddings", NULL);

    /* A token shard with a token id >= the vocabulary. */
    int32_t header[256] = {20240520, 1, 200};
    uint16_t tokens[200];
    for (int i = 0; i < 200; i++) tokens[i] = (uint16_t)(i % 50);
    tokens[150] = 300;
    snprintf(path, sizeof(path), "%s/shard.bin", dir);
    FILE *f = fopen(path, "wb");
    fwrite(header, 4, 256, f);
    fwrite(tokens, 2, 200, f);
    fclose(f);
    snprintf(data, sizeof(data), "  dataset_type: token_bin\n  path: %s\n  seq_len: 16\n", path);
    expect_refused(dir, tiny_yaml(dir, data, NULL), NULL, "shard.bin", "300");

    /* A truncated token shard. */
    f = fopen(path, "wb");
    fwrite(header, 4, 256, f);
    fwrite(tokens, 2, 100, f);
    fclose(f);
    expect_refused(dir, tiny_yaml(dir, data, NULL), NULL, "shard.bin", NULL);

    /* Weights: a missing folder, a truncated safetensors file, shapes that disagree with config.json. */
    snprintf(data, sizeof(data), "  dataset_type: text_bytes\n  path: %s/corpus.txt\n  seq_len: 16\n", dir);
    snprintf(model, sizeof(model), "  from_pretrained: %s/no_such_model\n", dir);
    expect_refused(dir, tiny_yaml(dir, data, model), NULL, "no_such_model", NULL);

    const char *fixture = fixture_path("model/qwen2_untied");
    char copy[1400];
    snprintf(copy, sizeof(copy), "%s/model_copy", dir);
    snprintf(cmd, sizeof(cmd), "rm -rf '%s' && cp -r '%s' '%s' && truncate -s -100 '%s/model.safetensors'", copy,
             fixture, copy, copy);
    assert_int_equal(system(cmd), 0);
    snprintf(model, sizeof(model), "  from_pretrained: %s\n", copy);
    /* A corpus this model's 100 tokens hold (digits and spaces), so that the weights are what is wrong. */
    char digits[1400], fits[2048];
    snprintf(digits, sizeof(digits), "%s/digits.txt", dir);
    write_repeated(digits, "0123 4567 89 ", 400);
    snprintf(fits, sizeof(fits), "  dataset_type: text_bytes\n  path: %s\n  seq_len: 16\n", digits);
    expect_refused(dir, tiny_yaml(dir, fits, model), NULL, "model.safetensors", NULL);

    snprintf(cmd, sizeof(cmd),
             "rm -rf '%s' && cp -r '%s' '%s' && sed -i 's/\"intermediate_size\": [0-9]*/\"intermediate_size\": 96/' "
             "'%s/config.json'",
             copy, fixture, copy, copy);
    assert_int_equal(system(cmd), 0);
    expect_refused(dir, tiny_yaml(dir, fits, model), NULL, "mlp", "shape");

    /* Architecture numbers that used to be taken silently. */
    expect_refused(dir, tiny_yaml(dir, data, "  head_dim: -2\n"), NULL, "model.head_dim must be >= 0", "-2");
    expect_refused(dir, tiny_yaml(dir, data, "  initializer_range: 0\n"), NULL, "model.initializer_range", "found 0");
    expect_refused(dir, tiny_yaml(dir, data, "  initializer_range: -0.5\n"), NULL, "model.initializer_range", "-0.5");
    /* model.recompute: a plan naming no module (MindSpeed-MM's VLM spelling), and a module that cannot recompute. */
    expect_refused(dir,
                   tiny_yaml(dir, data,
                             "  recompute: true\n  recompute_plan:\n    apply_modules: "
                             "[\"model.language_model.layers.{*}\"]\n"),
                   NULL, "matches no module of this model", "model.layers.{0..0}");
    expect_refused(dir, tiny_yaml(dir, data, "  recompute: true\n  recompute_plan:\n    apply_modules: [model.norm]\n"),
                   NULL, "selects model.norm", "not supported");
    /* model.freeze: a pattern that covers nothing (a typo would train everything), and a freeze of everything. */
    expect_refused(dir, tiny_yaml(dir, data, "  freeze: [model.norm, \"model.layer.{*}\"]\n"), NULL,
                   "\"model.layer.{*}\" covers no parameter", "model.layers.{*}.self_attn");
    expect_refused(dir, tiny_yaml(dir, data, "  freeze: [model, lm_head]\n"), NULL, "model.freeze freezes all",
                   "nothing is left to train");

    /* model.lora: a target matching no linear layer, the LM head, an adapter of another rank, QK-clip on frozen q/k. */
    expect_refused(dir, tiny_yaml(dir, data, "  lora:\n    r: 4\n    target_modules: [q_proj, q_prj]\n"), NULL,
                   "\"q_prj\" matches no linear layer", "model.layers.{0..0}.mlp.{gate_proj, up_proj, down_proj}");
    expect_refused(dir, tiny_yaml(dir, data, "  lora:\n    r: 4\n    target_modules: [lm_head]\n"), NULL,
                   "\"lm_head\" selects lm_head: not supported", NULL);
    snprintf(model, sizeof(model), "  from_pretrained: %s\n  lora:\n    r: 8\n    from_pretrained: %s\n",
             fixture_path("lora/qwen2_tied_qv/base"), fixture_path("lora/qwen2_tied_qv/adapter"));
    expect_refused(dir, tiny_yaml(dir, fits, model), NULL, "model.lora.rank is 8 but",
                   "qwen2_tied_qv/adapter/adapter_config.json has r 4");
    expect_refused(dir, tiny_yaml(dir, data, "  lora:\n    r: 4\n"),
                   "--set optimizer._target_=Muon --set optimizer.muon_config.qk_clip_enabled=true",
                   "qk_clip_enabled: layer 0's query/key projection weights are frozen",
                   "model.lora trains the adapters alone");

    /* A config error is reported with its line before anything runs. */
    expect_refused(dir, "training:\n  steps: ten\n", NULL, "training.steps", "run.yaml:2");
}

/* ------------------------------------------------------------------ LoRA */

/* LoRA fine-tuning through the command line: the Qwen2 fixture with
 * adapters on q_proj, v_proj and down_proj (dropout 0.1) learns the text;
 * final/ holds the merged weights, the untargeted ones bit for bit the
 * base's, and final/adapter/ the adapters, which on the base compute what
 * final/ computes; `hypertrain export` of the last checkpoint gives the same
 * merged weights, and with --adapter the same adapters. */
static void test_lora_fine_tune(void **state) {
    (void)state;
    const char *dir = scratch_dir("train_lora");
    char path[1400], yaml[4096], msg[1 << 16], args[4096];
    /* bytes below the fixture's vocabulary of 100 */
    harness_write_corpus(dir, "IT WAS THE BEST OF TIMES, IT WAS THE WORST OF TIMES, IT WAS THE AGE OF WISDOM.\n", 60);
    snprintf(path, sizeof(path), "%s/corpus.txt", dir);
    const char *base = fixture_path("lora/qwen2_tied_qv/base");
    snprintf(yaml, sizeof(yaml),
             "model:\n  from_pretrained: %s\n  lora:\n    r: 8\n    lora_alpha: 16\n    lora_dropout: 0.1\n"
             "    target_modules: [q_proj, v_proj, down_proj]\n"
             "model_init_dtype: float32\n"
             "data:\n  dataset_type: text_bytes\n  path: %s\n  seq_len: 16\n  valid_fraction: 0.1\n"
             "optimizer:\n  adamw_config:\n    adamw_lr: 0.01\n"
             "lr_scheduler:\n  type: ConstantWarmUpLR\n"
             "training:\n  steps: 30\n  local_batch_size: 4\n  global_batch_size: 8\n  eval_interval: 0\n"
             "  eval_batches: 4\n"
             "fsdp_config:\n  mix_precision:\n    param_dtype: float32\n"
             "checkpoint:\n  output_dir: %s/out\n  save_interval: 15\n",
             base, path, dir);
    int rc = run_cli(dir, yaml, NULL, msg, sizeof(msg));
    if (rc != 0) fail_msg("the LoRA run failed: %s", msg);
    assert_non_null(strstr(msg, "model.lora: rank 8, alpha 16 (scale 2), dropout 0.1"));
    assert_non_null(strstr(msg, "12 adapters on 6 linear layers"));
    assert_non_null(strstr(msg, "model.lora: the adapters go to AdamW"));
    assert_non_null(strstr(msg, "Parameter routing: 0 parameters (0.00M values) to Muon"));
    const char *v = strstr(msg, "validation loss: ");
    assert_non_null(v);
    double before = strtod(v + 17, NULL), after = strtod(strstr(v, "before training, ") + 17, NULL);
    printf("LoRA fine-tuning: validation loss %.4f -> %.4f\n", before, after);
    assert_true(after < before - 0.5);

    /* final/: the base's tensors, the untargeted ones unchanged, the 6 targeted ones merged. */
    char final_st[1400], base_st[1400], which[4096];
    snprintf(final_st, sizeof(final_st), "%s/out/final/model.safetensors", dir);
    snprintf(base_st, sizeof(base_st), "%s/model.safetensors", base);
    assert_int_equal(tensors_differing(base_st, final_st, "", NULL, which, sizeof(which)), 6);
    for (int l = 0; l < 2; l++)
        for (int k = 0; k < 3; k++) {
            static const char *const mods[] = {"self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"};
            char name[128];
            snprintf(name, sizeof(name), "model.layers.%d.%s.weight", l, mods[k]);
            if (!strstr(which, name)) fail_msg("%s was not merged (differing: %s)", name, which);
        }

    /* base + final/adapter (the engine's PEFT reader) computes what final/ does. */
    ht_model_config cfg;
    ht_error err;
    char adapter[1400], final_dir[1400];
    snprintf(adapter, sizeof(adapter), "%s/out/final/adapter", dir);
    snprintf(final_dir, sizeof(final_dir), "%s/out/final", dir);
    ht_model *lora, *merged;
    assert_ht_ok(ht_hf_read_config(base, &cfg, &err), &err);
    assert_ht_ok(ht_peft_read_config(adapter, &cfg.lora, &err), &err);
    assert_int_equal(cfg.lora.rank, 8);
    assert_true(cfg.lora.alpha == 16 && cfg.lora.dropout == 0.1);
    assert_int_equal(cfg.lora.target_count, 3);
    assert_ht_ok(ht_model_build(&cfg, HT_DTYPE_F32, 1, &lora, &err), &err);
    assert_ht_ok(ht_hf_load_weights(base, &lora->params, &err), &err);
    assert_ht_ok(ht_peft_load_adapter(adapter, &cfg.lora, &lora->params, &err), &err);
    assert_ht_ok(ht_hf_read_config(final_dir, &cfg, &err), &err);
    assert_ht_ok(ht_model_build(&cfg, HT_DTYPE_F32, 1, &merged, &err), &err);
    assert_ht_ok(ht_hf_load_weights(final_dir, &merged->params, &err), &err);
    int32_t in[2 * 16], tg[2 * 16];
    for (int i = 0; i < 32; i++) in[i] = tg[i] = (int32_t) "IT WAS THE BEST OF TIMES, IT WAS THE WORST"[i];
    float l1, l2;
    assert_ht_ok(ht_model_forward(lora, in, tg, 2, 16, &l1, &err), &err);
    assert_ht_ok(ht_model_forward(merged, in, tg, 2, 16, &l2, &err), &err);
    double e = rel_max_err(lora->logits, merged->logits, (size_t)32 * 100);
    printf("base + final/adapter vs final/: logits within %.2g, loss %.7f vs %.7f\n", e, l1, l2);
    assert_true(e <= 1e-5);
    ht_model_free(lora);
    ht_model_free(merged);

    /* export of the last checkpoint: merged, and --adapter. */
    char log[1400];
    snprintf(log, sizeof(log), "%s/export.txt", dir);
    snprintf(args, sizeof(args), "export '%s/out/step_00000030' '%s/exported'", dir, dir);
    assert_int_equal(run_hypertrain(NULL, args, log, false, NULL), 0);
    snprintf(path, sizeof(path), "%s/exported/model.safetensors", dir);
    assert_same_tensors(final_st, path);
    snprintf(args, sizeof(args), "export '%s/out/step_00000030' '%s/exported_adapter' --adapter", dir, dir);
    assert_int_equal(run_hypertrain(NULL, args, log, false, NULL), 0);
    char a1[1500], a2[1500];
    snprintf(a1, sizeof(a1), "%s/adapter_model.safetensors", adapter);
    snprintf(a2, sizeof(a2), "%s/exported_adapter/adapter_model.safetensors", dir);
    assert_same_tensors(a1, a2);
    snprintf(a1, sizeof(a1), "%s/adapter_config.json", adapter);
    snprintf(a2, sizeof(a2), "%s/exported_adapter/adapter_config.json", dir);
    char *c1 = read_text(a1), *c2 = read_text(a2);
    assert_string_equal(c1, c2);
    assert_non_null(strstr(c1, "\"base_model_name_or_path\": \""));
    free(c1);
    free(c2);
    /* --adapter of a run without adapters is refused; so is --max-shard-mb with it. */
    snprintf(args, sizeof(args), "export '%s/out/step_00000030' '%s/x' --adapter --max-shard-mb 1", dir, dir);
    assert_int_not_equal(run_hypertrain(NULL, args, log, false, NULL), 0);
}

/* Optimizer state is never zeroed or dropped silently on a resume: a
 * checkpoint saved without it, or with another Muon/AdamW routing, is
 * refused, naming the tensors, unless checkpoint.restore_optimizer is false. */
static void test_resume_refuses_lost_optimizer_state(void **state) {
    (void)state;
    char data[2048], msg[1 << 16];
    const char *dir = tiny_data("train_strict_resume", data, sizeof(data));
    const char *yaml = tiny_yaml(dir, data, NULL);
    const char *muon = "--set optimizer._target_=Muon --set checkpoint.save_interval=1";
    char run[1200];
    snprintf(run, sizeof(run), "%s --set checkpoint.save_optimizer=false", muon);
    int rc = run_cli(dir, yaml, run, msg, sizeof(msg));
    if (rc != 0) fail_msg("the run without optimizer state failed: %s", msg);
    snprintf(run, sizeof(run), "%s --set training.steps=3 --set checkpoint.restore_from=latest", muon);
    rc = run_cli(dir, NULL, run, msg, sizeof(msg));
    assert_int_equal(rc, 1);
    if (!strstr(msg, "the optimizer had taken 2 steps, but 38 of the state tensors this run needs are missing") ||
        !strstr(msg, "optimizer.state.model.layers.0.self_attn.q_proj.weight.momentum_buffer") ||
        !strstr(msg, "set checkpoint.restore_optimizer false to load the model alone"))
        fail_msg("unexpected refusal: %s", msg);
    /* The model alone restarts the step count: in the same output_dir that replaces the run there, so only
     * with checkpoint.overwrite. */
    snprintf(run, sizeof(run),
             "%s --set training.steps=3 --set checkpoint.restore_from=latest "
             "--set checkpoint.restore_optimizer=false",
             muon);
    rc = run_cli(dir, NULL, run, msg, sizeof(msg));
    assert_int_equal(rc, 1);
    if (!strstr(msg, "holds another run (step_00000002 and metrics.jsonl) and this one starts from step 0"))
        fail_msg("unexpected refusal: %s", msg);
    snprintf(run, sizeof(run),
             "%s --set training.steps=3 --set checkpoint.restore_from=latest "
             "--set checkpoint.restore_optimizer=false --set checkpoint.overwrite=true",
             muon);
    rc = run_cli(dir, NULL, run, msg, sizeof(msg));
    if (rc != 0) fail_msg("restore_optimizer false failed: %s", msg);
    assert_non_null(strstr(msg, "checkpoint.overwrite: this run replaces the one in"));

    /* Saved with state; resumed with another lr and betas: each difference named, the config's value used. */
    snprintf(run, sizeof(run), "%s --set checkpoint.output_dir=%s/out3", muon, dir);
    if (run_cli(dir, NULL, run, msg, sizeof(msg)) != 0) fail_msg("the run to resume failed: %s", msg);
    snprintf(run, sizeof(run),
             "%s --set checkpoint.output_dir=%s/out3 --set training.steps=3 --set checkpoint.restore_from=latest "
             "--set optimizer.adamw_config.adamw_lr=0.0005 --set 'optimizer.adamw_config.adamw_betas=[0.9, 0.95]'",
             muon, dir);
    if (run_cli(dir, NULL, run, msg, sizeof(msg)) != 0) fail_msg("the resume failed: %s", msg);
    if (!strstr(msg, "resume: optimizer.adamw_config.adamw_lr was 0.001 in ") ||
        !strstr(msg, "this run uses 0.0005 (the config's value wins)") ||
        !strstr(msg, "resume: optimizer.adamw_config.adamw_betas was [0.9, 0.999]") ||
        !strstr(msg, "resume: 2 optimizer settings changed since the checkpoint"))
        fail_msg("the changed settings are not named: %s", msg);

    /* Saved with state; resumed with q_proj moved from Muon to AdamW. */
    snprintf(run, sizeof(run), "%s --set checkpoint.output_dir=%s/out2", muon, dir);
    rc = run_cli(dir, NULL, run, msg, sizeof(msg));
    if (rc != 0) fail_msg("the run with optimizer state failed: %s", msg);
    snprintf(run, sizeof(run),
             "%s --set checkpoint.output_dir=%s/out2 --set training.steps=3 --set checkpoint.restore_from=latest "
             "--set 'optimizer.muon_config.adamw_include=[\"*embed*\", \"*lm_head*\", \"*q_proj.weight\"]'",
             muon, dir);
    rc = run_cli(dir, NULL, run, msg, sizeof(msg));
    assert_int_equal(rc, 1);
    if (!strstr(msg, "optimizer.state.model.layers.0.self_attn.q_proj.weight.exp_avg") ||
        !strstr(msg, "another optimizer or routing"))
        fail_msg("unexpected refusal: %s", msg);
}

/* A run continued from another directory's checkpoint starts a new lineage in
 * output_dir: the checkpoints and metrics already there are another run's and
 * are refused, named, unless checkpoint.overwrite; an empty output_dir takes it. */
static void test_resume_from_elsewhere_keeps_the_run_there(void **state) {
    (void)state;
    char data[2048], msg[1 << 16], run[2400];
    const char *dir = tiny_data("train_lineage", data, sizeof(data));
    const char *yaml = tiny_yaml(dir, data, NULL);
    for (int i = 0; i < 2; i++) { /* runs a and b, 2 steps each */
        snprintf(run, sizeof(run), "--set checkpoint.save_interval=1 --set checkpoint.output_dir=%s/%s", dir,
                 i ? "b" : "a");
        int rc = run_cli(dir, i ? NULL : yaml, run, msg, sizeof(msg));
        if (rc != 0) fail_msg("run %d failed: %s", i, msg);
    }
    char b_metrics[1200];
    snprintf(b_metrics, sizeof(b_metrics), "%s/b/metrics.jsonl", dir);
    char *before = read_text(b_metrics);
    snprintf(run, sizeof(run),
             "--set training.steps=3 --set checkpoint.output_dir=%s/b --set checkpoint.restore_from=%s/a/step_00000002",
             dir, dir);
    assert_int_equal(run_cli(dir, NULL, run, msg, sizeof(msg)), 1);
    if (!strstr(msg, "holds another run (step_00000002 and metrics.jsonl) and this one continues") ||
        !strstr(msg, "a/step_00000002, a checkpoint of another directory") || !strstr(msg, "checkpoint.overwrite"))
        fail_msg("unexpected refusal: %s", msg);
    char *after = read_text(b_metrics);
    assert_string_equal(before, after); /* b's history untouched */
    free(before);
    free(after);
    char b_step[1200];
    snprintf(b_step, sizeof(b_step), "%s/b/step_00000001", dir);
    struct stat sb;
    assert_int_equal(stat(b_step, &sb), 0); /* and its checkpoints */

    /* Into an empty directory it is a plain continuation. */
    snprintf(run, sizeof(run),
             "--set training.steps=3 --set checkpoint.output_dir=%s/c --set checkpoint.restore_from=%s/a/step_00000002",
             dir, dir);
    if (run_cli(dir, NULL, run, msg, sizeof(msg)) != 0) fail_msg("continuing into an empty directory failed: %s", msg);
    /* And with the flag, b is replaced. */
    snprintf(run, sizeof(run),
             "--set training.steps=3 --set checkpoint.output_dir=%s/b --set checkpoint.restore_from=%s/a/step_00000002 "
             "--set checkpoint.overwrite=true",
             dir, dir);
    if (run_cli(dir, NULL, run, msg, sizeof(msg)) != 0) fail_msg("overwrite failed: %s", msg);
    assert_non_null(strstr(msg, "checkpoint.overwrite: this run replaces the one in"));
}

/* The line of a log holding `needle`, copied into line (empty if none). */
static const char *log_line(const char *log, const char *needle, char *line, size_t n) {
    const char *at = strstr(log, needle);
    line[0] = '\0';
    if (!at) return line;
    const char *start = at;
    while (start > log && start[-1] != '\n') start--;
    size_t len = strcspn(start, "\n");
    snprintf(line, n, "%.*s", (int)(len < n ? len : n - 1), start);
    return line;
}

/* A checkpoint of output_dir moved elsewhere and symlinked back (another
 * disk, say) is still output_dir's: the directory holding its entry is what
 * counts, not where the link points. The resume continues the run there. */
static void test_resume_from_a_symlinked_checkpoint(void **state) {
    (void)state;
    char data[2048], msg[1 << 16], run[2400], cmd[4096];
    const char *dir = tiny_data("train_symlinked", data, sizeof(data));
    const char *yaml = tiny_yaml(dir, data, NULL);
    snprintf(run, sizeof(run), "--set checkpoint.save_interval=1 --set checkpoint.output_dir=%s/a", dir);
    if (run_cli(dir, yaml, run, msg, sizeof(msg)) != 0) fail_msg("the first run failed: %s", msg);
    snprintf(cmd, sizeof(cmd),
             "mkdir '%s/store' && mv '%s/a/step_00000002' '%s/store/' && ln -s '%s/store/step_00000002' "
             "'%s/a/step_00000002'",
             dir, dir, dir, dir, dir);
    assert_int_equal(system(cmd), 0);
    snprintf(run, sizeof(run),
             "--set training.steps=3 --set checkpoint.output_dir=%s/a --set checkpoint.restore_from=%s/a/step_00000002",
             dir, dir);
    int rc = run_cli(dir, NULL, run, msg, sizeof(msg));
    if (rc != 0 || strstr(msg, "a checkpoint of another directory"))
        fail_msg("the resume from a/step_00000002 (a symlink) was taken for another run's: %s", msg);
    assert_non_null(strstr(msg, "step     3/3"));
}

/* A resume with another global batch says so, with both values and what it
 * does to the data position and the schedule: a changed
 * training.global_batch_size, and a changed accumulation count (MindSpeed-MM's
 * rule, by which the global batch follows the ranks too). */
static void test_resume_with_another_global_batch_warns(void **state) {
    (void)state;
    char data[2048], msg[1 << 16], run[2400];
    const char *dir = tiny_data("train_batch_change", data, sizeof(data));
    const char *yaml = tiny_yaml(dir, data, NULL); /* local 2, global 2 */
    snprintf(run, sizeof(run),
             "--set checkpoint.save_interval=1 --set training.global_batch_size=4 --set checkpoint.output_dir=%s/a",
             dir);
    if (run_cli(dir, yaml, run, msg, sizeof(msg)) != 0) fail_msg("the first run failed: %s", msg);
    snprintf(run, sizeof(run),
             "--set training.steps=3 --set checkpoint.output_dir=%s/a --set checkpoint.restore_from=latest", dir);
    if (run_cli(dir, NULL, run, msg, sizeof(msg)) != 0) fail_msg("the resume failed: %s", msg);
    if (!strstr(msg, "resume: the global batch was 4 sequences in ") ||
        !strstr(msg, "(training.global_batch_size); this run's is 2 (training.global_batch_size). The data continues "
                     "at the saved position (epoch 0, window 8), 2 windows a step from here; the LR schedules count "
                     "steps, not sequences, so each of steps 3 to 3 takes 0.5 times the sequences it would have had "
                     "at its learning rate, and the run sees 10 sequences in all instead of 12"))
        fail_msg("no warning of the changed global batch: %s", msg);
    /* The same batch again: no warning. */
    snprintf(run, sizeof(run),
             "--set training.steps=4 --set checkpoint.output_dir=%s/a --set checkpoint.restore_from=latest", dir);
    if (run_cli(dir, NULL, run, msg, sizeof(msg)) != 0) fail_msg("the second resume failed: %s", msg);
    assert_null(strstr(msg, "resume: the global batch"));
    /* Accumulation counted: 2 x 2 x 1 rank, then 2 x 1 x 1. */
    snprintf(run, sizeof(run),
             "--set checkpoint.save_interval=1 --set training.gradient_accumulation_steps=2 "
             "--set training.global_batch_size=4 --set checkpoint.output_dir=%s/b",
             dir);
    if (run_cli(dir, NULL, run, msg, sizeof(msg)) != 0) fail_msg("the accumulating run failed: %s", msg);
    snprintf(run, sizeof(run),
             "--set training.steps=3 --set training.gradient_accumulation_steps=1 --set checkpoint.output_dir=%s/b "
             "--set checkpoint.restore_from=latest",
             dir);
    if (run_cli(dir, NULL, run, msg, sizeof(msg)) != 0) fail_msg("the resume without accumulation failed: %s", msg);
    if (!strstr(msg, "(training.local_batch_size 2 x training.gradient_accumulation_steps 2 x 1 data-parallel rank); "
                     "this run's is 2 (training.local_batch_size 2 x training.gradient_accumulation_steps 1 x 1 "
                     "data-parallel rank)"))
        fail_msg("no warning of the changed accumulation: %s", msg);
}

/* With model.from_pretrained the config table shows the architecture in
 * force, the folder's config.json's, not the defaults it replaced. */
static void test_pretrained_config_is_logged(void **state) {
    (void)state;
    char data[2048], msg[1 << 16], model[1400], line[512];
    const char *dir = scratch_dir("train_pretrained_log");
    snprintf(data, sizeof(data), "  dataset_type: token_bin\n  path: %s/train_*.bin\n  seq_len: 16\n",
             fixture_path("data/mindspeed")); /* a vocabulary of 71: the model's is 100 */
    const char *fixture = fixture_path("model/qwen2_untied");
    snprintf(model, sizeof(model), "  from_pretrained: %s\n", fixture);
    int rc = run_cli(dir, tiny_yaml(dir, data, model), "--set training.steps=1", msg, sizeof(msg));
    if (rc != 0) fail_msg("the run failed: %s", msg);
    char source[1500];
    snprintf(source, sizeof(source), "config.json of %s", fixture);
    static const char *const keys[] = {"  model.hidden_size  ", "  model.vocab_size  ", "  model.num_hidden_layers  "};
    static const char *const values[] = {" 48 ", " 100 ", " 2 "};
    for (int i = 0; i < 3; i++) {
        log_line(msg, keys[i], line, sizeof(line));
        if (!strstr(line, values[i]) || !strstr(line, source)) fail_msg("%s: the table says: %s", keys[i], line);
    }
    /* The file's own sizes are named as unused. */
    assert_non_null(strstr(msg, "model.hidden_size: 32 (file, line 5) is not used"));
}

/* Sizes are checked against what they imply before anything is allocated,
 * naming the key, within a second (bound 5 s): a million layers (before:
 * minutes of quadratic name lookups), 2^31 - 1 positions (before: "cannot
 * allocate the model"), a batch of 100,000 sequences (before: the GEMM kernels
 * timed on 25.6M rows, then a loader error naming no key); and a batch the
 * data holds but whose activations this machine's memory does not. */
static void test_sizes_checked_before_allocating(void **state) {
    (void)state;
    const char *dir = scratch_dir("train_sizes");
    write_corpus(dir);
    char big[1300];
    snprintf(big, sizeof(big), "%s/big.txt", dir); /* 8M tokens: the data for 28,000 sequences of 256 */
    write_repeated(big, "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef", 1 << 17);
    char data_big[1400];
    snprintf(data_big, sizeof(data_big), "data.path=%s", big);
    static const char *const arch[] = {
        "model.hidden_size=256",       "model.intermediate_size=688",       "model.num_attention_heads=8",
        "model.num_key_value_heads=2", "model.max_position_embeddings=512", "data.seq_len=256"};
    static const struct {
        const char *set[3];
        const char *want;
    } cases[] = {
        {{"model.num_hidden_layers=1000000"}, "model.num_hidden_layers 1000000 x"},
        {{"model.max_position_embeddings=2147483647"}, "model.max_position_embeddings is 2147483647"},
        {{"training.local_batch_size=100000", "training.global_batch_size=100000"},
         "training.local_batch_size 100000 on 1 data-parallel rank takes 100000 sequences"},
        {{"training.local_batch_size=28000", "training.global_batch_size=28000", NULL},
         "the activations of one micro-batch, training.local_batch_size 28000 x data.seq_len 256"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        if (i == 3 && ht_physical_memory() > ((size_t)300 << 30)) { /* about 370 GB of activations */
            printf("  the activations case needs a machine of less than 300 GiB; skipped\n");
            continue;
        }
        ht_config *cfg = malloc(sizeof(ht_config));
        ht_trainer *t = malloc(sizeof(ht_trainer));
        ht_error err = {0};
        tiny_config(cfg, dir);
        for (size_t k = 0; k < sizeof(arch) / sizeof(arch[0]); k++)
            assert_ht_ok(ht_config_set(cfg, arch[k], &err), &err);
        for (int k = 0; k < 3 && cases[i].set[k]; k++) assert_ht_ok(ht_config_set(cfg, cases[i].set[k], &err), &err);
        if (i == 3) assert_ht_ok(ht_config_set(cfg, data_big, &err), &err);
        double t0 = ht_time_seconds();
        watchdog(60, "ht_trainer_init of an oversized config");
        ht_status s = ht_trainer_init(t, cfg, &err);
        watchdog(0, NULL);
        double took = ht_time_seconds() - t0;
        if (s == HT_OK) ht_trainer_free(t);
        free(t);
        free(cfg);
        if (s != HT_ERR_CONFIG || !strstr(err.msg, cases[i].want))
            fail_msg("case %zu: status %d, '%s'; expected '%s'", i, s, err.msg, cases[i].want);
        printf("  %.3f s: %s\n", took, err.msg);
        if (took > 5.0) fail_msg("case %zu took %.1f s", i, took);
    }
}

/* A model whose weights and gradients fit this machine but whose AdamW state
 * does not is refused before any of it is allocated, the optimizer state
 * named: within 5 s and 512 MiB of peak memory. Before, the weights were
 * allocated and initialised first (here about 55% of the machine), the
 * optimizer state after them, and the run went on. */
static void test_memory_refused_before_allocating(void **state) {
    (void)state;
    const char *dir = scratch_dir("train_memory_plan");
    write_corpus(dir);
    /* A layer of hidden 1024 (8 heads of 128, q/k/v biases), intermediate 2816: 12.86M values; FP32 weights
     * and gradients 8 bytes each, AdamW's moments 8 more. */
    const double per_layer = 4.0 * 1024 * 1024 + 3 * 1024 + 3.0 * 1024 * 2816 + 2 * 1024;
    const int layers = (int)(0.55 * (double)ht_physical_memory() / (8 * per_layer));
    char set_layers[64];
    snprintf(set_layers, sizeof(set_layers), "model.num_hidden_layers=%d", layers);
    const char *const sets[] = {"model.hidden_size=1024",
                                "model.intermediate_size=2816",
                                "model.num_attention_heads=8",
                                "model.num_key_value_heads=8",
                                "training.local_batch_size=1",
                                "training.global_batch_size=1",
                                "data.seq_len=32",
                                set_layers};
    ht_config *cfg = malloc(sizeof(ht_config));
    ht_trainer *t = malloc(sizeof(ht_trainer));
    ht_error err = {0};
    tiny_config(cfg, dir);
    for (size_t k = 0; k < sizeof(sets) / sizeof(sets[0]); k++) assert_ht_ok(ht_config_set(cfg, sets[k], &err), &err);
    const double rss0 = peak_rss_mib(), t0 = ht_time_seconds();
    watchdog(120, "ht_trainer_init of a model whose optimizer state does not fit");
    ht_status s = ht_trainer_init(t, cfg, &err);
    watchdog(0, NULL);
    const double took = ht_time_seconds() - t0, grew = peak_rss_mib() - rss0;
    if (s == HT_OK) ht_trainer_free(t);
    free(t);
    free(cfg);
    printf("  %d layers: %.3f s, peak RSS +%.0f MiB: %s\n", layers, took, grew, err.msg);
    if (s != HT_ERR_CONFIG || !strstr(err.msg, "more than this machine's") || !strstr(err.msg, "optimizer state"))
        fail_msg("status %d, '%s'; expected the memory refusal", s, err.msg);
    if (took > 5.0 || grew > 512) fail_msg("refused after %.1f s and %.0f MiB more peak memory", took, grew);
}

/* The plan the memory refusal compares is what the run then allocates: the
 * weights (the model dtype, and the compute copies of the GEMM kernel chosen:
 * FP32 ones of bf16 values where it is fp32_rounded), the FP32 main params
 * and main_grad to the byte, the optimizer state and the
 * activations as lower bounds of what they take (equal for AdamW alone), over
 * float32 and bfloat16 models, Muon and AdamW, a frozen part and LoRA. */
static void test_memory_plan_is_what_is_allocated(void **state) {
    (void)state;
    const char *dir = scratch_dir("train_memory_plan_exact");
    write_corpus(dir);
    static const char *const cases[][4] = {
        {"optimizer._target_=AdamW"},
        {"optimizer._target_=Muon", "model_init_dtype=bfloat16", "fsdp_config.mix_precision.param_dtype=bfloat16"},
        {"optimizer._target_=Muon", "model.freeze=[model.embed_tokens, model.layers.0.mlp]"},
        {"optimizer._target_=Muon", "model_init_dtype=bfloat16", "fsdp_config.mix_precision.param_dtype=bfloat16",
         "kernels.bf16_gemm=fp32_rounded"},
        {"model_init_dtype=bfloat16", "optimizer.main_param_storage=residual16"},
        {"model.lora.rank=4", "model_init_dtype=bfloat16", "optimizer.fp32_main_params=false"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        ht_config *cfg = malloc(sizeof(ht_config));
        ht_trainer *t = malloc(sizeof(ht_trainer));
        ht_error err = {0};
        tiny_config(cfg, dir);
        for (int k = 0; k < 4 && cases[i][k]; k++) assert_ht_ok(ht_config_set(cfg, cases[i][k], &err), &err);
        assert_ht_ok(ht_trainer_init(t, cfg, &err), &err);
        ht_step_stats st;
        assert_ht_ok(ht_trainer_step(t, &st, &err), &err);
        const ht_memory_plan *p = &t->memory_plan;
        const ht_param_store *ps = &t->model->params;
        const double optim = (double)ht_optimizer_bytes(&t->optimizer), acts = (double)t->model->activation_bytes;
        printf("  case %zu: weights %.0f of %zu + %zu, main %.0f of %zu, grad %.0f of %zu, optimizer %.0f of %.0f, "
               "activations %.0f of %.0f\n",
               i, p->weights, ps->data_bytes, ps->compute_bytes, p->main, ps->main_bytes, p->grad, ps->grad_bytes,
               p->optimizer, optim, p->activations, acts);
        if (p->weights != (double)(ps->data_bytes + ps->compute_bytes) || p->main != (double)ps->main_bytes ||
            p->grad != (double)ps->grad_bytes || p->optimizer > optim || p->activations > acts || p->activations <= 0 ||
            p->main + p->grad + p->optimizer <= 0)
            fail_msg("case %zu: the plan is not what was allocated", i);
        if (i == 0 && p->optimizer != optim) fail_msg("AdamW alone: planned %.0f, allocated %.0f", p->optimizer, optim);
        ht_trainer_free(t);
        free(t);
        free(cfg);
    }
}

/* The first value of `key` in dir/<out>/metrics.jsonl (the first step's, of a 1-step run). */
static double first_metric(const char *dir, const char *out, const char *key) {
    char path[1200], field[64];
    snprintf(path, sizeof(path), "%s/%s/metrics.jsonl", dir, out);
    snprintf(field, sizeof(field), "\"%s\": ", key);
    char *text = read_text(path);
    const char *at = strstr(text, field);
    assert_non_null(at);
    double value = strtod(at + strlen(field), NULL);
    free(text);
    return value;
}

/* MindFormers' weight_decay_include/exclude over no_weight_decay, its module
 * names in routing (word_embeddings, output_layer), a pattern that matches no
 * parameter named, a name in both lists refused; and HyperParallel's gradient
 * scaling factor, which scales every gradient before the reduction (0.5: the
 * first step's gradient norm exactly halves). */
static void test_decay_lists_routing_names_and_gradient_scaling(void **state) {
    (void)state;
    char data[2048], msg[1 << 16], line[512], run[2048];
    const char *dir = tiny_data("train_decay_lists", data, sizeof(data));
    const char *yaml = tiny_yaml(dir, data, NULL);
    int rc = run_cli(dir, yaml,
                     "--set 'optimizer.adamw_config.weight_decay_exclude=[\"output_layer\"]' "
                     "--set 'optimizer.adamw_config.weight_decay_include=[\"*norm*\"]' "
                     "--set 'optimizer.adamw_config.no_weight_decay=[\"*bias*\", \"*norm*\", \"*nothing_like_it*\"]' "
                     "--set checkpoint.overwrite=true",
                     msg, sizeof(msg));
    if (rc != 0) fail_msg("the run failed: %s", msg);
    if (!strstr(log_line(msg, " lm_head.weight ", line, sizeof(line)), "weight decay 0") ||
        strstr(line, "weight decay 0.01"))
        fail_msg("lm_head (output_layer) should not decay: '%s'", line);
    if (!strstr(log_line(msg, " model.norm.weight ", line, sizeof(line)), "weight decay 0.01"))
        fail_msg("model.norm should decay (weight_decay_include): '%s'", line);
    if (!strstr(log_line(msg, " model.layers.0.self_attn.q_proj.bias ", line, sizeof(line)), "weight decay 0"))
        fail_msg("biases stay undecayed: '%s'", line);
    assert_non_null(strstr(msg, "optimizer.adamw_config.no_weight_decay: \"*nothing_like_it*\" matches no parameter"));

    rc = run_cli(dir, NULL,
                 "--set 'optimizer.adamw_config.weight_decay_exclude=[\"*norm*\"]' "
                 "--set 'optimizer.adamw_config.weight_decay_include=[\"model.norm\"]' --set checkpoint.overwrite=true",
                 msg, sizeof(msg));
    assert_int_equal(rc, 1);
    assert_non_null(strstr(msg, "model.norm.weight matches weight_decay_include \"model.norm\" and "
                                "weight_decay_exclude \"*norm*\""));

    /* MindFormers' module names route the embedding and the output layer to AdamW. */
    rc = run_cli(dir, NULL,
                 "--set optimizer._target_=Muon --set checkpoint.overwrite=true "
                 "--set 'optimizer.muon_config.adamw_include=[\"word_embeddings\", \"output_layer\"]'",
                 msg, sizeof(msg));
    if (rc != 0) fail_msg("the Muon run failed: %s", msg);
    assert_non_null(strstr(log_line(msg, " model.embed_tokens.weight ", line, sizeof(line)), "AdamW"));
    assert_non_null(strstr(log_line(msg, " lm_head.weight ", line, sizeof(line)), "AdamW"));
    assert_non_null(strstr(log_line(msg, " model.layers.0.mlp.up_proj.weight ", line, sizeof(line)), "Muon"));

    /* gradient_scaling_factor: one step each, the norms compared. */
    double norm[2];
    for (int k = 0; k < 2; k++) {
        snprintf(run, sizeof(run),
                 "--set training.steps=1 --set checkpoint.overwrite=true --set checkpoint.output_dir=%s/gs%d %s", dir,
                 k, k ? "--set training.gradient_scaling_factor=0.5" : "");
        rc = run_cli(dir, NULL, run, msg, sizeof(msg));
        if (rc != 0) fail_msg("the scaling run failed: %s", msg);
        char out[16];
        snprintf(out, sizeof(out), "gs%d", k);
        norm[k] = first_metric(dir, out, "grad_norm");
    }
    if (!(norm[0] > 0) || norm[1] != norm[0] / 2) fail_msg("grad norms %.17g and %.17g", norm[0], norm[1]);
}

/* data.shuffle false reads the training windows in order (another first
 * batch, so another first loss; the same again when repeated), and
 * training.deterministic fixes the 16-bit kernels instead of timing them. */
static void test_shuffle_and_deterministic(void **state) {
    (void)state;
    char data[2048], msg[1 << 16], run[2048];
    const char *dir = tiny_data("train_shuffle", data, sizeof(data));
    const char *yaml = tiny_yaml(dir, data, NULL);
    const char *outs[3] = {"shuffled", "in_order", "in_order_again"};
    for (int k = 0; k < 3; k++) {
        snprintf(run, sizeof(run), "--set training.steps=1 --set checkpoint.output_dir=%s/%s %s", dir, outs[k],
                 k ? "--set data.shuffle=false" : "");
        if (run_cli(dir, k ? NULL : yaml, run, msg, sizeof(msg)) != 0) fail_msg("run %d failed: %s", k, msg);
    }
    double shuffled = first_metric(dir, outs[0], "loss"), in_order = first_metric(dir, outs[1], "loss");
    if (shuffled == in_order) fail_msg("data.shuffle false changed nothing (loss %.17g)", in_order);
    assert_true(in_order == first_metric(dir, outs[2], "loss"));

    snprintf(run, sizeof(run),
             "--set training.steps=1 --set checkpoint.output_dir=%s/det --set model_init_dtype=bfloat16 "
             "--set training.deterministic=true",
             dir);
    if (run_cli(dir, NULL, run, msg, sizeof(msg)) != 0) fail_msg("the deterministic run failed: %s", msg);
    assert_non_null(strstr(msg, "training.deterministic: 16-bit kernels fixed to fp32_rounded, not chosen by timing"));
    assert_non_null(strstr(msg, "bf16 fp32_rounded"));
}

/* Every example YAML of the seed documents, as configs/seeds/ holds it, loads
 * in its own dialect and trains 2 steps (sizes made small: steps, sequence,
 * model, and warmup where the example's is longer than 2 steps). */
static void test_seed_configs_train(void **state) {
    (void)state;
    const char *dir = scratch_dir("train_seeds");
    write_corpus(dir);
    glob_t g;
    assert_int_equal(glob(HT_SOURCE_DIR "/configs/seeds/*.yaml", 0, NULL, &g), 0);
    assert_true(g.gl_pathc >= 18);
    bool mindspeed_seen = false;
    for (size_t k = 0; k < g.gl_pathc; k++) {
        const char *path = g.gl_pathv[k], *base = strrchr(path, '/') + 1;
        char *text = read_text(path), msg[1 << 16], run[4096];
        const char *want = strncmp(base, "mindformers_training", 20) == 0 ? "hypertrain's"
                           : strncmp(base, "mindformers_", 12) == 0       ? "MindFormers'"
                           : strncmp(base, "hyperparallel_", 14) == 0     ? "HyperParallel's"
                                                                          : "MindSpeed-MM's";
        bool mindspeed = strcmp(want, "MindSpeed-MM's") == 0;
        char data[1400], sizes[1400], cwd[1024] = "";
        /* MindSpeed-MM's: its own data, model and sequence length, by the paths the file gives relative to the
         * repository's root (run from a directory that holds its tests/ as the root does). */
        if (mindspeed)
            snprintf(sizes, sizeof(sizes),
                     "--set tools.profile.enable=true --set tools.memory_profile.enable=true "
                     "--set training.gradient_accumulation_steps=2");
        else
            snprintf(sizes, sizeof(sizes),
                     "--set model.hidden_size=32 --set model.intermediate_size=64 --set model.num_hidden_layers=1 "
                     "--set model.num_attention_heads=4 --set model.num_key_value_heads=2");
        data[0] = '\0';
        if (!mindspeed) snprintf(data, sizeof(data), "--set data.path=%s/corpus.txt --set data.seq_len=16", dir);
        snprintf(run, sizeof(run), "--set training.steps=2 %s --set checkpoint.output_dir=%s/%s %s %s", data, dir, base,
                 sizes, strstr(text, "warmup_steps:") ? "--set lr_scheduler.warmup_steps=1" : "");
        if (mindspeed) {
            char link[1300];
            snprintf(link, sizeof(link), "%s/tests", dir);
            assert_int_equal(symlink(HT_SOURCE_DIR "/tests", link), 0);
            assert_non_null(getcwd(cwd, sizeof(cwd)));
            assert_int_equal(chdir(dir), 0);
        }
        int rc = run_cli(dir, text, run, msg, sizeof(msg));
        if (cwd[0]) assert_int_equal(chdir(cwd), 0);
        free(text);
        if (rc != 0) fail_msg("%s: exit %d: %s", base, rc, msg);
        char dialect[128];
        snprintf(dialect, sizeof(dialect), "(%s dialect)", want);
        if (!strstr(msg, dialect)) fail_msg("%s: not read as %s: %s", base, dialect, msg);
        if (!strstr(msg, "step     2/2")) fail_msg("%s: did not train 2 steps: %s", base, msg);
        if (strstr(msg, "matches no parameter")) fail_msg("%s: a pattern matches nothing: %s", base, msg);
        if (mindspeed &&
            (!strstr(msg, "Profile over 2 steps") || !strstr(msg, "  backward ") || !strstr(msg, "  optimizer ") ||
             !strstr(msg, "Memory rank 0 (tools.memory_profile)") || !strstr(msg, "2 micro-batches per step") ||
             !strstr(msg, "tokenizer.json, 71 tokens, fits the model and every shard") ||
             !strstr(msg, "data.dataloader_param.num_workers: accepted, not applicable here")))
            fail_msg("%s: tools.profile, tools.memory_profile, gradient_accumulation_steps, the tokenizer or the "
                     "not-applicable keys did not show: %s",
                     base, msg);
        mindspeed_seen |= mindspeed;
    }
    assert_true(mindspeed_seen);
    globfree(&g);
}

/* One configs/ file exactly as written, from `dir` (which holds the
 * repository's tests/, as the root does: the MindSpeed-MM seed's paths are
 * relative to it): loaded, validated, the trainer built, and where a step is
 * cheap steps taken: 2 up to 0.5 GFLOP a step, 1 up to 5 (the suite's other
 * tests train each file cut small). false with the reason in `why`. */
static bool runs_as_written(const char *path, char *why, size_t n, int *stepped) {
    ht_config *cfg = malloc(sizeof(ht_config));
    ht_trainer *t = malloc(sizeof(ht_trainer));
    ht_error err = {0};
    bool ok = ht_config_load(path, 0, NULL, cfg, &err) == HT_OK && ht_config_validate(cfg, 1, &err) == HT_OK &&
              ht_trainer_init(t, cfg, &err) == HT_OK;
    *stepped = 0;
    if (ok) {
        double gflop = ht_model_flops_per_token(&t->model->config, t->T) * t->B * t->T * t->grad_accum / 1e9;
        for (int k = 0; ok && k < (gflop <= 0.5 ? 2 : gflop <= 5 ? 1 : 0); k++) {
            ht_step_stats st;
            ok = ht_trainer_step(t, &st, &err) == HT_OK;
            if (ok && !isfinite(st.loss)) snprintf(err.msg, sizeof(err.msg), "step %d: loss %g", k + 1, st.loss);
            ok = ok && isfinite(st.loss);
            *stepped += ok;
        }
        ht_trainer_free(t);
    }
    if (!ok) snprintf(why, n, "%s", err.msg);
    free(t);
    free(cfg);
    return ok;
}

/* Every file of configs/ and configs/seeds/ runs as written: no key to
 * override for it to start (the MindSpeed-MM seed's seq_len was longer than
 * its model's positions), and the cheap ones train 2 steps. */
static void test_shipped_configs_run_as_written(void **state) {
    (void)state;
    const char *dir = scratch_dir("train_as_written");
    char link[1300], cwd[1024], why[sizeof(((ht_error *)0)->msg)], failed[4096] = "";
    snprintf(link, sizeof(link), "%s/tests", dir);
    assert_int_equal(symlink(HT_SOURCE_DIR "/tests", link), 0);
    assert_non_null(getcwd(cwd, sizeof(cwd)));
    glob_t g;
    assert_int_equal(glob(HT_SOURCE_DIR "/configs/*.yaml", 0, NULL, &g), 0);
    assert_int_equal(glob(HT_SOURCE_DIR "/configs/seeds/*.yaml", GLOB_APPEND, NULL, &g), 0);
    assert_true(g.gl_pathc >= 22);
    assert_int_equal(chdir(dir), 0);
    int trained = 0, mindspeed_steps = 0;
    for (size_t k = 0; k < g.gl_pathc && !failed[0]; k++) {
        const char *base = g.gl_pathv[k] + strlen(HT_SOURCE_DIR "/");
        int steps;
        double t0 = ht_time_seconds();
        if (!runs_as_written(g.gl_pathv[k], why, sizeof(why), &steps))
            snprintf(failed, sizeof(failed), "%s: %s", base, why);
        else
            printf("  %s: runs as written, %d step%s taken (%.1f s)\n", base, steps, steps == 1 ? "" : "s",
                   ht_time_seconds() - t0);
        trained += steps > 0;
        mindspeed_steps += strstr(base, "mindspeed") ? steps : 0;
    }
    assert_int_equal(chdir(cwd), 0); /* before any failure: the next tests' scratch directories are relative */
    if (failed[0]) fail_msg("%s", failed);
    assert_true(trained >= 8);
    assert_int_equal(mindspeed_steps, 2);
    globfree(&g);
}

/* OpenMP's idle threads: a busy machine at start (another process running)
 * gets the short spin, said in the log; /proc/loadavg's running count decides. */
static void test_openmp_wait_on_a_busy_machine(void **state) {
    (void)state;
    assert_false(ht_openmp_machine_busy("0.00 0.01 0.05 1/123 4567\n"));
    assert_true(ht_openmp_machine_busy("1.00 0.50 0.20 3/200 999\n"));
    assert_false(ht_openmp_machine_busy("garbage"));
    assert_false(ht_openmp_machine_busy(NULL));
    char data[2048], msg[1 << 16], cmd[256];
    const char *dir = tiny_data("train_openmp_wait", data, sizeof(data));
    pid_t busy = fork();
    if (busy == 0) {
        for (volatile unsigned long i = 0;; i++) {
        }
    }
    int rc = run_cli(dir, tiny_yaml(dir, data, NULL), NULL, msg, sizeof(msg));
    snprintf(cmd, sizeof(cmd), "kill -9 %d", (int)busy);
    assert_int_equal(system(cmd), 0);
    waitpid(busy, NULL, 0);
    if (rc != 0) fail_msg("the run failed: %s", msg);
    const char *env = getenv("GOMP_SPINCOUNT");
    if (!env && !getenv("OMP_WAIT_POLICY") && !getenv("KMP_BLOCKTIME"))
        assert_non_null(strstr(msg, "idle threads: spin 1000 iterations, then sleep (the machine was busy at start"));
}

/* training.plugin: a shared library adds a dataset and a model through the
 * public API; the run uses both by name. Without it, the names are unknown and
 * the error lists what is registered. */
static void test_plugin_registers_a_dataset_and_a_model(void **state) {
    (void)state;
    const char *dir = scratch_dir("cli_plugin");
    write_corpus(dir);
    const char *plugin = getenv("HT_PLUGIN");
    if (!plugin) fail_msg("HT_PLUGIN is not set (run the test through ctest)");
    char yaml[8192], data[2048], out[1300];
    static char msg[1 << 17];
    snprintf(data, sizeof(data), "  dataset_type: upper_text\n  path: %s/corpus.txt\n  seq_len: 16\n", dir);
    snprintf(yaml, sizeof(yaml),
             "model:\n  name: plugin_llama\n%s  attention_bias: false\n"
             "model_init_dtype: float32\n"
             "data:\n%s"
             "optimizer:\n  _target_: AdamW\n"
             "training:\n  steps: 2\n  local_batch_size: 2\n  global_batch_size: 2\n  plugin: [\"%s\"]\n"
             "checkpoint:\n  output_dir: %s/out\n",
             tiny_model_yaml(one_layer), data, plugin, dir);
    int rc = run_cli(dir, yaml, NULL, msg, sizeof(msg));
    if (rc != 0) fail_msg("training with the plugin failed:\n%s", msg);
    assert_non_null(strstr(msg, "loaded plugin"));
    assert_non_null(strstr(msg, "upper_text"));
    snprintf(out, sizeof(out), "%s/out/final/config.json", dir);
    assert_true(path_exists(out));
    char *cfg_text = read_text(out);
    assert_non_null(strstr(cfg_text, "LlamaForCausalLM"));
    free(cfg_text);

    /* Without the plugin the dataset is unknown and the error lists the registered ones. */
    char cmd[2048];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s/out'", dir);
    assert_int_equal(system(cmd), 0);
    expect_refused(dir, tiny_yaml(dir, data, NULL), NULL, "upper_text", "text_bytes");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lm_head_chunk_bound),
        cmocka_unit_test(test_tensorboard_event_framing),
        cmocka_unit_test(test_plot_panels),
        cmocka_unit_test(test_trace_of_named_steps),
        cmocka_unit_test(test_training_lowers_validation_loss),
        cmocka_unit_test(test_an_mfu_above_the_peak_is_not_reported),
        cmocka_unit_test(test_trainer_on_the_fenced_backend),
        cmocka_unit_test(test_checkpoints_between_the_cpu_and_the_fenced_backend),
        cmocka_unit_test(test_final_weights_and_pretrained_on_the_fenced_backend),
        cmocka_unit_test(test_segmented_schedule_runs_its_own_length),
        cmocka_unit_test(test_qk_clip_in_the_trainer),
        cmocka_unit_test(test_default_config_runs),
        cmocka_unit_test(test_moe_config_runs),
        cmocka_unit_test(test_cli_bad_input),
        cmocka_unit_test(test_resume_refuses_lost_optimizer_state),
        cmocka_unit_test(test_resume_from_elsewhere_keeps_the_run_there),
        cmocka_unit_test(test_resume_from_a_symlinked_checkpoint),
        cmocka_unit_test(test_resume_with_another_global_batch_warns),
        cmocka_unit_test(test_pretrained_config_is_logged),
        cmocka_unit_test(test_sizes_checked_before_allocating),
        cmocka_unit_test(test_memory_refused_before_allocating),
        cmocka_unit_test(test_memory_plan_is_what_is_allocated),
        cmocka_unit_test(test_gram_form_in_the_trainer),
        cmocka_unit_test(test_residual16_is_the_fp32_copy_bit_for_bit),
        cmocka_unit_test(test_mfu_with_newton_schulz),
        cmocka_unit_test(test_seed_configs_train),
        cmocka_unit_test(test_shipped_configs_run_as_written),
        cmocka_unit_test(test_shuffle_and_deterministic),
        cmocka_unit_test(test_decay_lists_routing_names_and_gradient_scaling),
        cmocka_unit_test(test_openmp_wait_on_a_busy_machine),
        cmocka_unit_test(test_fp16_metrics_and_their_resume),
        cmocka_unit_test(test_memory_log_with_and_without_main_params),
        cmocka_unit_test(test_plugin_registers_a_dataset_and_a_model),
        cmocka_unit_test(test_lora_fine_tune),
    };
    if (getenv("HT_TEST_FILTER")) cmocka_set_test_filter(getenv("HT_TEST_FILTER"));
    if (getenv("HT_TEST_FILTER")) cmocka_set_test_filter(getenv("HT_TEST_FILTER")); /* one test, by name pattern */
    return cmocka_run_group_tests(tests, NULL, NULL);
}
