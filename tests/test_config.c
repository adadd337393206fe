/* The config loader: defaults, a full file, configs/default.yaml, every
 * error the loader and the validator report (with file, line, key, expected
 * and found in the message), --set overrides, source tracking, the dialect
 * aliases, and the "Trainer config" log. */
#include "harness.h"

#include "hypertrain/config.h"

#include <fcntl.h>
#include <math.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *write_config(const char *name, const char *text) {
    static char paths[4][1200];
    static int next = 0;
    char *p = paths[next++ % 4];
    snprintf(p, sizeof(paths[0]), "%s/%s", scratch_dir(name), name);
    write_file(p, text, strlen(text));
    return p;
}

/* Loads `text` as a file named `name`; returns the status (err filled). */
static ht_status load_text(const char *name, const char *text, ht_config *cfg, ht_error *err) {
    return ht_config_load(write_config(name, text), 0, NULL, cfg, err);
}

#define assert_contains(haystack, needle)                                                                              \
    do {                                                                                                               \
        if (!strstr((haystack), (needle))) fail_msg("expected \"%s\" in message:\n%s", (needle), (haystack));          \
    } while (0)

/* Loads text and expects an error whose message holds every one of the NULL-terminated needles. */
static void expect_load_error(const char *name, const char *text, ...) {
    static ht_config cfg;
    ht_error err = {0};
    ht_status st = load_text(name, text, &cfg, &err);
    if (st == HT_OK) fail_msg("%s: expected an error for:\n%s", name, text);
    assert_int_equal(st, HT_ERR_CONFIG);
    va_list ap;
    va_start(ap, text);
    for (const char *needle = va_arg(ap, const char *); needle; needle = va_arg(ap, const char *))
        assert_contains(err.msg, needle);
    va_end(ap);
}

/* Loads text (must succeed) and validates with dp ranks, expecting an error holding every needle. */
static void expect_invalid(const char *name, const char *text, int dp, ...) {
    static ht_config cfg;
    ht_error err = {0};
    assert_ht_ok(load_text(name, text, &cfg, &err), &err);
    ht_status st = ht_config_validate(&cfg, dp, &err);
    if (st == HT_OK) fail_msg("%s: expected a validation error for:\n%s", name, text);
    assert_int_equal(st, HT_ERR_CONFIG);
    va_list ap;
    va_start(ap, dp);
    for (const char *needle = va_arg(ap, const char *); needle; needle = va_arg(ap, const char *))
        assert_contains(err.msg, needle);
    va_end(ap);
}

static void assert_source(const ht_config *cfg, const char *key, ht_config_source want, int want_line) {
    int line = -1;
    ht_config_source got = ht_config_key_source(cfg, key, &line);
    if (got != want || line != want_line)
        fail_msg("%s: source %s line %d, expected %s line %d", key, ht_config_source_name(got), line,
                 ht_config_source_name(want), want_line);
}

/* ---------------------------------------------------------------- defaults */

static void test_defaults(void **state) {
    (void)state;
    static ht_config cfg;
    ht_config_defaults(&cfg);
    assert_string_equal(cfg.model.arch.name, "qwen2");
    assert_string_equal(cfg.model.from_pretrained, "");
    assert_int_equal(cfg.model.arch.vocab_size, 256);
    assert_int_equal(cfg.model.arch.intermediate_size, 688);
    assert_int_equal(cfg.model.arch.num_key_value_heads, 2);
    assert_int_equal(cfg.model.arch.head_dim, 0);
    assert_true(cfg.model.arch.rope_theta == 10000.0);
    assert_true(cfg.model.arch.rms_norm_eps == 1e-6);
    assert_true(cfg.model.arch.attention_bias);
    assert_false(cfg.model.arch.tie_word_embeddings);
    assert_true(cfg.model.arch.initializer_range == 0.02);
    assert_int_equal(cfg.model_init_dtype, HT_DTYPE_F32);
    assert_int_equal(cfg.kernels.lm_head_chunk_mib, -1); /* auto: the backend's */
    assert_string_equal(cfg.data.dataset_type, "text_bytes");
    assert_int_equal(cfg.data.seq_len, 256);
    assert_int_equal(cfg.optimizer.type, HT_CONFIG_OPTIMIZER_MUON);
    assert_true(cfg.optimizer.fp32_main_params);
    assert_true(cfg.optimizer.muon.lr == 0.02);
    assert_true(cfg.optimizer.muon.momentum == 0.95);
    assert_true(cfg.optimizer.muon.nesterov);
    assert_int_equal(cfg.optimizer.muon.ns_steps, 5);
    assert_int_equal(cfg.optimizer.muon.ns_variant, HT_CONFIG_NS_ASYM5);
    assert_int_equal(cfg.optimizer.muon.ns_coefficients.count, 0);
    assert_true(cfg.optimizer.muon.ns_eps == 1e-7);
    assert_true(cfg.optimizer.muon.matched_adamw_rms == 0.2);
    assert_int_equal(cfg.optimizer.muon.momentum_style, HT_CONFIG_MOMENTUM_SUM);
    assert_int_equal(cfg.optimizer.muon.comm_strategy, HT_CONFIG_MUON_COMM_ALLGATHER);
    assert_int_equal(cfg.optimizer.muon.adamw_include.count, 2);
    assert_string_equal(cfg.optimizer.muon.adamw_include.items[0], "*embed*");
    assert_string_equal(cfg.optimizer.muon.adamw_include.items[1], "*lm_head*");
    assert_true(cfg.optimizer.muon.qk_clip_threshold == 100);
    assert_int_equal(cfg.optimizer.muon.ns_dtype, HT_DTYPE_F32);
    assert_false(cfg.optimizer.stochastic_rounding);
    assert_true(cfg.training.loss_scale_initial == 65536);
    assert_int_equal(cfg.training.loss_scale_growth_interval, 1000);
    assert_true(cfg.training.loss_scale_growth_factor == 2);
    assert_true(cfg.training.loss_scale_backoff_factor == 0.5);
    assert_int_equal(cfg.training.loss_scale_hysteresis, 2);
    assert_true(cfg.training.loss_scale_min == 1);
    assert_true(cfg.optimizer.adamw.lr == 0.001);
    assert_true(cfg.optimizer.adamw.betas[0] == 0.9 && cfg.optimizer.adamw.betas[1] == 0.999);
    assert_true(cfg.optimizer.adamw.eps == 1e-8);
    assert_int_equal(cfg.optimizer.adamw.no_weight_decay.count, 3);
    assert_string_equal(cfg.optimizer.adamw.no_weight_decay.items[2], "*ln_*");
    assert_int_equal(cfg.lr_scheduler.type, HT_CONFIG_LR_COSINE_WARMUP);
    assert_true(cfg.lr_scheduler.power == 1.0);
    assert_int_equal(cfg.training.steps, 1000);
    assert_int_equal(cfg.training.global_batch_size, 32);
    assert_true(cfg.training.max_norm == 1.0);
    assert_int_equal(cfg.training.seed, 42);
    assert_int_equal(cfg.training.eval_batches, 20);
    assert_int_equal(cfg.training.plugin.count, 0);
    assert_int_equal(cfg.fsdp.shard_size, 0);
    assert_int_equal(cfg.fsdp.param_dtype, HT_DTYPE_BF16);
    assert_int_equal(cfg.fsdp.reduce_dtype, HT_DTYPE_F32);
    assert_int_equal(cfg.fsdp.output_dtype, HT_DTYPE_BF16);
    assert_string_equal(cfg.checkpoint.output_dir, "runs/default");
    assert_int_equal(cfg.checkpoint.keep_last, 3);
    assert_string_equal(cfg.checkpoint.restore_from, "");
    assert_string_equal(cfg.file, "");
    for (int i = 0; i < ht_config_key_count(); i++)
        assert_source(&cfg, ht_config_key_name(i), HT_CONFIG_SOURCE_DEFAULT, 0);

    ht_error err = {0};
    assert_ht_ok(ht_config_validate(&cfg, 1, &err), &err);
    assert_ht_ok(ht_config_validate(&cfg, 4, &err), &err);
    assert_int_equal(ht_config_validate(&cfg, 3, &err), HT_ERR_CONFIG); /* 32 % (8 * 3) */
    assert_int_equal(ht_config_warmup_steps(&cfg), 0);

    /* No file at all: defaults. */
    static ht_config cfg2;
    assert_ht_ok(ht_config_load(NULL, 0, NULL, &cfg2, &err), &err);
    assert_memory_equal(&cfg, &cfg2, sizeof(cfg));
}

/* ---------------------------------------------------------------- configs/default.yaml */

static void test_default_yaml(void **state) {
    (void)state;
    static ht_config cfg;
    ht_error err = {0};
    const char *path = HT_SOURCE_DIR "/configs/default.yaml";
    assert_ht_ok(ht_config_load(path, 0, NULL, &cfg, &err), &err);
    assert_ht_ok(ht_config_validate(&cfg, 1, &err), &err);
    assert_ht_ok(ht_config_validate(&cfg, 2, &err), &err);
    assert_string_equal(cfg.file, path);
    assert_string_equal(cfg.model.arch.name, "qwen2");
    assert_int_equal(cfg.model.arch.hidden_size, 256);
    assert_int_equal(cfg.model_init_dtype, HT_DTYPE_BF16);
    assert_int_equal(cfg.fsdp.param_dtype, HT_DTYPE_BF16);
    assert_int_equal(cfg.fsdp.reduce_dtype, HT_DTYPE_F32);
    assert_true(cfg.optimizer.fp32_main_params);
    assert_string_equal(cfg.data.path, "/usr/share/games/fortunes");
    assert_true(cfg.data.valid_fraction == 0.02);
    assert_int_equal(cfg.optimizer.type, HT_CONFIG_OPTIMIZER_MUON);
    assert_int_equal(cfg.lr_scheduler.type, HT_CONFIG_LR_COSINE_WARMUP);
    assert_int_equal(cfg.training.steps, 300);
    assert_int_equal(cfg.training.local_batch_size, 8);
    assert_int_equal(cfg.training.global_batch_size, 16);
    assert_int_equal(ht_config_warmup_steps(&cfg), 15);
    assert_string_equal(cfg.checkpoint.output_dir, "runs/default");
    int line = 0;
    assert_int_equal(ht_config_key_source(&cfg, "training.steps", &line), HT_CONFIG_SOURCE_FILE);
    assert_true(line > 0);
    assert_int_equal(ht_config_key_source(&cfg, "optimizer.muon_config.muon_ns_eps", &line), HT_CONFIG_SOURCE_DEFAULT);
    ht_config_log(&cfg);
}

/* ---------------------------------------------------------------- a full file */

static const char *FULL = "# every section and key, none at its default\n" /* 1 */
                          "model:\n"                                       /* 2 */
                          "  name: qwen2_moe\n"                            /* 3 */
                          "  from_pretrained: /models/tiny\n"              /* 4 */
                          "  vocab_size: 1000\n"                           /* 5 */
                          "  hidden_size: 64\n"                            /* 6 */
                          "  intermediate_size: 128\n"                     /* 7 */
                          "  num_hidden_layers: 2\n"                       /* 8 */
                          "  num_attention_heads: 4\n"                     /* 9 */
                          "  num_key_value_heads: 4\n"                     /* 10 */
                          "  head_dim: 16\n"                               /* 11 */
                          "  max_position_embeddings: 1024\n"              /* 12 */
                          "  rope_theta: 500000\n"                         /* 13 */
                          "  rms_norm_eps: 1.0e-5\n"                       /* 14 */
                          "  freeze: []\n"                                 /* 15 */
                          "  trust_remote_code: true\n"                    /* 16 */
                          "  loss_type: raw\n"                             /* 17 */
                          "  recompute: false\n"                           /* 18 */
                          "  recompute_plan:\n"                            /* 19 */
                          "    apply_modules: [\"model.layers.{*}\"]\n"    /* 20 */
                          "  attention_bias: false\n"                      /* 21 */
                          "  tie_word_embeddings: true\n"                  /* 22 */
                          "  initializer_range: 0.01\n"                    /* 23 */
                          "  num_experts: 4\n"
                          "  num_experts_per_tok: 1\n"
                          "  moe_intermediate_size: 24\n"
                          "  shared_expert_intermediate_size: 40\n"
                          "  norm_topk_prob: true\n"
                          "  decoder_sparse_step: 2\n"
                          "  mlp_only_layers: [0]\n"
                          "  output_router_logits: true\n"
                          "  router_aux_loss_coef: 0.02\n"
                          "  lora:\n"                                                                         /* 24 */
                          "    rank: 8\n"                                                                     /* 25 */
                          "    alpha: 16\n"                                                                   /* 26 */
                          "    dropout: 0.05\n"                                                               /* 27 */
                          "    target_modules: [q_proj, \"model.layers.{*}.mlp.down_proj\"]\n"                /* 28 */
                          "    use_rslora: true\n"                                                            /* 29 */
                          "    use_muon: true\n"                                                              /* 30 */
                          "    from_pretrained: /adapters/tiny\n"                                             /* 31 */
                          "model_init_dtype: bfloat16\n"                                                      /* 32 */
                          "data:\n"                                                                           /* 33 */
                          "  dataset_type: token_bin\n"                                                       /* 34 */
                          "  path: \"data/*.bin\"\n"                                                          /* 35 */
                          "  shuffle: false\n"                                                                /* 36 */
                          "  drop_last: true\n"                                                               /* 37 */
                          "  num_workers: 4\n"                                                                /* 38 */
                          "  pin_memory: true\n"                                                              /* 39 */
                          "  dataloader_mode: sampler\n"                                                      /* 40 */
                          "  sampler_type: BaseRandomBatchSampler\n"                                          /* 41 */
                          "  collate: llm_pretrain\n"                                                         /* 42 */
                          "  tokenizer: /models/tiny\n"                                                       /* 43 */
                          "  dataset_dir: /data\n"                                                            /* 44 */
                          "  dataset: null\n"                                                                 /* 45 */
                          "  seq_len: 128\n"                                                                  /* 46 */
                          "  valid_fraction: 0.1\n"                                                           /* 47 */
                          "optimizer:\n"                                                                      /* 48 */
                          "  _target_: Muon\n"                                                                /* 49 */
                          "  fp32_main_params: false\n"                                                       /* 50 */
                          "  main_param_storage: fp32\n"                                                      /* 51 */
                          "  muon_config:\n"                                                                  /* 52 */
                          "    muon_lr: 0.03\n"                                                               /* 53 */
                          "    muon_weight_decay: 0.2\n"                                                      /* 54 */
                          "    muon_momentum: 0.9\n"                                                          /* 55 */
                          "    muon_nesterov: false\n"                                                        /* 56 */
                          "    muon_ns_steps: 7\n"                                                            /* 57 */
                          "    muon_ns_variant: custom\n"                                                     /* 58 */
                          "    muon_ns_coefficients: [[[3.4445, -4.7750, 2.0315], 8], [[2, -1.5, 0.5], 2]]\n" /* 59 */
                          "    muon_ns_eps: 1.0e-6\n"                                                         /* 60 */
                          "    muon_matched_adamw_rms: 0\n"                                                   /* 61 */
                          "    muon_momentum_style: ema\n"                                                    /* 62 */
                          "    muon_comm_strategy: deredundancy\n"                                            /* 63 */
                          "    adamw_include: [\"*embed_tokens*\"]\n"                                         /* 64 */
                          "    qk_clip_enabled: true\n"                                                       /* 65 */
                          "    qk_clip_threshold: 50.5\n"                                                     /* 66 */
                          "    muon_ns_dtype: bfloat16\n"                                                     /* 67 */
                          "    muon_ns_form: standard\n"                                                      /* 68 */
                          "  adamw_config:\n"                                                                 /* 69 */
                          "    adamw_lr: 0.0003\n"                                                            /* 70 */
                          "    adamw_weight_decay: 0.1\n"                                                     /* 71 */
                          "    adamw_betas: [0.8, 0.95]\n"                                                    /* 72 */
                          "    adamw_eps: 1.0e-6\n"                                                           /* 73 */
                          "    no_weight_decay:\n"                                                            /* 74 */
                          "      - \"*bias*\"\n"                                                              /* 75 */
                          "    weight_decay_include: [\"*norm*\"]\n"                                          /* 76 */
                          "    weight_decay_exclude: [\"*lm_head*\"]\n"                                       /* 77 */
                          "  stochastic_rounding: true\n"                                                     /* 78 */
                          "  accumulate_allreduce_grads_in_fp32: true\n"                                      /* 79 */
                          "  use_fused_adamw: true\n"                                                         /* 80 */
                          "lr_scheduler:\n"                                                                   /* 81 */
                          "  type: WarmUpStableDecayLR\n"                                                     /* 82 */
                          "  warmup_ratio: 0.1\n"                                                             /* 83 */
                          "  warmup_steps: 7\n"                                                               /* 84 */
                          "  warmup_lr_init: 1.0e-6\n"                                                        /* 85 */
                          "  lr_end: 1.0e-5\n"                                                                /* 86 */
                          "  num_cycles: 2\n"                                                                 /* 87 */
                          "  decay_steps: 90\n"                                                               /* 88 */
                          "  power: 2.0\n"                                                                    /* 89 */
                          "  decay_start_steps: 60\n"                                                         /* 90 */
                          "  decay_start_ratio: 0.5\n"                                                        /* 91 */
                          "  eta_min: 1.0e-6\n"                                                               /* 92 */
                          "  t_max: 80\n"                                                                     /* 93 */
                          "  decay_ratio: 0.6\n"                                                              /* 94 */
                          "  keep_steps: 5\n"                                                                 /* 95 */
                          "  lr_end1: 2.0e-6\n"                                                               /* 96 */
                          "  final_steps: 3\n"                                                                /* 97 */
                          "  lr_end2: 1.0e-6\n"                                                               /* 98 */
                          "  t_0: 10\n"                                                                       /* 99 */
                          "  t_mult: 2\n"                                                                     /* 100 */
                          "training:\n"                                                                       /* 101 */
                          "  steps: 100\n"                                                                    /* 102 */
                          "  local_batch_size: 4\n"                                                           /* 103 */
                          "  global_batch_size: 64\n"                                                         /* 104 */
                          "  max_norm: 0.5\n"                                                                 /* 105 */
                          "  gradient_accumulation_steps: 4\n"                                                /* 106 */
                          "  no_save_rng: false\n"                                                            /* 107 */
                          "  no_load_rng: false\n"                                                            /* 108 */
                          "  load_strict: true\n"                                                             /* 109 */
                          "  save: null\n"                                                                    /* 110 */
                          "  gradient_scaling_factor: 0.5\n"                                                  /* 111 */
                          "  seed: 12345678901\n"                                                             /* 112 */
                          "  deterministic: true\n"                                                           /* 113 */
                          "  dump_state: true\n"
                          "  tensorboard: runs/full/tb\n"
                          "  trace: [2, 4]\n"
                          "  log_interval: 5\n"  /* 112 */
                          "  eval_interval: 0\n" /* 113 */
                          "  eval_batches: 3\n"  /* 114 */
                          "  sample_interval: 50\n"
                          "  sample_prompt: \"Once upon\"\n"
                          "  sample_tokens: 32\n"
                          "  plugin: [libmine.so, /opt/x/libother.so]\n" /* 115 */
                          "  loss_scale_initial: 4096\n"                 /* 116 */
                          "  loss_scale_growth_interval: 200\n"          /* 117 */
                          "  loss_scale_growth_factor: 4\n"              /* 118 */
                          "  loss_scale_backoff_factor: 0.25\n"          /* 119 */
                          "  loss_scale_hysteresis: 1\n"                 /* 120 */
                          "  loss_scale_min: 2\n"                        /* 121 */
                          "  init_model_with_meta_device: false\n"       /* 122 */
                          "  distributed_timeout_minutes: 2.5\n"         /* 123 */
                          "fsdp_config:\n"                               /* 124 */
                          "  shard_size: 2\n"                            /* 125 */
                          "  apply_modules: [\"model.layers.{*}\"]\n"    /* 126 */
                          "  hook_modules: [\"model.layers.{*}\"]\n"     /* 127 */
                          "  reshard_after_forward: false\n"             /* 128 */
                          "  prefetch: false\n"                          /* 129 */
                          "  mix_precision:\n"                           /* 130 */
                          "    param_dtype: float16\n"                   /* 131 */
                          "    reduce_dtype: bfloat16\n"                 /* 132 */
                          "    output_dtype: float32\n"                  /* 133 */
                          "    cast_forward_inputs: false\n"             /* 134 */
                          "checkpoint:\n"                                /* 135 */
                          "  output_dir: runs/full\n"                    /* 136 */
                          "  save_interval: 0\n"                         /* 137 */
                          "  save_optimizer: false\n"                    /* 138 */
                          "  keep_last: 0\n"                             /* 139 */
                          "  restore_from: latest\n"                     /* 140 */
                          "  restore_optimizer: false\n"                 /* 141 */
                          "  overwrite: true\n"                          /* 142 */
                          "  allow_changes: [data.seq_len, model.rope_theta]\n"
                          "kernels:\n" /* 143 */
                          "  backend: cpu\n"
                          "  bf16_gemm: fp32_rounded\n" /* 144 */
                          "  f16_gemm: widened\n"       /* 145 */
                          "  lm_head_chunk_mib: 0\n"
                          "parallel:\n"                 /* 146 */
                          "  tensor_parallel_size: 1\n" /* 147 */
                          "  sequence_parallel: false\n"
                          "  ring_attention_size: 1\n"   /* 148 */
                          "  ulysses_parallel_size: 1\n" /* 149 */
                          "  expert_parallel_size: 1\n"  /* 150 */
                          "  pipeline_parallel_size: 1\n"
                          "  pipeline_schedule: gpipe\n"
                          "  virtual_pipeline_model_parallel_size: 1\n"
                          "  ep_plan:\n"                                    /* 151 */
                          "    apply_modules: [\"model.layers.{*}.mlp\"]\n" /* 152 */
                          "tools:\n"                                        /* 153 */
                          "  profile:\n"                                    /* 154 */
                          "    enable: true\n"                              /* 155 */
                          "  memory_profile:\n"                             /* 156 */
                          "    enable: true\n";                             /* 157 */

static void check_full(const ht_config *cfg) {
    assert_string_equal(cfg->model.arch.name, "qwen2_moe");
    assert_string_equal(cfg->model.from_pretrained, "/models/tiny");
    assert_false(cfg->parallel.sequence_parallel);                         /* its default is true */
    assert_int_equal(cfg->parallel.pipeline_schedule, HT_CONFIG_PP_GPIPE); /* its default is 1f1b */
    const ht_moe_config *mc = &cfg->model.arch.moe;
    assert_int_equal(mc->num_experts, 4);
    assert_int_equal(mc->num_experts_per_tok, 1);
    assert_int_equal(mc->moe_intermediate_size, 24);
    assert_int_equal(mc->shared_expert_intermediate_size, 40);
    assert_true(mc->norm_topk_prob && mc->output_router_logits);
    assert_int_equal(mc->decoder_sparse_step, 2);
    assert_int_equal(mc->mlp_only_layers.count, 1);
    assert_int_equal(mc->mlp_only_layers.items[0], 0);
    assert_true(mc->router_aux_loss_coef == 0.02);
    assert_int_equal(cfg->model.arch.vocab_size, 1000);
    assert_int_equal(cfg->model.arch.hidden_size, 64);
    assert_int_equal(cfg->model.arch.intermediate_size, 128);
    assert_int_equal(cfg->model.arch.num_hidden_layers, 2);
    assert_int_equal(cfg->model.arch.num_attention_heads, 4);
    assert_int_equal(cfg->model.arch.num_key_value_heads, 4);
    assert_int_equal(cfg->model.arch.head_dim, 16);
    assert_int_equal(cfg->model.arch.max_position_embeddings, 1024);
    assert_true(cfg->model.arch.rope_theta == 500000.0);
    assert_true(cfg->model.arch.rms_norm_eps == 1e-5);
    assert_false(cfg->model.arch.attention_bias);
    assert_true(cfg->model.arch.tie_word_embeddings);
    assert_true(cfg->model.arch.initializer_range == 0.01);
    assert_int_equal(cfg->model.lora.rank, 8);
    assert_true(cfg->model.lora.alpha == 16 && cfg->model.lora.dropout == 0.05);
    assert_int_equal(cfg->model.lora.target_modules.count, 2);
    assert_string_equal(cfg->model.lora.target_modules.items[1], "model.layers.{*}.mlp.down_proj");
    assert_true(cfg->model.lora.use_rslora && cfg->model.lora.use_muon);
    assert_string_equal(cfg->model.lora.from_pretrained, "/adapters/tiny");
    assert_int_equal(cfg->model_init_dtype, HT_DTYPE_BF16);
    assert_string_equal(cfg->data.dataset_type, "token_bin");
    assert_string_equal(cfg->data.path, "data/*.bin");
    assert_int_equal(cfg->data.seq_len, 128);
    assert_true(cfg->data.valid_fraction == 0.1);
    assert_int_equal(cfg->optimizer.type, HT_CONFIG_OPTIMIZER_MUON);
    assert_false(cfg->optimizer.fp32_main_params);
    assert_true(cfg->optimizer.muon.lr == 0.03);
    assert_true(cfg->optimizer.muon.weight_decay == 0.2);
    assert_true(cfg->optimizer.muon.momentum == 0.9);
    assert_false(cfg->optimizer.muon.nesterov);
    assert_int_equal(cfg->optimizer.muon.ns_steps, 7);
    assert_int_equal(cfg->optimizer.muon.ns_variant, HT_CONFIG_NS_CUSTOM);
    const ht_config_ns_coefficients *ns = &cfg->optimizer.muon.ns_coefficients;
    assert_int_equal(ns->count, 2);
    assert_true(ns->abc[0][0] == 3.4445 && ns->abc[0][1] == -4.7750 && ns->abc[0][2] == 2.0315);
    assert_int_equal(ns->repeat[0], 8);
    assert_true(ns->abc[1][0] == 2 && ns->abc[1][1] == -1.5 && ns->abc[1][2] == 0.5);
    assert_int_equal(ns->repeat[1], 2);
    assert_true(cfg->optimizer.muon.ns_eps == 1e-6);
    assert_true(cfg->optimizer.muon.matched_adamw_rms == 0);
    assert_int_equal(cfg->optimizer.muon.momentum_style, HT_CONFIG_MOMENTUM_EMA);
    assert_int_equal(cfg->optimizer.muon.comm_strategy, HT_CONFIG_MUON_COMM_DEREDUNDANCY);
    assert_int_equal(cfg->optimizer.muon.adamw_include.count, 1);
    assert_string_equal(cfg->optimizer.muon.adamw_include.items[0], "*embed_tokens*");
    assert_true(cfg->optimizer.muon.qk_clip_enabled);
    assert_true(cfg->optimizer.muon.qk_clip_threshold == 50.5);
    assert_int_equal(cfg->optimizer.muon.ns_dtype, HT_DTYPE_BF16);
    assert_true(cfg->optimizer.stochastic_rounding);
    assert_true(cfg->optimizer.adamw.lr == 0.0003);
    assert_true(cfg->optimizer.adamw.weight_decay == 0.1);
    assert_true(cfg->optimizer.adamw.betas[0] == 0.8 && cfg->optimizer.adamw.betas[1] == 0.95);
    assert_true(cfg->optimizer.adamw.eps == 1e-6);
    assert_int_equal(cfg->optimizer.adamw.no_weight_decay.count, 1);
    assert_string_equal(cfg->optimizer.adamw.no_weight_decay.items[0], "*bias*");
    assert_int_equal(cfg->lr_scheduler.type, HT_CONFIG_LR_WARMUP_STABLE_DECAY);
    assert_true(cfg->lr_scheduler.warmup_ratio == 0.1);
    assert_int_equal(cfg->lr_scheduler.warmup_steps, 7);
    assert_true(cfg->lr_scheduler.warmup_lr_init == 1e-6);
    assert_true(cfg->lr_scheduler.lr_end == 1e-5);
    assert_true(cfg->lr_scheduler.num_cycles == 2);
    assert_int_equal(cfg->lr_scheduler.decay_steps, 90);
    assert_true(cfg->lr_scheduler.power == 2.0);
    assert_int_equal(cfg->lr_scheduler.decay_start_steps, 60);
    assert_true(cfg->lr_scheduler.decay_start_ratio == 0.5);
    assert_true(cfg->lr_scheduler.eta_min == 1e-6);
    assert_int_equal(cfg->lr_scheduler.t_max, 80);
    assert_int_equal(cfg->lr_scheduler.keep_steps, 5);
    assert_true(cfg->lr_scheduler.lr_end1 == 2.0e-6 && cfg->lr_scheduler.lr_end2 == 1.0e-6);
    assert_int_equal(cfg->lr_scheduler.final_steps, 3);
    assert_int_equal(cfg->lr_scheduler.t_0, 10);
    assert_int_equal(cfg->lr_scheduler.t_mult, 2);
    assert_int_equal(cfg->training.steps, 100);
    assert_int_equal(cfg->training.local_batch_size, 4);
    assert_int_equal(cfg->training.global_batch_size, 64);
    assert_true(cfg->training.max_norm == 0.5);
    assert_true(cfg->training.seed == 12345678901LL);
    assert_true(cfg->training.deterministic);
    assert_true(cfg->training.dump_state);
    assert_true(cfg->training.tensorboard.on);
    assert_string_equal(cfg->training.tensorboard.path, "runs/full/tb");
    assert_true(cfg->training.trace.on && cfg->training.trace.count == 2 && cfg->training.trace.items[0] == 2);
    assert_int_equal(cfg->training.log_interval, 5);
    assert_int_equal(cfg->training.eval_interval, 0);
    assert_int_equal(cfg->training.eval_batches, 3);
    assert_int_equal(cfg->training.sample_interval, 50);
    assert_string_equal(cfg->training.sample_prompt, "Once upon");
    assert_int_equal(cfg->training.sample_tokens, 32);
    assert_int_equal(cfg->training.plugin.count, 2);
    assert_string_equal(cfg->training.plugin.items[0], "libmine.so");
    assert_string_equal(cfg->training.plugin.items[1], "/opt/x/libother.so");
    assert_true(cfg->training.loss_scale_initial == 4096);
    assert_int_equal(cfg->training.loss_scale_growth_interval, 200);
    assert_true(cfg->training.loss_scale_growth_factor == 4);
    assert_true(cfg->training.loss_scale_backoff_factor == 0.25);
    assert_int_equal(cfg->training.loss_scale_hysteresis, 1);
    assert_true(cfg->training.loss_scale_min == 2);
    assert_int_equal(cfg->fsdp.shard_size, 2);
    assert_int_equal(cfg->fsdp.apply_modules.count, 1);
    assert_string_equal(cfg->fsdp.apply_modules.items[0], "model.layers.{*}");
    assert_false(cfg->fsdp.reshard_after_forward);
    assert_false(cfg->fsdp.prefetch);
    assert_false(cfg->training.init_model_with_meta_device);
    assert_true(cfg->training.distributed_timeout_minutes == 2.5);
    assert_int_equal(cfg->fsdp.param_dtype, HT_DTYPE_F16);
    assert_int_equal(cfg->fsdp.reduce_dtype, HT_DTYPE_BF16);
    assert_int_equal(cfg->fsdp.output_dtype, HT_DTYPE_F32);
    assert_false(cfg->fsdp.cast_forward_inputs);
    assert_string_equal(cfg->checkpoint.output_dir, "runs/full");
    assert_int_equal(cfg->checkpoint.save_interval, 0);
    assert_false(cfg->checkpoint.save_optimizer);
    assert_int_equal(cfg->checkpoint.keep_last, 0);
    assert_string_equal(cfg->checkpoint.restore_from, "latest");
    assert_false(cfg->checkpoint.restore_optimizer);
    assert_true(cfg->checkpoint.overwrite);
    assert_int_equal(cfg->checkpoint.allow_changes.count, 2);
    assert_string_equal(cfg->checkpoint.allow_changes.items[1], "model.rope_theta");
    assert_int_equal(cfg->kernels.bf16_gemm, HT_GEMM_KERNEL_FP32_ROUNDED);
    assert_int_equal(cfg->kernels.f16_gemm, HT_GEMM_KERNEL_WIDENED);
    assert_int_equal(cfg->kernels.lm_head_chunk_mib, 0);
}

/* The line of FULL that starts with `start` (1-based). */
static int full_line(const char *start) {
    int line = 1;
    for (const char *p = FULL; *p; line++) {
        if (strncmp(p, start, strlen(start)) == 0) return line;
        const char *nl = strchr(p, '\n');
        if (!nl) break;
        p = nl + 1;
    }
    fail_msg("no line of FULL starts with '%s'", start);
    return 0;
}

/* The keys only deepseek_v3 reads (FULL is a qwen2_moe file). */
static const char *const DEEPSEEK_KEYS[] = {
    "model.n_shared_experts",
    "model.n_group",
    "model.topk_group",
    "model.routed_scaling_factor",
    "model.first_k_dense_replace",
    "model.moe_router_bias_update_rate",
    "model.q_lora_rank",
    "model.kv_lora_rank",
    "model.qk_nope_head_dim",
    "model.qk_rope_head_dim",
    "model.v_head_dim",
    "model.rope_interleave",
    "model.multi_latent_attention",
    "model.rope_scaling.type",
    "model.rope_scaling.factor",
    "model.rope_scaling.original_max_position_embeddings",
    "model.rope_scaling.beta_fast",
    "model.rope_scaling.beta_slow",
    "model.rope_scaling.mscale",
    "model.rope_scaling.mscale_all_dim",
};

static bool is_deepseek_key(const char *key) {
    for (size_t i = 0; i < sizeof(DEEPSEEK_KEYS) / sizeof(DEEPSEEK_KEYS[0]); i++)
        if (strcmp(DEEPSEEK_KEYS[i], key) == 0) return true;
    return false;
}

/* Every DeepSeek-V3 key from a file, none at its default, by config.json's
 * names where they differ (n_routed_experts, rope_parameters), and each on
 * the wrong model an error naming the models that read it. */
static void test_deepseek_keys(void **state) {
    (void)state;
    static ht_config cfg;
    ht_error err = {0};
    const char *text = "model:\n"
                       "  name: deepseek_v3\n"
                       "  hidden_size: 64\n"
                       "  num_attention_heads: 4\n"
                       "  num_key_value_heads: 4\n"
                       "  n_routed_experts: 8\n"
                       "  num_experts_per_tok: 3\n"
                       "  moe_intermediate_size: 16\n"
                       "  n_shared_experts: 2\n"
                       "  n_group: 4\n"
                       "  topk_group: 2\n"
                       "  routed_scaling_factor: 2.5\n"
                       "  first_k_dense_replace: 1\n"
                       "  topk_bias_update_rate: 0.001\n"
                       "  q_lora_rank: 24\n"
                       "  kv_lora_rank: 16\n"
                       "  qk_nope_head_dim: 8\n"
                       "  qk_rope_head_dim: 4\n"
                       "  v_head_dim: 12\n"
                       "  rope_interleave: false\n"
                       "  multi_latent_attention: true\n"
                       "  rope_parameters:\n"
                       "    rope_type: yarn\n"
                       "    rope_theta: 50000\n"
                       "    factor: 4.0\n"
                       "    original_max_position_embeddings: 16\n"
                       "    beta_fast: 16\n"
                       "    beta_slow: 2\n"
                       "    mscale: 0.9\n"
                       "    mscale_all_dim: 0.8\n";
    assert_ht_ok(load_text("deepseek.yaml", text, &cfg, &err), &err);
    assert_ht_ok(ht_config_validate(&cfg, 1, &err), &err);
    const ht_model_config *a = &cfg.model.arch;
    assert_ht_ok(ht_model_config_validate(a, &err), &err);
    for (size_t i = 0; i < sizeof(DEEPSEEK_KEYS) / sizeof(DEEPSEEK_KEYS[0]); i++)
        if (ht_config_key_source(&cfg, DEEPSEEK_KEYS[i], NULL) != HT_CONFIG_SOURCE_FILE)
            fail_msg("%s not from the file", DEEPSEEK_KEYS[i]);
    assert_int_equal(a->moe.num_experts, 8);
    assert_int_equal(a->moe.n_shared_experts, 2);
    assert_int_equal(a->moe.n_group, 4);
    assert_int_equal(a->moe.topk_group, 2);
    assert_true(a->moe.routed_scaling_factor == 2.5);
    assert_int_equal(a->moe.first_k_dense_replace, 1);
    assert_true(a->moe.bias_update_rate == 0.001);
    assert_int_equal(a->mla.q_lora_rank, 24);
    assert_int_equal(a->mla.kv_lora_rank, 16);
    assert_int_equal(a->mla.qk_nope_head_dim, 8);
    assert_int_equal(a->mla.qk_rope_head_dim, 4);
    assert_int_equal(a->mla.v_head_dim, 12);
    assert_false(a->mla.rope_interleave);
    assert_true(ht_rope_is_yarn(&a->rope_scaling));
    assert_true(a->rope_theta == 50000);
    assert_true(a->rope_scaling.factor == 4.0 && a->rope_scaling.original_max_position_embeddings == 16);
    assert_true(a->rope_scaling.beta_fast == 16 && a->rope_scaling.beta_slow == 2);
    assert_true(a->rope_scaling.mscale == 0.9 && a->rope_scaling.mscale_all_dim == 0.8);
    /* DeepseekV3Config's defaults where the file is silent: no attention biases, normalised weights. */
    assert_false(a->attention_bias);
    assert_true(a->moe.norm_topk_prob);
    assert_false(ht_model_config_layer_is_sparse(a, 0));
    assert_true(ht_model_config_layer_is_sparse(a, 1));
    /* 1/sqrt(8 + 4), times (0.1 x 0.8 x ln 4 + 1)^2. */
    const double m = 0.1 * 0.8 * log(4.0) + 1.0;
    assert_true(fabs(ht_model_config_attention_scale(a) - m * m / sqrt(12.0)) < 1e-15);

    expect_invalid("mla_on_qwen2.yaml", "model:\n  name: qwen2\n  kv_lora_rank: 16\n", 1, "model.kv_lora_rank",
                   "applies to model.name deepseek_v3", "not to qwen2", NULL);
    expect_invalid("group_on_moe.yaml", "model:\n  name: qwen2_moe\n  num_experts: 4\n  n_group: 2\n", 1,
                   "model.n_group", "deepseek_v3", "not to qwen2_moe", NULL);
    expect_invalid("aux_on_deepseek.yaml", "model:\n  name: deepseek_v3\n  router_aux_loss_coef: 0.1\n", 1,
                   "model.router_aux_loss_coef", "applies to model.name qwen2_moe", NULL);
    expect_invalid("mla_switch.yaml", "model:\n  name: llama\n  multi_latent_attention: true\n", 1,
                   "model.multi_latent_attention", "llama has no Multi-Latent Attention", NULL);
    expect_invalid("mla_switch_off.yaml", "model:\n  name: deepseek_v3\n  multi_latent_attention: false\n", 1,
                   "model.multi_latent_attention", "deepseek_v3 has Multi-Latent Attention", NULL);
}

/* The architecture errors of DeepSeek-V3's fields, each naming its field
 * (each case's overrides on a valid file, as --set gives them). */
static void test_deepseek_arch_errors(void **state) {
    (void)state;
    const char *base = "model:\n  name: deepseek_v3\n  hidden_size: 64\n  num_attention_heads: 4\n"
                       "  num_key_value_heads: 4\n  n_routed_experts: 8\n  num_experts_per_tok: 2\n"
                       "  n_group: 4\n  topk_group: 2\n";
    const char *path = write_config("arch.yaml", base);
    const struct {
        const char *set[4], *needle;
    } cases[] = {
        {{"model.qk_rope_head_dim=5"}, "model.qk_rope_head_dim must be even"},
        {{"model.n_group=3"}, "model.n_group must be >= 1 and divide model.n_routed_experts (8)"},
        {{"model.topk_group=5"}, "model.topk_group must be between 1 and model.n_group (4)"},
        {{"model.num_experts_per_tok=5"}, "model.num_experts_per_tok (5) is more than the experts the kept groups"},
        {{"model.rope_scaling.type=yarn", "model.rope_scaling.factor=0.5"},
         "model.rope_scaling.factor must be a number >= 1"},
        {{"model.rope_scaling.type=yarn", "model.rope_scaling.original_max_position_embeddings=0"},
         "model.rope_scaling.original_max_position_embeddings must be positive"},
        {{"model.rope_scaling.type=yarn", "model.rope_scaling.beta_fast=1", "model.rope_scaling.beta_slow=2"},
         "beta_fast > beta_slow"},
        {{"model.rope_scaling.type=linear"}, "model.rope_scaling.type \"linear\" is not supported"},
        {{"model.kv_lora_rank=0"}, "model.kv_lora_rank must be positive"},
        {{"model.v_head_dim=0"}, "model.v_head_dim must be positive"},
        {{"model.routed_scaling_factor=0"}, "model.routed_scaling_factor must be a number > 0"},
        {{"model.moe_router_bias_update_rate=-1"}, "model.moe_router_bias_update_rate must be a number >= 0"},
        {{"model.attention_bias=true"}, "model.attention_bias: true is not supported for deepseek_v3"},
    };
    static ht_config cfg;
    ht_error err = {0};
    assert_ht_ok(ht_config_load(path, 0, NULL, &cfg, &err), &err);
    assert_ht_ok(ht_model_config_validate(&cfg.model.arch, &err), &err);
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        int n = 0;
        while (n < 4 && cases[i].set[n]) n++;
        assert_ht_ok(ht_config_load(path, n, (char *const *)cases[i].set, &cfg, &err), &err);
        if (ht_model_config_validate(&cfg.model.arch, &err) == HT_OK) fail_msg("no error for %s", cases[i].set[0]);
        assert_contains(err.msg, cases[i].needle);
    }
}

static void test_full_file(void **state) {
    (void)state;
    static ht_config cfg;
    ht_error err = {0};
    assert_ht_ok(load_text("full.yaml", FULL, &cfg, &err), &err);
    check_full(&cfg);
    assert_ht_ok(ht_config_validate(&cfg, 4, &err), &err);
    /* Every key but the rejected one and DeepSeek-V3's (test_deepseek_keys)
     * came from the file, with its line. */
    for (int i = 0; i < ht_config_key_count(); i++) {
        const char *key = ht_config_key_name(i);
        if (strcmp(key, "lr_scheduler.total_steps") == 0 || is_deepseek_key(key)) continue;
        int line = 0;
        if (ht_config_key_source(&cfg, key, &line) != HT_CONFIG_SOURCE_FILE) fail_msg("%s not from the file", key);
        int lines = 0;
        for (const char *c = FULL; *c; c++) lines += *c == '\n';
        assert_true(line >= 3 && line <= lines);
    }
    assert_source(&cfg, "model.name", HT_CONFIG_SOURCE_FILE, full_line("  name: qwen2_moe"));
    assert_source(&cfg, "optimizer.muon_config.muon_ns_coefficients", HT_CONFIG_SOURCE_FILE,
                  full_line("    muon_ns_coefficients:"));
    assert_source(&cfg, "optimizer.adamw_config.no_weight_decay", HT_CONFIG_SOURCE_FILE,
                  full_line("    no_weight_decay:"));
    assert_source(&cfg, "optimizer.stochastic_rounding", HT_CONFIG_SOURCE_FILE, full_line("  stochastic_rounding:"));
    assert_source(&cfg, "training.loss_scale_min", HT_CONFIG_SOURCE_FILE, full_line("  loss_scale_min:"));
    assert_source(&cfg, "checkpoint.restore_optimizer", HT_CONFIG_SOURCE_FILE, full_line("  restore_optimizer:"));
    /* warmup_ratio was given, so it wins; decay_start_steps was given, so it wins. */
    assert_int_equal(ht_config_warmup_steps(&cfg), 10);
    assert_int_equal(ht_config_decay_start_steps(&cfg), 60);
    /* decay_ratio was given, so it wins over decay_steps: floor(100 * 0.6). */
    assert_int_equal(ht_config_decay_steps(&cfg), 60);
    assert_true(ht_config_lr_end2(&cfg) == 1.0e-6);
}

/* Every key's formatted value reads back, through --set, as the same value. */
static void test_format_roundtrip(void **state) {
    (void)state;
    static ht_config full, back;
    ht_error err = {0};
    assert_ht_ok(load_text("roundtrip.yaml", FULL, &full, &err), &err);
    ht_config_defaults(&back);
    for (int i = 0; i < ht_config_key_count(); i++) {
        const char *key = ht_config_key_name(i);
        if (strcmp(key, "lr_scheduler.total_steps") == 0) continue;
        char value[4096], assignment[4400], again[4096];
        assert_true(ht_config_format_value(&full, key, value, sizeof(value)));
        snprintf(assignment, sizeof(assignment), "%s=%s", key, value);
        assert_ht_ok(ht_config_set(&back, assignment, &err), &err);
        assert_true(ht_config_format_value(&back, key, again, sizeof(again)));
        assert_string_equal(value, again);
        assert_source(&back, key, HT_CONFIG_SOURCE_CLI, 0);
    }
    check_full(&back);
    /* And strings that need quoting survive too. */
    assert_ht_ok(ht_config_set(&back, "data.path=\"a: b #c\"", &err), &err);
    char value[256];
    ht_config_format_value(&back, "data.path", value, sizeof(value));
    assert_string_equal(value, "\"a: b #c\"");
    assert_ht_ok(ht_config_set(&back, "training.plugin=[\"a\\\"b\\\\c\\td\"]", &err), &err);
    assert_string_equal(back.training.plugin.items[0], "a\"b\\c\td");
    char again[256], assignment[300];
    ht_config_format_value(&back, "training.plugin", value, sizeof(value));
    snprintf(assignment, sizeof(assignment), "training.plugin=%s", value);
    assert_ht_ok(ht_config_set(&back, assignment, &err), &err);
    ht_config_format_value(&back, "training.plugin", again, sizeof(again));
    assert_string_equal(value, again);
    assert_string_equal(back.training.plugin.items[0], "a\"b\\c\td");
    assert_ht_ok(ht_config_set(&back, "data.path=\"123\"", &err), &err);
    assert_string_equal(back.data.path, "123");
    ht_config_format_value(&back, "data.path", value, sizeof(value));
    assert_string_equal(value, "\"123\"");
    assert_true(ht_config_format_value(&back, "model.rope_theta", value, sizeof(value)));
    assert_string_equal(value, "500000.0");
    ht_config_defaults(&back); /* floats stay YAML 1.1 floats (a dot before the exponent) */
    ht_config_format_value(&back, "model.rms_norm_eps", value, sizeof(value));
    assert_string_equal(value, "1.0e-06");
    ht_config_format_value(&back, "optimizer.adamw_config.adamw_lr", value, sizeof(value));
    assert_string_equal(value, "0.001");
    assert_false(ht_config_format_value(&back, "model.nope", value, sizeof(value)));
}

/* ---------------------------------------------------------------- file-level errors */

static void test_missing_file(void **state) {
    (void)state;
    static ht_config cfg;
    ht_error err = {0};
    assert_int_equal(ht_config_load("/nonexistent/dir/cfg.yaml", 0, NULL, &cfg, &err), HT_ERR_IO);
    assert_contains(err.msg, "/nonexistent/dir/cfg.yaml");
    assert_contains(err.msg, "cannot open");
    assert_contains(err.msg, "expected a readable YAML file");
}

static void test_not_yaml(void **state) {
    (void)state;
    expect_load_error("bad.yaml", "model:\n  name: qwen2\n  vocab_size: [1, 2\ntraining:\n  steps: 3\n",
                      "bad.yaml:", "not valid YAML", NULL);
    expect_load_error("tabs.yaml", "training:\n\tsteps: 3\n", "tabs.yaml:2:", "not valid YAML", NULL);
    expect_load_error("colon.yaml", "training:\n  steps: 3\n  max_norm: 1: 2\n", "colon.yaml:3:", "not valid YAML",
                      NULL);
    expect_load_error("two.yaml", "training:\n  steps: 3\n---\ntraining:\n  steps: 4\n",
                      "two.yaml:4:", "second YAML document", NULL);
}

static void test_empty_file(void **state) {
    (void)state;
    expect_load_error("empty.yaml", "", "empty.yaml", "empty", "expected a mapping", NULL);
    expect_load_error("comments.yaml", "# nothing here\n\n", "comments.yaml", "empty", NULL);
}

static void test_top_level_not_mapping(void **state) {
    (void)state;
    expect_load_error("seq.yaml", "- model\n- training\n", "seq.yaml:1:", "top level", "expected a mapping",
                      "found a sequence", NULL);
    expect_load_error("scalar.yaml", "hello\n", "scalar.yaml:1:", "top level", "found \"hello\" (a string)", NULL);
}

static void test_unknown_key(void **state) {
    (void)state;
    expect_load_error("typo.yaml", "training:\n  steps: 10\n  stpes: 10\n", "typo.yaml:3:", "training.stpes",
                      "unknown key", "did you mean training.steps?", NULL);
    expect_load_error("section.yaml", "trainng:\n  steps: 10\n", "section.yaml:1:", "trainng", "did you mean training?",
                      NULL);
    expect_load_error("nested.yaml", "optimizer:\n  muon_config:\n    muon_lrr: 0.1\n",
                      "nested.yaml:3:", "optimizer.muon_config.muon_lrr", "did you mean optimizer.muon_config.muon_lr?",
                      NULL);
    expect_load_error("far.yaml", "training:\n  completely_unrelated: 1\n",
                      "far.yaml:2:", "training.completely_unrelated", "unknown key",
                      "expected one of: steps, local_batch_size", NULL);
    expect_load_error("top.yaml", "wandb:\n  project: x\n", "top.yaml:1:", "wandb", "unknown key",
                      "expected one of: model, model_init_dtype, data, parallel, optimizer", NULL);
    /* A section where a key belongs, and a key where a section belongs. */
    expect_load_error("notsec.yaml", "training: 5\n", "notsec.yaml:1:", "training",
                      "expected a mapping (a section of keys), found 5 (an integer)", NULL);
    expect_load_error("notkey.yaml", "training:\n  steps:\n    value: 3\n", "notkey.yaml:2:", "training.steps",
                      "expected an integer, found a mapping", NULL);
    /* An empty section is fine. */
    static ht_config cfg;
    ht_error err = {0};
    assert_ht_ok(load_text("emptysec.yaml", "training:\ncheckpoint:\n", &cfg, &err), &err);
}

static void test_wrong_types(void **state) {
    (void)state;
    expect_load_error("t1.yaml", "training:\n  steps: \"ten\"\n", "t1.yaml:2:", "training.steps", "expected an integer",
                      "found \"ten\" (a string)", NULL);
    expect_load_error("t2.yaml", "training:\n  steps: 1.5\n", "t2.yaml:2:", "training.steps", "expected an integer",
                      "found 1.5 (a float)", NULL);
    expect_load_error("t3.yaml", "training:\n  seed: 1\n  max_norm: [1]\n", "t3.yaml:3:", "training.max_norm",
                      "expected a finite number", "found a sequence", NULL);
    expect_load_error("t4.yaml", "training:\n  deterministic: yes\n", "t4.yaml:2:", "training.deterministic",
                      "expected true or false", "found \"yes\" (a string)", NULL);
    expect_load_error("t5.yaml", "training:\n  deterministic: 1\n", "t5.yaml:2:", "expected true or false",
                      "found 1 (an integer)", NULL);
    expect_load_error("t6.yaml", "fsdp_config:\n  mix_precision:\n    param_dtype: fp8\n",
                      "t6.yaml:3:", "fsdp_config.mix_precision.param_dtype",
                      "expected one of float16, bfloat16, float32", "found \"fp8\"", NULL);
    expect_load_error("t7.yaml", "fsdp_config:\n  mix_precision:\n    output_dtype: null\n",
                      "t7.yaml:3:", "fsdp_config.mix_precision.output_dtype", "found null", NULL);
    expect_load_error("t8.yaml", "model_init_dtype: int32\n", "t8.yaml:1:", "model_init_dtype",
                      "expected one of float16, bfloat16, float32, null", "found \"int32\"", NULL);
    expect_load_error("t9.yaml", "optimizer:\n  _target_: SGD\n", "t9.yaml:2:", "optimizer._target_",
                      "expected one of Muon, AdamW", "found \"SGD\"", NULL);
    expect_load_error("t10.yaml", "optimizer:\n  adamw_config:\n    adamw_betas: [0.9]\n",
                      "t10.yaml:3:", "optimizer.adamw_config.adamw_betas", "expected a list of 2 numbers",
                      "found a sequence", NULL);
    expect_load_error("t11.yaml", "fsdp_config:\n  shard_size: 0\n", "t11.yaml:2:", "fsdp_config.shard_size",
                      "expected auto or a positive integer", "found 0 (an integer)", NULL);
    expect_load_error("t12.yaml", "training:\n  steps: 99999999999\n", "t12.yaml:2:", "expected an integer",
                      "found 99999999999 (an integer)", NULL);
    expect_load_error("t13.yaml", "model:\n  name: a_model_name_far_longer_than_thirty_one_bytes\n",
                      "t13.yaml:2:", "model.name", "expected a string of at most 31 bytes", NULL);
    expect_load_error("t14.yaml", "training:\n  max_norm: .inf\n", "t14.yaml:2:", "expected a finite number",
                      "found .inf (a float)", NULL);
    expect_load_error("t15.yaml", "optimizer:\n  muon_config:\n    muon_ns_coefficients: [1, 2]\n",
                      "t15.yaml:3:", "optimizer.muon_config.muon_ns_coefficients", "expected null, [a, b, c]", NULL);
    /* A schedule of the right form with a wrong value says which, not "found a sequence". */
    expect_load_error("t15b.yaml", "optimizer:\n  muon_config:\n    muon_ns_coefficients: [[[3.4, -4.7, 2.0], 0]]\n",
                      "t15b.yaml:3:", "segment 0 repeats 0 times; expected 1 to 100", NULL);
    expect_load_error(
        "t15c.yaml", "optimizer:\n  muon_config:\n    muon_ns_coefficients: [[[3, -4, 2], 2], [[3.4, .nan, 2.0], 2]]\n",
        "t15c.yaml:3:", "segment 1: every coefficient must be a finite number", NULL);
    expect_load_error("t15d.yaml",
                      "optimizer:\n  muon_config:\n    muon_ns_coefficients: [[[3.4, -4.7, 2.0], 1000000000]]\n",
                      "t15d.yaml:3:", "segment 0 repeats 1000000000 times", NULL);
    expect_load_error("t16.yaml", "lr_scheduler:\n  type: CosineLR\n", "t16.yaml:2:", "lr_scheduler.type",
                      "expected one of ConstantWarmUpLR, LinearWithWarmUpLR, CosineWithWarmUpLR, "
                      "CosineWithRestartsAndWarmUpLR, PolynomialWithWarmUpLR, WarmUpStableDecayLR, CosineAnnealingLR",
                      "found \"CosineLR\"", NULL);
    expect_load_error("t17.yaml", "data:\n  path: null\n", "t17.yaml:2:", "data.path", "found null", NULL);
    expect_load_error("t18.yaml", "training:\n  plugin: libx.so\n", "t18.yaml:2:", "training.plugin",
                      "expected a list of at most 16 strings", "found \"libx.so\" (a string)", NULL);
    expect_load_error("t18b.yaml", "kernels:\n  lm_head_chunk_mib: -1\n", "t18b.yaml:2:", "kernels.lm_head_chunk_mib",
                      "expected auto or an integer >= 0", "found -1 (an integer)", NULL);
    expect_load_error("t18c.yaml", "kernels:\n  lm_head_chunk_mib: automatic\n",
                      "t18c.yaml:2:", "expected auto or an integer >= 0", "found \"automatic\"", NULL);
    /* total_steps is known only to be refused. */
    expect_load_error("t19.yaml", "lr_scheduler:\n  total_steps: 100\n", "t19.yaml:2:", "lr_scheduler.total_steps",
                      "total steps come from training.steps", NULL);
}

static void test_duplicate_key(void **state) {
    (void)state;
    expect_load_error("dup.yaml", "training:\n  steps: 10\n  seed: 1\n  steps: 20\n", "dup.yaml:4:", "training.steps",
                      "duplicate key", "line 2", NULL);
    expect_load_error("dupsec.yaml", "training:\n  steps: 10\nmodel:\n  name: qwen2\ntraining:\n  seed: 1\n",
                      "dupsec.yaml:5:", "training", "duplicate key", "line 1", NULL);
    /* Two spellings of one key (an alias and its canonical name). */
    expect_load_error("dupalias.yaml", "optimizer:\n  _target_: Muon\n  type: AdamW\n",
                      "dupalias.yaml:3:", "optimizer.type", "duplicate key",
                      "optimizer._target_ was already set on line 2", NULL);
}

/* ---------------------------------------------------------------- --set */

static void test_set_overrides(void **state) {
    (void)state;
    static ht_config cfg;
    ht_error err = {0};
    const char *path = write_config("set.yaml", "training:\n  steps: 10\n  seed: 7\nmodel_init_dtype: bfloat16\n");
    char *overrides[] = {
        "training.steps=500",
        "optimizer.adamw_config.adamw_betas=[0.8, 0.9]",
        "model_init_dtype=null",
        "checkpoint.restore_from=latest",
        "training.plugin=[a.so, \"b c.so\"]",
        "optimizer.type=AdamW",
        "optimizer.muon_config.muon_ns_coefficients=[3.4445, -4.775, 2.0315]",
        "model.from_pretrained=",
        "training.steps=600",
    };
    int n = (int)(sizeof(overrides) / sizeof(overrides[0]));
    assert_ht_ok(ht_config_load(path, n, overrides, &cfg, &err), &err);
    assert_int_equal(cfg.training.steps, 600); /* the last --set wins */
    assert_true(cfg.optimizer.adamw.betas[0] == 0.8 && cfg.optimizer.adamw.betas[1] == 0.9);
    assert_int_equal(cfg.model_init_dtype, HT_CONFIG_DTYPE_NONE);
    assert_string_equal(cfg.checkpoint.restore_from, "latest");
    assert_int_equal(cfg.training.plugin.count, 2);
    assert_string_equal(cfg.training.plugin.items[1], "b c.so");
    assert_int_equal(cfg.optimizer.type, HT_CONFIG_OPTIMIZER_ADAMW);
    assert_int_equal(cfg.optimizer.muon.ns_coefficients.count, 1);
    assert_int_equal(cfg.optimizer.muon.ns_coefficients.repeat[0], 0);
    assert_string_equal(cfg.model.from_pretrained, "");
    assert_int_equal(cfg.training.seed, 7);

    assert_source(&cfg, "training.steps", HT_CONFIG_SOURCE_CLI, 0);
    assert_source(&cfg, "training.seed", HT_CONFIG_SOURCE_FILE, 3);
    assert_source(&cfg, "model_init_dtype", HT_CONFIG_SOURCE_CLI, 0);
    assert_source(&cfg, "optimizer._target_", HT_CONFIG_SOURCE_CLI, 0);
    assert_source(&cfg, "optimizer.type", HT_CONFIG_SOURCE_CLI, 0); /* an alias answers for its key */
    assert_source(&cfg, "training.max_norm", HT_CONFIG_SOURCE_DEFAULT, 0);
    assert_source(&cfg, "data.path", HT_CONFIG_SOURCE_DEFAULT, 0);
    assert_string_equal(ht_config_source_name(HT_CONFIG_SOURCE_CLI), "command line");
}

/* CosineWithRestartsAndWarmUpLR's num_cycles defaults to whole cycles (1.0) in every dialect, the other
 * cosines' to a half wave (0.5); a value given stays. ht_config_validate_lr_scheduler checks the schedule
 * alone (what hypertrain.lr_scheduler checks from Python). */
static void test_schedule_defaults(void **state) {
    (void)state;
    static ht_config cfg;
    ht_error err = {0};
    char *restarts[] = {"lr_scheduler.type=CosineWithRestartsAndWarmUpLR"};
    assert_ht_ok(ht_config_load(NULL, 1, restarts, &cfg, &err), &err);
    assert_true(cfg.lr_scheduler.num_cycles == 1.0);
    assert_source(&cfg, "lr_scheduler.num_cycles", HT_CONFIG_SOURCE_DEFAULT, 0);
    char *cosine[] = {"lr_scheduler.type=CosineWithWarmUpLR"};
    assert_ht_ok(ht_config_load(NULL, 1, cosine, &cfg, &err), &err);
    assert_true(cfg.lr_scheduler.num_cycles == 0.5);
    char *given[] = {"lr_scheduler.type=CosineWithRestartsAndWarmUpLR", "lr_scheduler.num_cycles=0.5"};
    assert_ht_ok(ht_config_load(NULL, 2, given, &cfg, &err), &err);
    assert_true(cfg.lr_scheduler.num_cycles == 0.5);
    assert_ht_ok(ht_config_validate_lr_scheduler(&cfg, &err), &err);
    char *cooldown[] = {"lr_scheduler.type=ConstantWithCoolDownLR", "training.steps=10"};
    assert_ht_ok(ht_config_load(NULL, 2, cooldown, &cfg, &err), &err);
    assert_int_equal(ht_config_validate_lr_scheduler(&cfg, &err), HT_ERR_CONFIG);
    assert_contains(err.msg, "set lr_scheduler.decay_steps or lr_scheduler.decay_ratio");
    char *restarts_t0[] = {"lr_scheduler.type=CosineAnnealingWarmRestarts", "training.steps=10"};
    assert_ht_ok(ht_config_load(NULL, 2, restarts_t0, &cfg, &err), &err);
    assert_int_equal(ht_config_validate_lr_scheduler(&cfg, &err), HT_ERR_CONFIG);
    assert_contains(err.msg, "lr_scheduler.t_0");
}

static void expect_set_error(const char *assignment, ...) {
    static ht_config cfg, before;
    ht_error err = {0};
    ht_config_defaults(&cfg);
    before = cfg;
    ht_status st = ht_config_set(&cfg, assignment, &err);
    if (st == HT_OK) fail_msg("expected --set %s to fail", assignment);
    assert_int_equal(st, HT_ERR_CONFIG);
    assert_memory_equal(&cfg, &before, sizeof(cfg)); /* a failed --set changes nothing */
    va_list ap;
    va_start(ap, assignment);
    for (const char *needle = va_arg(ap, const char *); needle; needle = va_arg(ap, const char *))
        assert_contains(err.msg, needle);
    va_end(ap);
}

static void test_set_errors(void **state) {
    (void)state;
    expect_set_error("training.stpes=5", "--set training.stpes=5", "unknown key", "did you mean training.steps?", NULL);
    expect_set_error("training.steps=ten", "--set training.steps=ten", "training.steps", "expected an integer",
                     "found \"ten\" (a string)", NULL);
    expect_set_error("training.steps=2.5", "expected an integer", "found 2.5 (a float)", NULL);
    expect_set_error("training.steps", "--set training.steps", "expected section.key=value", "no '='", NULL);
    expect_set_error("=5", "expected section.key=value", "no key", NULL);
    expect_set_error("training=5", "--set training=5", "training is a section", "steps", NULL);
    expect_set_error("training.steps=[1", "--set training.steps=[1", "not valid YAML", NULL);
    expect_set_error("training.plugin=a.so", "expected a list", NULL);
    expect_set_error("optimizer.adamw_config.adamw_betas=[0.9, x]", "expected a list of 2 numbers", NULL);
    expect_set_error("fsdp_config.mix_precision.param_dtype=float64", "expected one of float16, bfloat16, float32",
                     "found \"float64\"", NULL);
    expect_set_error("lr_scheduler.total_steps=10", "lr_scheduler.total_steps", "total steps come from training.steps",
                     NULL);
    /* A bad --set in ht_config_load names the argument too. */
    static ht_config cfg;
    ht_error err = {0};
    char *bad[] = {"training.steps=4", "training.deterministic=maybe"};
    assert_int_equal(ht_config_load(NULL, 2, bad, &cfg, &err), HT_ERR_CONFIG);
    assert_contains(err.msg, "--set training.deterministic=maybe");
    assert_contains(err.msg, "expected true or false");
}

/* A switch that may name a directory (training.tensorboard): true, false,
 * null (false) or a path, ~ expanded as the other path keys'; an empty
 * string, a number or a list is refused; the value formats back. One that
 * may name steps (training.trace): true, false or a list of steps >= 1. */
static void test_switch_keys(void **state) {
    (void)state;
    static ht_config cfg;
    ht_error err = {0};
    char value[HT_CONFIG_STR_MAX + 8];
    ht_config_defaults(&cfg);
    assert_false(cfg.training.tensorboard.on);
    assert_ht_ok(ht_config_set(&cfg, "training.tensorboard=true", &err), &err);
    assert_true(cfg.training.tensorboard.on);
    assert_string_equal(cfg.training.tensorboard.path, "");
    assert_true(ht_config_format_value(&cfg, "training.tensorboard", value, sizeof(value)));
    assert_string_equal(value, "true");
    assert_ht_ok(ht_config_set(&cfg, "training.tensorboard=runs/tb", &err), &err);
    assert_true(cfg.training.tensorboard.on);
    assert_string_equal(cfg.training.tensorboard.path, "runs/tb");
    assert_true(ht_config_format_value(&cfg, "training.tensorboard", value, sizeof(value)));
    assert_string_equal(value, "\"runs/tb\"");
    assert_ht_ok(ht_config_set(&cfg, "training.tensorboard=\"true\"", &err), &err); /* a directory named true */
    assert_string_equal(cfg.training.tensorboard.path, "true");
    const char *home = getenv("HOME");
    if (home && home[0]) {
        char want[HT_CONFIG_STR_MAX + 8];
        snprintf(want, sizeof(want), "%s/tb", home);
        assert_ht_ok(ht_config_set(&cfg, "training.tensorboard=~/tb", &err), &err);
        assert_string_equal(cfg.training.tensorboard.path, want);
    }
    assert_ht_ok(ht_config_set(&cfg, "training.tensorboard=null", &err), &err);
    assert_false(cfg.training.tensorboard.on);
    expect_set_error("training.tensorboard=\"\"", "training.tensorboard", "expected true, false or a directory", NULL);
    expect_set_error("training.tensorboard=3", "expected true, false or a directory", NULL);
    expect_set_error("training.tensorboard=[a]", "expected true, false or a directory", NULL);
    expect_set_error("training.tensorboard=$HOME/tb", "names an environment variable", NULL);
    /* training.trace: true (every step), false, null, or the steps. */
    assert_false(cfg.training.trace.on);
    assert_ht_ok(ht_config_set(&cfg, "training.trace=true", &err), &err);
    assert_true(cfg.training.trace.on && cfg.training.trace.count == 0);
    assert_ht_ok(ht_config_set(&cfg, "training.trace=[3, 10]", &err), &err);
    assert_true(cfg.training.trace.on && cfg.training.trace.count == 2 && cfg.training.trace.items[1] == 10);
    assert_true(ht_config_format_value(&cfg, "training.trace", value, sizeof(value)));
    assert_string_equal(value, "[3, 10]");
    assert_ht_ok(ht_config_set(&cfg, "training.trace=false", &err), &err);
    assert_false(cfg.training.trace.on);
    expect_set_error("training.trace=[0]", "training.trace", "expected true, false or a list of at most 64 steps",
                     NULL);
    expect_set_error("training.trace=[]", "expected true, false or a list", NULL);
    expect_set_error("training.trace=5", "expected true, false or a list", NULL);
}

/* Path keys as a shell takes them: ~ and ~/x are $HOME's (a run never makes
 * a directory named "~"), ~user that user's home; $HOME/x is refused, as YAML
 * expands no variables (never a literal "$HOME" directory); a "\0" escape
 * is refused, never cut short. Every path key, in the file and by --set. */
static void test_paths_as_a_shell_takes_them(void **state) {
    (void)state;
    static ht_config cfg;
    ht_error err = {0};
    const char *home = getenv("HOME");
    assert_non_null(home);
    char want[1200], text[2000];
    assert_ht_ok(load_text("tilde.yaml",
                           "checkpoint:\n  output_dir: ~/runs/x\n  restore_from: \"~\"\ndata:\n  path: \"~/c.txt\"\n"
                           "training:\n  plugin: [~/a.so, b~/c.so]\nmodel:\n  from_pretrained: ~root/m\n",
                           &cfg, &err),
                 &err);
    snprintf(want, sizeof(want), "%s/runs/x", home);
    assert_string_equal(cfg.checkpoint.output_dir, want);
    assert_string_equal(cfg.checkpoint.restore_from, home);
    snprintf(want, sizeof(want), "%s/c.txt", home);
    assert_string_equal(cfg.data.path, want);
    snprintf(want, sizeof(want), "%s/a.so", home);
    assert_string_equal(cfg.training.plugin.items[0], want);
    assert_string_equal(cfg.training.plugin.items[1], "b~/c.so"); /* only a leading ~ */
    struct passwd *root = getpwnam("root");
    if (root) {
        snprintf(want, sizeof(want), "%s/m", root->pw_dir);
        assert_string_equal(cfg.model.from_pretrained, want);
    }
    char *set[] = {"checkpoint.output_dir=~/y"};
    assert_ht_ok(ht_config_load(NULL, 1, set, &cfg, &err), &err);
    snprintf(want, sizeof(want), "%s/y", home);
    assert_string_equal(cfg.checkpoint.output_dir, want);
    /* Only path keys: a name keeps its ~. */
    char *name[] = {"model.name=~x"};
    assert_ht_ok(ht_config_load(NULL, 1, name, &cfg, &err), &err);
    assert_string_equal(cfg.model.arch.name, "~x");
    expect_load_error("nouser.yaml", "checkpoint:\n  output_dir: ~no_such_user_here/x\n", "checkpoint.output_dir",
                      "~no_such_user_here/x: no such user", NULL);
    expect_load_error("dollar.yaml", "checkpoint:\n  output_dir: $HOME/x\n", "checkpoint.output_dir",
                      "$HOME/x names an environment variable", NULL);
    expect_load_error("dollar2.yaml", "data:\n  path: /data/${USER}/c.txt\n", "data.path", "environment variable",
                      NULL);
    expect_load_error("dollar3.yaml", "training:\n  plugin: [$PWD/p.so]\n", "training.plugin", NULL);
    expect_set_error("checkpoint.output_dir=$HOME/x", "--set checkpoint.output_dir=$HOME/x", "environment variable",
                     NULL);
    assert_ht_ok(load_text("price.yaml", "data:\n  path: /data/cost$5.txt\n", &cfg, &err), &err); /* not a name */
    snprintf(text, sizeof(text), "checkpoint:\n  output_dir: \"runs/a\\0b\"\n");
    expect_load_error("nul.yaml", text, "checkpoint.output_dir", NULL);
}

/* ---------------------------------------------------------------- validation */

/* The seed's case 5 in HyperParallel's own dialect (an optimizer _target_ of
 * hyper_parallel...): its defaults are fp32_main_params false and no
 * reduce_dtype; with fp32_main_params true, reduce_dtype absent or bfloat16
 * is an error naming both keys, never filled in. hypertrain's own dialect
 * keeps its defaults (true, float32). */
static void test_hyperparallel_defaults(void **state) {
    (void)state;
    static ht_config cfg;
    ht_error err = {0};
    const char *hp = "optimizer:\n"
                     "  _target_: hyper_parallel.auto_models.components.optim.optimizer.optimizer.AdamW\n";
    assert_ht_ok(load_text("hp.yaml", hp, &cfg, &err), &err);
    assert_int_equal(cfg.dialect, HT_CONFIG_DIALECT_HYPERPARALLEL);
    assert_false(cfg.optimizer.fp32_main_params);
    assert_int_equal(cfg.fsdp.reduce_dtype, HT_CONFIG_DTYPE_NONE);
    assert_ht_ok(ht_config_validate(&cfg, 1, &err), &err);
    char text[512];
    snprintf(text, sizeof(text), "%s  fp32_main_params: true\n", hp);
    assert_ht_ok(load_text("hp_absent.yaml", text, &cfg, &err), &err);
    assert_int_equal(ht_config_validate(&cfg, 1, &err), HT_ERR_CONFIG);
    assert_contains(err.msg, "fsdp_config.mix_precision.reduce_dtype");
    assert_contains(err.msg, "hp_absent.yaml:3: optimizer.fp32_main_params");
    assert_int_equal(cfg.fsdp.reduce_dtype, HT_CONFIG_DTYPE_NONE); /* never filled in */
    snprintf(text, sizeof(text),
             "%s  fp32_main_params: true\nfsdp_config:\n  mix_precision:\n    reduce_dtype: bfloat16\n", hp);
    assert_ht_ok(load_text("hp_bf16.yaml", text, &cfg, &err), &err);
    assert_int_equal(ht_config_validate(&cfg, 1, &err), HT_ERR_CONFIG);
    assert_contains(err.msg, "hp_bf16.yaml:6: fsdp_config.mix_precision.reduce_dtype");
    assert_contains(err.msg, "optimizer.fp32_main_params");
    assert_contains(err.msg, "found bfloat16");
    /* hypertrain's spelling: its own defaults. */
    assert_ht_ok(load_text("own.yaml", "optimizer:\n  _target_: AdamW\n", &cfg, &err), &err);
    assert_int_equal(cfg.dialect, HT_CONFIG_DIALECT_HYPERTRAIN);
    assert_true(cfg.optimizer.fp32_main_params);
    assert_int_equal(cfg.fsdp.reduce_dtype, HT_DTYPE_F32);
}

static void test_fp32_main_params_rule(void **state) {
    (void)state;
    static ht_config cfg;
    ht_error err = {0};
    const char *text = "optimizer:\n"
                       "  fp32_main_params: true\n"
                       "fsdp_config:\n"
                       "  mix_precision:\n"
                       "    param_dtype: bfloat16\n"
                       "    reduce_dtype: bfloat16\n";
    assert_ht_ok(load_text("fp32.yaml", text, &cfg, &err), &err);
    assert_int_equal(ht_config_validate(&cfg, 1, &err), HT_ERR_CONFIG);
    assert_contains(err.msg, "fp32.yaml:6: fsdp_config.mix_precision.reduce_dtype");
    assert_contains(err.msg, "optimizer.fp32_main_params");
    assert_contains(err.msg, "fp32.yaml:2:");
    assert_contains(err.msg, "expected float32");
    assert_contains(err.msg, "found bfloat16");
    assert_int_equal(cfg.fsdp.reduce_dtype, HT_DTYPE_BF16); /* never rewritten */
    assert_true(cfg.optimizer.fp32_main_params);

    /* Explicitly null: "missing". */
    const char *missing = "fsdp_config:\n  mix_precision:\n    reduce_dtype: null\n";
    assert_ht_ok(load_text("fp32null.yaml", missing, &cfg, &err), &err);
    assert_int_equal(cfg.fsdp.reduce_dtype, HT_CONFIG_DTYPE_NONE);
    assert_int_equal(ht_config_validate(&cfg, 1, &err), HT_ERR_CONFIG);
    assert_contains(err.msg, "fp32null.yaml:3: fsdp_config.mix_precision.reduce_dtype");
    assert_contains(err.msg, "optimizer.fp32_main_params (default)");
    assert_contains(err.msg, "found null (missing)");
    assert_int_equal(cfg.fsdp.reduce_dtype, HT_CONFIG_DTYPE_NONE);

    /* Via --set, and allowed once fp32_main_params is off. */
    char *set[] = {"fsdp_config.mix_precision.reduce_dtype=float16"};
    assert_ht_ok(ht_config_load(NULL, 1, set, &cfg, &err), &err);
    assert_int_equal(ht_config_validate(&cfg, 1, &err), HT_ERR_CONFIG);
    assert_contains(err.msg, "fsdp_config.mix_precision.reduce_dtype (--set)");
    assert_contains(err.msg, "optimizer.fp32_main_params");
    assert_ht_ok(ht_config_set(&cfg, "optimizer.fp32_main_params=false", &err), &err);
    assert_ht_ok(ht_config_validate(&cfg, 1, &err), &err);
    assert_ht_ok(ht_config_set(&cfg, "fsdp_config.mix_precision.reduce_dtype=null", &err), &err);
    assert_ht_ok(ht_config_validate(&cfg, 1, &err), &err);
}

static void test_validation_rules(void **state) {
    (void)state;
    expect_invalid("v1.yaml", "training:\n  max_norm: 0\n", 1, "v1.yaml:2: training.max_norm", "expected a number > 0",
                   "found 0.0", NULL);
    expect_invalid("v2.yaml", "training:\n  max_norm: -1.5\n", 1, "v2.yaml:2: training.max_norm", "found -1.5", NULL);
    expect_invalid("v3.yaml", "training:\n  local_batch_size: 0\n", 1, "v3.yaml:2: training.local_batch_size",
                   "expected an integer > 0", "found 0", NULL);
    expect_invalid("v4.yaml", "training:\n  global_batch_size: -8\n", 1, "v4.yaml:2: training.global_batch_size",
                   "found -8", NULL);
    expect_invalid("v5.yaml", "training:\n  steps: 0\n", 1, "v5.yaml:2: training.steps", "found 0", NULL);
    expect_invalid("v6.yaml", "data:\n  seq_len: 0\n", 1, "v6.yaml:2: data.seq_len", "expected an integer > 0", NULL);
    expect_invalid("v7.yaml", "training:\n  local_batch_size: 8\n  global_batch_size: 24\n", 2,
                   "v7.yaml:3: training.global_batch_size", "multiple of", "8 x 2 = 16", "found 24", NULL);
    expect_invalid("v8.yaml", "optimizer:\n  muon_config:\n    muon_ns_variant: asym5\n    muon_ns_steps: 6\n", 1,
                   "v8.yaml:4: optimizer.muon_config.muon_ns_steps", "at most 5 with muon_ns_variant asym5",
                   "v8.yaml:3: optimizer.muon_config.muon_ns_variant", "found 6", NULL);
    expect_invalid("v9.yaml",
                   "optimizer:\n  _target_: AdamW\n  adamw_config:\n    adamw_lr: 0.001\n"
                   "lr_scheduler:\n  type: PolynomialWithWarmUpLR\n  lr_end: 0.001\n",
                   1, "v9.yaml:4: optimizer.adamw_config.adamw_lr", "PolynomialWithWarmUpLR",
                   "expected optimizer.adamw_config.adamw_lr > lr_end", "v9.yaml:7: lr_scheduler.lr_end", NULL);
    expect_invalid("v10.yaml", "lr_scheduler:\n  type: PolynomialWithWarmUpLR\n  lr_end: 0.05\n", 1,
                   "2 configuration errors", "optimizer.adamw_config.adamw_lr (default)",
                   "optimizer.muon_config.muon_lr (default)", "found 0.02 <= 0.05", NULL);
    expect_invalid("v11.yaml", "lr_scheduler:\n  warmup_ratio: 1.5\n", 1, "v11.yaml:2: lr_scheduler.warmup_ratio",
                   "expected a number in [0, 1]", "found 1.5", NULL);
    /* One error for a bad ratio, not a second one about the warmup steps derived from it. */
    {
        static ht_config cfg;
        ht_error err = {0};
        assert_ht_ok(load_text("v11b.yaml", "lr_scheduler:\n  warmup_ratio: 2\n", &cfg, &err), &err);
        assert_int_equal(ht_config_validate(&cfg, 1, &err), HT_ERR_CONFIG);
        assert_contains(err.msg, "lr_scheduler.warmup_ratio");
        assert_null(strstr(err.msg, "warmup_steps"));
    }
    expect_invalid("v23.yaml", "training:\n  distributed_timeout_minutes: -1\n", 1,
                   "v23.yaml:2: training.distributed_timeout_minutes", "minutes >= 0", NULL);
    /* An eps of 0 divides a zero update by zero; refused here, not when the optimizer is built. */
    expect_invalid("v24.yaml", "optimizer:\n  muon_config:\n    muon_ns_eps: 0\n", 1,
                   "v24.yaml:3: optimizer.muon_config.muon_ns_eps", "expected a number > 0", NULL);
    expect_invalid("v12.yaml", "data:\n  valid_fraction: 1.0\n", 1, "v12.yaml:2: data.valid_fraction",
                   "expected a number in [0, 1)", "found 1.0", NULL);
    expect_invalid("v13.yaml", "data:\n  valid_fraction: -0.1\n", 1, "data.valid_fraction", NULL);
    expect_invalid("v14.yaml", "optimizer:\n  muon_config:\n    muon_ns_variant: custom\n", 1,
                   "optimizer.muon_config.muon_ns_coefficients (default)", "expected coefficients", NULL);
    expect_invalid("v15.yaml", "optimizer:\n  muon_config:\n    muon_ns_coefficients: [1, 2, 3]\n", 1,
                   "v15.yaml:3: optimizer.muon_config.muon_ns_coefficients", "null", NULL);
    expect_invalid("v16.yaml", "fsdp_config:\n  shard_size: 3\n", 4, "v16.yaml:2: fsdp_config.shard_size",
                   "divisor of the data-parallel size 4", NULL);
    expect_invalid("v18.yaml",
                   "lr_scheduler:\n  type: PolynomialWithWarmUpLR\n  warmup_steps: 10\n  decay_steps: 50\n"
                   "training:\n  steps: 100\n",
                   1, "v18.yaml:4: lr_scheduler.decay_steps", "at least training.steps minus the warmup steps",
                   "found 50", NULL);
    /* Several at once: every one is listed. */
    expect_invalid("v17.yaml", "training:\n  max_norm: 0\n  steps: -1\n", 1, "2 configuration errors",
                   "training.max_norm", "training.steps", NULL);
    /* PolynomialWithWarmUpLR with η > lr_end, and other schedules with η ≤ lr_end, are fine. */
    static ht_config cfg;
    ht_error err = {0};
    assert_ht_ok(load_text("ok.yaml", "lr_scheduler:\n  type: CosineWithWarmUpLR\n  lr_end: 0.5\n", &cfg, &err), &err);
    assert_ht_ok(ht_config_validate(&cfg, 1, &err), &err);
    assert_ht_ok(ht_config_set(&cfg, "optimizer.muon_config.muon_ns_steps=9", &err), &err);
    assert_int_equal(ht_config_validate(&cfg, 1, &err), HT_ERR_CONFIG);
    assert_contains(err.msg, "optimizer.muon_config.muon_ns_steps (--set)");
    assert_ht_ok(ht_config_set(&cfg, "optimizer.muon_config.muon_ns_variant=polar_express", &err), &err);
    assert_ht_ok(ht_config_validate(&cfg, 1, &err), &err);
}

/* ---------------------------------------------------------------- dialects */

static void test_mindformers_and_hyperparallel_dialects(void **state) {
    (void)state;
    static ht_config cfg;
    ht_error err = {0};
    const char *mf = "optimizer:\n"
                     "  type: Muon\n"
                     "  momentum: 0.9\n"
                     "  nesterov: false\n"
                     "  ns_steps: 3\n"
                     "  ns_coefficients: [[3.4445, -4.775, 2.0315], [2.0, -1.5, 0.5]]\n"
                     "  matched_adamw_rms: 0.3\n"
                     "  adamw_betas: [0.85, 0.99]\n"
                     "  adamw_eps: 1.0e-7\n"
                     "  qk_clip_enabled: true\n"
                     "  qk_clip_threshold: 30\n"
                     "  comm_strategy: deredundancy\n"
                     "  adamw_include: [\"*wte*\"]\n";
    assert_ht_ok(load_text("mf.yaml", mf, &cfg, &err), &err);
    assert_int_equal(cfg.optimizer.type, HT_CONFIG_OPTIMIZER_MUON);
    assert_true(cfg.optimizer.muon.momentum == 0.9);
    assert_false(cfg.optimizer.muon.nesterov);
    assert_int_equal(cfg.optimizer.muon.ns_steps, 3);
    assert_int_equal(cfg.optimizer.muon.ns_coefficients.count, 2);
    assert_int_equal(cfg.optimizer.muon.ns_coefficients.repeat[0], 1);
    assert_int_equal(cfg.optimizer.muon.ns_coefficients.repeat[1], 1);
    assert_true(cfg.optimizer.muon.matched_adamw_rms == 0.3);
    assert_true(cfg.optimizer.adamw.betas[0] == 0.85);
    assert_true(cfg.optimizer.adamw.eps == 1e-7);
    assert_true(cfg.optimizer.muon.qk_clip_enabled);
    assert_true(cfg.optimizer.muon.qk_clip_threshold == 30);
    assert_int_equal(cfg.optimizer.muon.comm_strategy, HT_CONFIG_MUON_COMM_DEREDUNDANCY);
    assert_string_equal(cfg.optimizer.muon.adamw_include.items[0], "*wte*");
    assert_source(&cfg, "optimizer.muon_config.muon_momentum", HT_CONFIG_SOURCE_FILE, 3);

    const char *hp = "optimizer:\n"
                     "  _target_: hyper_parallel.auto_models.components.optim.optimizer.optimizer.AdamW\n"
                     "  betas: [0.9, 0.95]\n"
                     "  eps: 1.0e-6\n";
    assert_ht_ok(load_text("hp.yaml", hp, &cfg, &err), &err);
    assert_int_equal(cfg.optimizer.type, HT_CONFIG_OPTIMIZER_ADAMW);
    assert_true(cfg.optimizer.adamw.betas[1] == 0.95);
    assert_true(cfg.optimizer.adamw.eps == 1e-6);
    char value[128];
    ht_config_format_value(&cfg, "optimizer._target_", value, sizeof(value));
    assert_string_equal(value, "AdamW"); /* logged by its short name */
    assert_int_equal(ht_config_key_index("optimizer.betas"), ht_config_key_index("optimizer.adamw_config.adamw_betas"));
    assert_int_equal(ht_config_key_index("optimizer.nope"), -1);
}

/* MindFormers' dialect keeps its own meanings and defaults: a Muon block's
 * eps is the Newton-Schulz eps (with adamw_eps beside it, no duplicate);
 * what the block leaves unset takes MindFormers' defaults, logged as such;
 * its optimizer and lr_scheduler sections take extra keys, kept as ignored;
 * accumulate_allreduce_grads_in_fp32: false is refused with the reason. */
static void test_mindformers_dialect_meanings(void **state) {
    (void)state;
    static ht_config cfg;
    ht_error err = {0};
    const char *muon = "optimizer:\n"
                       "  type: Muon\n"
                       "  eps: 1.e-6\n"
                       "  adamw_eps: 1.e-9\n"
                       "  use_fused: true\n"
                       "lr_scheduler:\n"
                       "  type: cosine\n"
                       "  warmup_steps: 2\n"
                       "  some_future_key: 3\n";
    assert_ht_ok(load_text("mfm.yaml", muon, &cfg, &err), &err);
    assert_int_equal(cfg.dialect, HT_CONFIG_DIALECT_MINDFORMERS);
    assert_true(cfg.optimizer.muon.ns_eps == 1e-6);
    assert_true(cfg.optimizer.adamw.eps == 1e-9);
    assert_string_equal(ht_config_key_spelling(&cfg, "optimizer.muon_config.muon_ns_eps"), "optimizer.eps");
    /* MindFormers' Muon defaults where hypertrain's differ. */
    assert_true(cfg.optimizer.adamw.betas[0] == 0.95 && cfg.optimizer.adamw.betas[1] == 0.95);
    assert_true(cfg.optimizer.muon.lr == 1e-5 && cfg.optimizer.adamw.lr == 1e-5);
    assert_true(cfg.optimizer.adamw.weight_decay == 0.1);
    assert_true(cfg.optimizer.muon.qk_clip_enabled);
    assert_int_equal(cfg.optimizer.muon.ns_variant, HT_CONFIG_NS_LEGACY);
    assert_string_equal(cfg.optimizer.muon.adamw_include.items[0], "word_embeddings");
    assert_int_equal(cfg.training.local_batch_size, 1);
    assert_int_equal(cfg.lr_scheduler.type, HT_CONFIG_LR_COSINE_WARMUP); /* "cosine", HyperParallel's name */
    assert_int_equal(cfg.ignored_count, 2);
    assert_string_equal(cfg.ignored[0], "optimizer.use_fused");
    assert_int_equal(cfg.ignored_line[0], 5);
    assert_string_equal(cfg.ignored[1], "lr_scheduler.some_future_key");
    assert_ht_ok(ht_config_validate(&cfg, 1, &err), &err);

    /* An AdamW block (MindFormers' default type): eps is AdamW's, betas [0.9, 0.95]. */
    assert_ht_ok(load_text("mfa.yaml", "optimizer:\n  eps: 1.e-7\n  weight_decay: 0.05\n", &cfg, &err), &err);
    assert_int_equal(cfg.dialect, HT_CONFIG_DIALECT_HYPERTRAIN); /* no type, no lr_schedule: not told */
    assert_ht_ok(load_text("mfa.yaml", "optimizer:\n  type: AdamW\n  eps: 1.e-7\n", &cfg, &err), &err);
    assert_int_equal(cfg.dialect, HT_CONFIG_DIALECT_MINDFORMERS);
    assert_int_equal(cfg.optimizer.type, HT_CONFIG_OPTIMIZER_ADAMW);
    assert_true(cfg.optimizer.adamw.eps == 1e-7);
    assert_true(cfg.optimizer.muon.ns_eps == 1e-7); /* hypertrain's default, untouched */
    assert_true(cfg.optimizer.adamw.betas[0] == 0.9 && cfg.optimizer.adamw.betas[1] == 0.95);
    assert_true(cfg.optimizer.adamw.weight_decay == 0.01);

    /* hypertrain's own dialect still refuses an unknown key there. */
    expect_load_error("mfx.yaml", "optimizer:\n  _target_: AdamW\n  use_fused: true\n",
                      "mfx.yaml:3:", "optimizer.use_fused", "unknown key", NULL);
    /* false asks for what the engine never does. */
    assert_ht_ok(
        load_text("mff.yaml", "optimizer:\n  type: AdamW\n  accumulate_allreduce_grads_in_fp32: false\n", &cfg, &err),
        &err);
    assert_int_equal(ht_config_validate(&cfg, 1, &err), HT_ERR_CONFIG);
    assert_contains(err.msg, "mff.yaml:3: optimizer.accumulate_allreduce_grads_in_fp32");
    assert_contains(err.msg, "always accumulates them in FP32");
    /* HyperParallel's scheduler names. */
    assert_ht_ok(load_text("hps.yaml", "lr_scheduler:\n  type: linear\n", &cfg, &err), &err);
    assert_int_equal(cfg.lr_scheduler.type, HT_CONFIG_LR_LINEAR_WARMUP);
    assert_ht_ok(load_text("hps.yaml", "lr_scheduler:\n  type: constant\n", &cfg, &err), &err);
    assert_int_equal(cfg.lr_scheduler.type, HT_CONFIG_LR_CONSTANT_WARMUP);
}

/* MindSpeed-MM's keys: renames, the negated no_save_optim, short dtype
 * names, the data path and output dir in parts, gradient accumulation given
 * by count, and each value hypertrain cannot honour refused with the reason. */
static void test_mindspeed_dialect(void **state) {
    (void)state;
    static ht_config cfg;
    ht_error err = {0};
    const char *ms = "parallel:\n"
                     "  fsdp_plan:\n"
                     "    param_dtype: bf16\n"
                     "    reduce_dtype: fp32\n"
                     "data:\n"
                     "  dataset_param:\n"
                     "    dataset_type: token_bin\n"
                     "    basic_parameters:\n"
                     "      dataset_dir: /data\n"
                     "      dataset: train_*.bin\n"
                     "model:\n"
                     "  model_id: llama\n"
                     "training:\n"
                     "  micro_batch_size: 2\n"
                     "  gradient_accumulation_steps: 3\n"
                     "  train_iters: 7\n"
                     "  lr: 2.0e-4\n"
                     "  no_save_optim: true\n"
                     "  save: /ckpt/run\n";
    assert_ht_ok(load_text("ms.yaml", ms, &cfg, &err), &err);
    assert_int_equal(cfg.dialect, HT_CONFIG_DIALECT_MINDSPEED);
    assert_int_equal(cfg.fsdp.param_dtype, HT_DTYPE_BF16);
    assert_int_equal(cfg.fsdp.reduce_dtype, HT_DTYPE_F32);
    assert_string_equal(cfg.data.path, "/data/train_*.bin");
    assert_source(&cfg, "data.path", HT_CONFIG_SOURCE_FILE, 10);
    assert_string_equal(cfg.model.arch.name, "llama");
    assert_int_equal(cfg.training.local_batch_size, 2);
    assert_int_equal(cfg.training.gradient_accumulation_steps, 3);
    assert_int_equal(cfg.training.steps, 7);
    assert_true(cfg.optimizer.adamw.lr == 2e-4 && cfg.optimizer.muon.lr == 2e-4);
    assert_false(cfg.checkpoint.save_optimizer);
    assert_string_equal(cfg.checkpoint.output_dir, "/ckpt/run");
    assert_int_equal(cfg.optimizer.type, HT_CONFIG_OPTIMIZER_ADAMW); /* MindSpeed-MM's default optimizer */
    assert_ht_ok(ht_config_validate(&cfg, 2, &err), &err);           /* global = 2 x 3 x 2, not given: fine */

    /* save: null saves no checkpoint. */
    assert_ht_ok(load_text("ms2.yaml",
                           "parallel:\n  tensor_parallel_size: 1\ntraining:\n  save: null\n  save_interval: 5\n", &cfg,
                           &err),
                 &err);
    assert_int_equal(cfg.checkpoint.save_interval, 0);

    /* Each refusal names the key, as the file spells it, and why. */
    static const struct {
        const char *yaml, *want1, *want2;
    } bad[] = {
        {"parallel:\n  tensor_parallel_size: 2\n", "tensor parallel 2 = 2 does not divide the 1 ranks",
         "parallel.tensor_parallel_size"},
        {"parallel:\n  expert_parallel_size: 4\n",
         "parallel.expert_parallel_size: 4, but model.name qwen2 has no experts", "4 does not divide the 1 ranks"},
        {"parallel:\n  fsdp_plan:\n    apply_modules: [\"model.layers.{*}\"]\n    hook_modules: [model.norm]\n",
         "fsdp_config.hook_modules (as parallel.fsdp_plan.hook_modules): not supported", "unit by unit"},
        {"parallel:\n  ring_attention_size: 1\ndata:\n  dataloader_param:\n    drop_last: false\n",
         "data.drop_last (as data.dataloader_param.drop_last): not supported", "every batch here is full"},
        {"parallel:\n  ring_attention_size: 1\ndata:\n  dataloader_param:\n    sampler_type: SeqSampler\n",
         "not supported: SeqSampler", "BaseRandomBatchSampler"},
        {"parallel:\n  ring_attention_size: 1\ndata:\n  dataloader_param:\n    collate_param:\n      model_name: "
         "qwen3vl\n",
         "not supported: qwen3vl", "llm_pretrain"},
        {"parallel:\n  ring_attention_size: 1\ndata:\n  dataset_param:\n    dataset_type: text_bytes\n"
         "    preprocess_parameters:\n      model_name_or_path: /tok\n",
         "text_bytes reads text as bytes", "prepare_data.py --tokenizer /tok"},
        {"parallel:\n  ring_attention_size: 1\ntraining:\n  micro_batch_size: 2\n  gradient_accumulation_steps: 2\n"
         "  global_batch_size: 6\n",
         "training.global_batch_size: 6, but training.gradient_accumulation_steps", "= 4: give one of the two"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        assert_ht_ok(load_text("msbad.yaml", bad[i].yaml, &cfg, &err), &err);
        if (ht_config_validate(&cfg, 1, &err) == HT_OK) fail_msg("case %zu accepted:\n%s", i, bad[i].yaml);
        assert_contains(err.msg, bad[i].want1);
        if (bad[i].want2) assert_contains(err.msg, bad[i].want2);
    }
    /* A path and its parts both given. */
    expect_load_error("ms3.yaml",
                      "parallel:\n  ring_attention_size: 1\ndata:\n  path: a.txt\n  dataset_param:\n"
                      "    basic_parameters:\n      dataset: b.txt\n",
                      "data.path and data.dataset", "give one", NULL);
}

/* Pipeline parallelism (parallel.pipeline_parallel_size): the mesh it
 * makes with the ranks, and each refusal naming its key and why. */
static void test_pipeline_parallel_mesh(void **state) {
    (void)state;
    static ht_config cfg;
    ht_error err = {0};
    const char *model = "model:\n  num_hidden_layers: 4\n%s"
                        "training:\n  local_batch_size: 1\n  global_batch_size: 4\nparallel:\n%s%s";
    const char *untied = "  tie_word_embeddings: false\n";
    char text[2048];
    snprintf(text, sizeof(text), model, untied, "  pipeline_parallel_size: 2\n", "");
    assert_ht_ok(load_text("pp.yaml", text, &cfg, &err), &err);
    assert_int_equal(cfg.parallel.pipeline_schedule, HT_CONFIG_PP_1F1B);
    assert_ht_ok(ht_config_validate(&cfg, 2, &err), &err); /* 2 stages of 1 rank: 4 micro-batches a step */
    assert_int_equal(ht_config_data_parallel_size(&cfg, 2), 1);
    assert_ht_ok(ht_config_validate(&cfg, 4, &err), &err); /* x DP 2: 2 micro-batches each, as many as stages */
    assert_int_equal(ht_config_data_parallel_size(&cfg, 4), 2);
    static const struct {
        const char *model, *parallel, *rest;
        int world;
        const char *want1, *want2;
    } bad[] = {
        {NULL, "  pipeline_parallel_size: 3\n", "", 4, "parallel.pipeline_parallel_size: 3 does not divide the 4 ranks",
         "a multiple of 3"},
        {NULL, "  pipeline_parallel_size: 0\n", "", 1, "parallel.pipeline_parallel_size", "an integer >= 1"},
        {NULL, "  pipeline_parallel_size: 8\n", "", 8, "8 stages x 1 chunks, but the model has 4 layers",
         "at least one"},
        {NULL, "  pipeline_parallel_size: 2\n", "", 8, "1f1b over 2 stages needs at least 2 micro-batches a step",
         "has 1"},
        {NULL, "  virtual_pipeline_model_parallel_size: 2\n", "", 1, "need pipeline stages",
         "expected parallel.pipeline_parallel_size > 1"},
        {NULL, "  pipeline_parallel_size: 2\n  virtual_pipeline_model_parallel_size: 3\n", "", 2,
         "2 stages x 3 chunks, but the model has 4 layers", NULL},
        {NULL, "  pipeline_parallel_size: 2\n  virtual_pipeline_model_parallel_size: 2\n  pipeline_schedule: gpipe\n",
         "", 2, "run the interleaved 1F1B schedule", "expected pipeline_schedule: 1f1b"},
        {NULL, "  pipeline_parallel_size: 3\n  virtual_pipeline_model_parallel_size: 2\n  pipeline_schedule: gpipe\n",
         "", 3, "groups of the 3 stages", "expected a multiple of 3"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        snprintf(text, sizeof(text), model, bad[i].model ? bad[i].model : untied, bad[i].parallel, bad[i].rest);
        if (load_text("ppbad.yaml", text, &cfg, &err) != HT_OK) fail_msg("case %zu: %s", i, err.msg);
        if (ht_config_validate(&cfg, bad[i].world, &err) == HT_OK) fail_msg("case %zu accepted:\n%s", i, text);
        assert_contains(err.msg, bad[i].want1);
        if (bad[i].want2) assert_contains(err.msg, bad[i].want2);
    }
    /* gpipe takes any count of micro-batches */
    snprintf(text, sizeof(text), model, untied, "  pipeline_parallel_size: 2\n  pipeline_schedule: gpipe\n", "");
    assert_ht_ok(load_text("pp.yaml", text, &cfg, &err), &err);
    assert_ht_ok(ht_config_validate(&cfg, 8, &err), &err);
}

/* Context parallelism (parallel.ulysses_parallel_size x ring_attention_size):
 * the mesh it makes with the ranks, and every refusal naming its sizes. */
static void test_context_parallel_mesh(void **state) {
    (void)state;
    static ht_config cfg;
    ht_error err = {0};
    const char *model = "model:\n  num_attention_heads: 4\n  num_key_value_heads: 2\n  hidden_size: 32\n"
                        "data:\n  seq_len: 16\ntraining:\n  local_batch_size: 1\n  global_batch_size: 4\n";
    char text[1024];
    snprintf(text, sizeof(text), "%sparallel:\n  ring_attention_size: 2\n  ulysses_parallel_size: 2\n", model);
    assert_ht_ok(load_text("cp.yaml", text, &cfg, &err), &err);
    assert_ht_ok(ht_config_validate(&cfg, 4, &err), &err); /* DP 1 */
    assert_int_equal(ht_config_data_parallel_size(&cfg, 4), 1);
    assert_ht_ok(ht_config_validate(&cfg, 8, &err), &err); /* DP 2 */
    assert_int_equal(ht_config_data_parallel_size(&cfg, 8), 2);
    /* The global batch splits over the data-parallel ranks only: 4 over DP 4 of 16 ranks, not over 16. */
    assert_ht_ok(ht_config_validate(&cfg, 16, &err), &err);
    expect_invalid("cp_batch.yaml", text, 32, "training.global_batch_size", "1 x 8 = 8", NULL);
    expect_invalid("cp_world.yaml", text, 6,
                   "context parallel 2 x 2 times tensor parallel 1 = 4 does not divide the 6 ranks", "a multiple of 4",
                   NULL);
    snprintf(text, sizeof(text), "%sparallel:\n  ring_attention_size: 4\n", model);
    /* 16 tokens in 8 chunks: fine; 12 are not. */
    assert_ht_ok(load_text("cp4.yaml", text, &cfg, &err), &err);
    assert_ht_ok(ht_config_validate(&cfg, 4, &err), &err);
    char shorter[1100];
    snprintf(shorter, sizeof(shorter), "%s", text);
    memcpy(strstr(shorter, "seq_len: 16") + 9, "12", 2);
    expect_invalid("cp_seq.yaml", shorter, 4, "data.seq_len",
                   "12 does not cut into 2 x parallel.ring_attention_size = 8", "chunks r and 7 - r", NULL);
    snprintf(text, sizeof(text), "%sparallel:\n  ulysses_parallel_size: 4\n", model);
    expect_invalid("cp_heads.yaml", text, 4, "parallel.ulysses_parallel_size", "4 does not divide",
                   "the 4 attention heads and 2 key/value heads (model.num_attention_heads", NULL);
    /* Tensor parallelism: the world is DP x CP x TP; TP divides the heads, and Ulysses a TP rank's. */
    snprintf(text, sizeof(text), "%sparallel:\n  tensor_parallel_size: 2\n  ring_attention_size: 2\n", model);
    assert_ht_ok(load_text("tp.yaml", text, &cfg, &err), &err);
    assert_ht_ok(ht_config_validate(&cfg, 8, &err), &err); /* DP 2 */
    assert_int_equal(ht_config_data_parallel_size(&cfg, 8), 2);
    expect_invalid("tp_world.yaml", text, 6, "context parallel 1 x 2 times tensor parallel 2 = 4 does not divide the 6",
                   "parallel.tensor_parallel_size", NULL);
    snprintf(text, sizeof(text), "%sparallel:\n  tensor_parallel_size: 4\n", model);
    expect_invalid("tp_heads.yaml", text, 4, "parallel.tensor_parallel_size", "it does not divide",
                   "model.num_key_value_heads (2)", NULL);
    /* The message names the count it does not divide, not both (2 divides 6 heads, not 3 KV heads). */
    snprintf(text, sizeof(text),
             "model:\n  hidden_size: 48\n  num_attention_heads: 6\n  num_key_value_heads: 3\nparallel:\n"
             "  tensor_parallel_size: 2\n");
    expect_invalid("tp_heads_one.yaml", text, 2, "parallel.tensor_parallel_size",
                   "must divide both model.num_attention_heads (6) and model.num_key_value_heads (3); it does not "
                   "divide model.num_key_value_heads (3)",
                   NULL);
    snprintf(text, sizeof(text),
             "model:\n  hidden_size: 60\n  num_attention_heads: 5\n  num_key_value_heads: 5\nparallel:\n"
             "  tensor_parallel_size: 2\n");
    expect_invalid("tp_heads_neither.yaml", text, 2, "model.num_key_value_heads (5); it divides neither", NULL);
    snprintf(text, sizeof(text), "%sparallel:\n  tensor_parallel_size: 2\n  ulysses_parallel_size: 2\n", model);
    expect_invalid("tp_ulysses.yaml", text, 4, "parallel.ulysses_parallel_size",
                   "2 does not divide the 2 attention heads and 1 key/value heads of a tensor-parallel rank", NULL);
    /* Sequence parallelism: a tensor-parallel rank's tokens of each sequence split over the group. */
    snprintf(text, sizeof(text), "%sparallel:\n  tensor_parallel_size: 2\n", model);
    memcpy(strstr(text, "seq_len: 16") + 9, "15", 2);
    expect_invalid("tp_sp.yaml", text, 2, "data.seq_len", "15: under sequence parallelism",
                   "expected a multiple of 2, or parallel.sequence_parallel false", NULL);
    snprintf(text + strlen(text), sizeof(text) - strlen(text), "  sequence_parallel: false\n");
    assert_ht_ok(load_text("tp_no_sp.yaml", text, &cfg, &err), &err);
    assert_ht_ok(ht_config_validate(&cfg, 2, &err), &err);
    snprintf(text, sizeof(text), "%sparallel:\n  tensor_parallel_size: 0\n", model);
    expect_invalid("tp_zero.yaml", text, 1, "parallel.tensor_parallel_size", ">= 1", NULL);
    snprintf(text, sizeof(text), "%sparallel:\n  ulysses_parallel_size: 0\n", model);
    expect_invalid("cp_zero.yaml", text, 1, "parallel.ulysses_parallel_size", ">= 1", NULL);
}

/* The two dialect examples describe one run: every key loads to the same value,
 * except those the dialects spell differently (listed, and checked by hand). */
static void test_dialect_examples(void **state) {
    (void)state;
    static ht_config hp, mf;
    ht_error err = {0};
    const char *hp_path = HT_SOURCE_DIR "/configs/hyperparallel_muon.yaml";
    const char *mf_path = HT_SOURCE_DIR "/configs/mindformers_muon.yaml";
    assert_ht_ok(ht_config_load(hp_path, 0, NULL, &hp, &err), &err);
    assert_ht_ok(ht_config_load(mf_path, 0, NULL, &mf, &err), &err);
    assert_ht_ok(ht_config_validate(&hp, 1, &err), &err);
    assert_ht_ok(ht_config_validate(&mf, 1, &err), &err);
    /* HyperParallel names the variant (legacy); MindFormers can only give its triple (custom, ns_steps times). */
    static const char *const spelled_differently[] = {
        "optimizer.muon_config.muon_ns_variant",
        "optimizer.muon_config.muon_ns_coefficients",
    };
    int compared = 0;
    for (int i = 0; i < ht_config_key_count(); i++) {
        const char *key = ht_config_key_name(i);
        bool skip = false;
        for (size_t j = 0; j < sizeof(spelled_differently) / sizeof(spelled_differently[0]); j++)
            skip |= strcmp(key, spelled_differently[j]) == 0;
        if (skip) continue;
        char a[4096], b[4096];
        assert_true(ht_config_format_value(&hp, key, a, sizeof(a)));
        assert_true(ht_config_format_value(&mf, key, b, sizeof(b)));
        if (strcmp(a, b) != 0) fail_msg("%s: %s in the HyperParallel file, %s in the MindFormers file", key, a, b);
        compared++;
    }
    assert_int_equal(compared, ht_config_key_count() - 2);
    assert_int_equal(hp.optimizer.muon.ns_variant, HT_CONFIG_NS_LEGACY);
    assert_int_equal(mf.optimizer.muon.ns_variant, HT_CONFIG_NS_CUSTOM);
    const ht_config_ns_coefficients *ns = &mf.optimizer.muon.ns_coefficients;
    assert_int_equal(ns->count, 1);
    assert_int_equal(ns->repeat[0], 0); /* ns_steps times */
    assert_true(ns->abc[0][0] == 3.4445 && ns->abc[0][1] == -4.7750 && ns->abc[0][2] == 2.0315);
    assert_int_equal(mf.optimizer.muon.ns_steps, 5);
    assert_int_equal(hp.optimizer.muon.ns_steps, 5);
    /* The settings the brief names: bf16 model, FP32 main params, Muon with one lr and wd for both parts. */
    assert_int_equal(mf.model_init_dtype, HT_DTYPE_BF16);
    assert_true(mf.optimizer.fp32_main_params);
    assert_int_equal(mf.optimizer.type, HT_CONFIG_OPTIMIZER_MUON);
    assert_true(mf.optimizer.muon.lr == 2e-3 && mf.optimizer.adamw.lr == 2e-3);
    assert_true(mf.optimizer.muon.weight_decay == 0.1 && mf.optimizer.adamw.weight_decay == 0.1);
    assert_string_equal(ht_config_key_spelling(&mf, "optimizer.muon_config.muon_lr"), "lr_scheduler.learning_rate");
    assert_string_equal(ht_config_key_spelling(&mf, "optimizer.adamw_config.adamw_lr"), "lr_scheduler.learning_rate");
    assert_string_equal(ht_config_key_spelling(&hp, "optimizer.muon_config.muon_lr"), "optimizer.muon_config.muon_lr");
    assert_string_equal(ht_config_key_spelling(&hp, "training.steps"), "training.max_steps");
    assert_string_equal(ht_config_key_spelling(&mf, "optimizer.muon_config.muon_ns_variant"),
                        "optimizer.ns_coefficients");
    int line = 0;
    assert_int_equal(ht_config_key_source(&mf, "optimizer.muon_config.muon_ns_variant", &line), HT_CONFIG_SOURCE_FILE);
    assert_true(line > 0);
}

/* MindFormers' ConstantWithCoolDownLR, CosineAnnealingWarmRestarts and LearningRateWiseLayer by name,
 * base_lr (CosineAnnealingLR's name for learning_rate) and decay_ratio. */
static void test_mindformers_lr_keys(void **state) {
    (void)state;
    static ht_config cfg;
    ht_error err = {0};
    assert_ht_ok(load_text("cool.yaml",
                           "training:\n  steps: 100\nlr_scheduler:\n  type: ConstantWithCoolDownLR\n"
                           "  learning_rate: 0.002\n  warmup_steps: 10\n  keep_steps: 20\n  decay_ratio: 0.505\n"
                           "  final_steps: 10\n  lr_end1: 1.0e-5\n",
                           &cfg, &err),
                 &err);
    assert_int_equal(cfg.lr_scheduler.type, HT_CONFIG_LR_CONSTANT_COOLDOWN);
    assert_int_equal(cfg.lr_scheduler.keep_steps, 20);
    assert_int_equal(cfg.lr_scheduler.final_steps, 10);
    assert_int_equal(ht_config_decay_steps(&cfg), 50); /* floor(100 * 0.505) */
    assert_true(ht_config_lr_end2(&cfg) == 1.0e-5);    /* lr_end2 not given: lr_end1 */
    assert_true(cfg.optimizer.muon.lr == 0.002 && cfg.optimizer.adamw.lr == 0.002);
    assert_ht_ok(ht_config_validate(&cfg, 1, &err), &err);
    /* The ratio wins over decay_steps, whichever comes first; decay_steps alone is itself. */
    assert_ht_ok(load_text("cool2.yaml",
                           "training:\n  steps: 200\nlr_scheduler:\n  type: ConstantWithCoolDownLR\n"
                           "  decay_ratio: 0.25\n  decay_steps: 30\n  lr_end2: 0.0\n",
                           &cfg, &err),
                 &err);
    assert_int_equal(ht_config_decay_steps(&cfg), 50);
    assert_true(ht_config_lr_end2(&cfg) == 0.0 && cfg.lr_scheduler.lr_end1 == 0.0);
    assert_ht_ok(
        load_text("cool3.yaml", "lr_scheduler:\n  type: ConstantWithCoolDownLR\n  decay_steps: 30\n", &cfg, &err),
        &err);
    assert_int_equal(ht_config_decay_steps(&cfg), 30);
    assert_ht_ok(ht_config_validate(&cfg, 1, &err), &err);

    /* base_lr sets both optimizers' lr, as learning_rate does, in a file and on the command line. */
    assert_ht_ok(load_text("warm.yaml",
                           "lr_schedule:\n  type: CosineAnnealingWarmRestarts\n  base_lr: 0.01\n  t_0: 10\n"
                           "  t_mult: 2\n  eta_min: 1.0e-6\n",
                           &cfg, &err),
                 &err);
    assert_int_equal(cfg.lr_scheduler.type, HT_CONFIG_LR_COSINE_WARM_RESTARTS);
    assert_int_equal(cfg.lr_scheduler.t_0, 10);
    assert_int_equal(cfg.lr_scheduler.t_mult, 2);
    assert_true(cfg.optimizer.muon.lr == 0.01 && cfg.optimizer.adamw.lr == 0.01);
    assert_string_equal(ht_config_key_spelling(&cfg, "optimizer.adamw_config.adamw_lr"), "lr_scheduler.base_lr");
    assert_source(&cfg, "optimizer.muon_config.muon_lr", HT_CONFIG_SOURCE_FILE, 3);
    assert_ht_ok(ht_config_validate(&cfg, 1, &err), &err);
    assert_ht_ok(ht_config_set(&cfg, "lr_scheduler.base_lr=0.02", &err), &err);
    assert_true(cfg.optimizer.muon.lr == 0.02 && cfg.optimizer.adamw.lr == 0.02);
    assert_int_equal(ht_config_key_index("lr_scheduler.base_lr"), -1); /* a shared value, not one key */

    /* base_lr and learning_rate in one file: one value named twice, in either order and section spelling. */
    expect_load_error("both.yaml", "lr_scheduler:\n  learning_rate: 0.001\n  base_lr: 0.002\n",
                      "both.yaml:3: lr_scheduler.base_lr", "lr_scheduler.learning_rate was already given on line 2",
                      NULL);
    expect_load_error("both2.yaml", "lr_schedule:\n  base_lr: 0.002\n  type: CosineAnnealingLR\n  learning_rate: 1\n",
                      "both2.yaml:4: lr_schedule.learning_rate", "lr_schedule.base_lr was already given on line 2",
                      NULL);

    /* LearningRateWiseLayer wraps a schedule object per parameter group: refused, saying why. */
    expect_invalid("wise.yaml", "lr_scheduler:\n  type: LearningRateWiseLayer\n  learning_rate: 0.001\n", 1,
                   "wise.yaml:2: lr_scheduler.type", "LearningRateWiseLayer is not supported",
                   "no per-layer parameter groups", NULL);

    /* Bad values name their key. */
    expect_invalid("t0.yaml", "lr_scheduler:\n  type: CosineAnnealingWarmRestarts\n", 1, "lr_scheduler.t_0 (default)",
                   "an integer >= 1 for CosineAnnealingWarmRestarts", NULL);
    expect_invalid("tm.yaml", "lr_scheduler:\n  type: CosineAnnealingWarmRestarts\n  t_0: 5\n  t_mult: 0\n", 1,
                   "tm.yaml:4: lr_scheduler.t_mult", "an integer >= 1", NULL);
    expect_invalid("keep.yaml", "lr_scheduler:\n  keep_steps: -1\n  final_steps: -2\n  lr_end1: -1\n  lr_end2: -1\n", 1,
                   "keep.yaml:2: lr_scheduler.keep_steps", "keep.yaml:3: lr_scheduler.final_steps",
                   "keep.yaml:4: lr_scheduler.lr_end1", "keep.yaml:5: lr_scheduler.lr_end2", "4 configuration errors",
                   NULL);
    expect_invalid("ratio.yaml", "lr_scheduler:\n  decay_ratio: 1.5\n", 1, "ratio.yaml:2: lr_scheduler.decay_ratio",
                   "a number in [0, 1]", NULL);
    expect_invalid("nodecay.yaml", "lr_scheduler:\n  type: ConstantWithCoolDownLR\n  keep_steps: 3\n", 1,
                   "nodecay.yaml:2: lr_scheduler.type", "set lr_scheduler.decay_steps or lr_scheduler.decay_ratio",
                   NULL);
    /* For the cosine schedules D = 0 means the whole run: a ratio of no steps is not that. */
    expect_invalid("tiny.yaml",
                   "training:\n  steps: 100\nlr_scheduler:\n  type: CosineWithWarmUpLR\n"
                   "  decay_ratio: 0.001\n",
                   1, "tiny.yaml:5: lr_scheduler.decay_ratio", "at least one decay step", NULL);
}

static void test_shared_aliases(void **state) {
    (void)state;
    static ht_config cfg;
    ht_error err = {0};
    /* One learning rate and one weight decay for both optimizers. */
    assert_ht_ok(
        load_text("sh1.yaml", "lr_scheduler:\n  learning_rate: 0.003\noptimizer:\n  weight_decay: 0.05\n", &cfg, &err),
        &err);
    assert_true(cfg.optimizer.muon.lr == 0.003 && cfg.optimizer.adamw.lr == 0.003);
    assert_true(cfg.optimizer.muon.weight_decay == 0.05 && cfg.optimizer.adamw.weight_decay == 0.05);
    assert_source(&cfg, "optimizer.muon_config.muon_lr", HT_CONFIG_SOURCE_FILE, 2);
    assert_source(&cfg, "optimizer.adamw_config.adamw_weight_decay", HT_CONFIG_SOURCE_FILE, 4);
    assert_int_equal(ht_config_key_index("lr_scheduler.learning_rate"), -1); /* not one key */
    assert_int_equal(ht_config_key_index("lr_schedule.type"), ht_config_key_index("lr_scheduler.type"));

    /* The key's own name wins over the shared value in the same file, in either order. */
    const char *before = "optimizer:\n  muon_config:\n    muon_lr: 0.02\nlr_scheduler:\n  learning_rate: 0.003\n";
    const char *after = "lr_scheduler:\n  learning_rate: 0.003\noptimizer:\n  muon_config:\n    muon_lr: 0.02\n";
    for (int k = 0; k < 2; k++) {
        assert_ht_ok(load_text("sh2.yaml", k ? after : before, &cfg, &err), &err);
        assert_true(cfg.optimizer.muon.lr == 0.02);
        assert_true(cfg.optimizer.adamw.lr == 0.003);
        assert_string_equal(ht_config_key_spelling(&cfg, "optimizer.muon_config.muon_lr"),
                            "optimizer.muon_config.muon_lr");
        assert_string_equal(ht_config_key_spelling(&cfg, "optimizer.adamw_config.adamw_lr"),
                            "lr_scheduler.learning_rate");
    }
    /* On the command line too; and the command line wins over the file, shared or not. */
    const char *path = write_config("sh3.yaml", "optimizer:\n  muon_config:\n    muon_lr: 0.02\n");
    char *cli[] = {"optimizer.adamw_config.adamw_lr=0.0005", "lr_scheduler.learning_rate=0.004"};
    assert_ht_ok(ht_config_load(path, 2, cli, &cfg, &err), &err);
    assert_true(cfg.optimizer.muon.lr == 0.004);   /* the file's muon_lr loses to the command line */
    assert_true(cfg.optimizer.adamw.lr == 0.0005); /* the command line's own adamw_lr wins over its shared one */
    assert_source(&cfg, "optimizer.muon_config.muon_lr", HT_CONFIG_SOURCE_CLI, 0);

    /* MindFormers' AdamW: betas, eps and weight_decay are AdamW's. */
    assert_ht_ok(load_text("sh4.yaml",
                           "optimizer:\n  type: AdamW\n  betas: [0.9, 0.95]\n  eps: 1.0e-6\n  weight_decay: 0.02\n"
                           "lr_schedule:\n  type: ConstantWarmUpLR\n  learning_rate: 1.0e-4\n  total_steps: -1\n",
                           &cfg, &err),
                 &err);
    assert_int_equal(cfg.optimizer.type, HT_CONFIG_OPTIMIZER_ADAMW);
    assert_true(cfg.optimizer.adamw.betas[1] == 0.95 && cfg.optimizer.adamw.eps == 1e-6);
    assert_true(cfg.optimizer.adamw.weight_decay == 0.02 && cfg.optimizer.adamw.lr == 1e-4);
    assert_int_equal(cfg.lr_scheduler.type, HT_CONFIG_LR_CONSTANT_WARMUP);
    assert_ht_ok(ht_config_validate(&cfg, 1, &err), &err);
    assert_ht_ok(load_text("sh5.yaml", "lr_scheduler:\n  total_steps: null\n", &cfg, &err), &err);

    /* ns_coefficients means custom, unless the variant is given by its own name (then: the usual error). */
    assert_ht_ok(load_text("sh6.yaml", "optimizer:\n  ns_coefficients: null\n", &cfg, &err), &err);
    assert_int_equal(cfg.optimizer.muon.ns_variant, HT_CONFIG_NS_ASYM5);
    expect_invalid("sh7.yaml",
                   "optimizer:\n  ns_coefficients: [3.4445, -4.775, 2.0315]\n  muon_config:\n"
                   "    muon_ns_variant: legacy\n",
                   1, "sh7.yaml:2: optimizer.muon_config.muon_ns_coefficients (as optimizer.ns_coefficients)",
                   "expected null", "sh7.yaml:4: optimizer.muon_config.muon_ns_variant", NULL);

    /* Two names of one key stay a duplicate; so do a section and its alias. */
    expect_load_error("dup1.yaml", "optimizer:\n  betas: [0.9, 0.95]\n  adamw_betas: [0.9, 0.95]\n",
                      "dup1.yaml:3:", "optimizer.adamw_betas", "duplicate key",
                      "already set on line 2 as optimizer.betas", NULL);
    expect_load_error("dup2.yaml", "seed: 1\ntraining:\n  seed: 2\n", "dup2.yaml:3:", "training.seed", "duplicate key",
                      "line 1 as seed", NULL);
    expect_load_error("dup3.yaml", "runner_config:\n  batch_size: 4\ntraining:\n  micro_batch_size: 4\n",
                      "dup3.yaml:4:", "training.micro_batch_size", "duplicate key",
                      "training.local_batch_size was already set on line 2 as runner_config.batch_size", NULL);
    expect_load_error("dup4.yaml", "lr_schedule:\n  learning_rate: 0.1\nlr_scheduler:\n  lr_end: 0.0\n",
                      "dup4.yaml:3:", "lr_scheduler", "duplicate key", "line 1 as lr_schedule", NULL);
    expect_load_error("dup5.yaml",
                      "optimizer:\n  muon_config:\n    muon_ns_coefficients: null\n  ns_coefficients: null\n",
                      "dup5.yaml:4:", "optimizer.ns_coefficients", "duplicate key", NULL);
    /* A shared value with the wrong type names the name it was given by, and sets nothing. */
    expect_load_error("sh8.yaml", "lr_scheduler:\n  learning_rate: fast\n", "sh8.yaml:2:", "lr_scheduler.learning_rate",
                      "expected a finite number", "found \"fast\" (a string)", NULL);
    expect_set_error("lr_scheduler.learning_rate=[1]", "--set lr_scheduler.learning_rate=[1]",
                     "lr_scheduler.learning_rate", "expected a finite number", "found a sequence", NULL);
    expect_load_error("sh9.yaml", "lr_schedule:\n  total_steps: 100\n", "sh9.yaml:2:", "lr_scheduler.total_steps",
                      "total steps come from training.steps", NULL);
    expect_load_error("sh10.yaml", "lr_scheduler:\n  typo: 1\n", "sh10.yaml:2:", "lr_scheduler.typo", "unknown key",
                      NULL);
}

/* Every rule of docs/CONFIG.md "errors before anything is built" (and docs/NUMERICS.md's),
 * each message naming the file, the line, the key, what was expected and what was found. */
static void test_contract_rules(void **state) {
    (void)state;
    /* fp32_main_params with a reduce dtype other than float32. */
    expect_invalid("r1.yaml",
                   "optimizer:\n  fp32_main_params: true\nfsdp_config:\n  mix_precision:\n"
                   "    reduce_dtype: float16\n",
                   1, "r1.yaml:5: fsdp_config.mix_precision.reduce_dtype", "r1.yaml:2: optimizer.fp32_main_params",
                   "expected float32", "found float16", NULL);
    /* Every dtype one of float16, bfloat16, float32 (and the Newton-Schulz dtype float32 or bfloat16). */
    expect_load_error("r2.yaml", "fsdp_config:\n  mix_precision:\n    reduce_dtype: float64\n",
                      "r2.yaml:3:", "fsdp_config.mix_precision.reduce_dtype",
                      "expected one of float16, bfloat16, float32", "found \"float64\" (a string)", NULL);
    expect_load_error("r3.yaml", "optimizer:\n  muon_config:\n    muon_ns_dtype: float16\n",
                      "r3.yaml:3:", "optimizer.muon_config.muon_ns_dtype", "expected one of float32, bfloat16",
                      "found \"float16\" (a string)", NULL);
    /* The Gram form of Newton-Schulz on FP32 operands only. */
    expect_invalid("r3g.yaml", "optimizer:\n  muon_config:\n    muon_ns_form: gram\n    muon_ns_dtype: bfloat16\n", 1,
                   "r3g.yaml:3: optimizer.muon_config.muon_ns_form", "not supported in bf16", "found gram", NULL);
    expect_invalid("r3t.yaml", "optimizer:\n  muon_config:\n    muon_ns_form: torch\n", 1,
                   "r3t.yaml:3: optimizer.muon_config.muon_ns_form", "torch.optim.Muon's iteration is a bf16 one",
                   "found torch", NULL);
    /* residual16: with main params, rounding to nearest, host memory, bfloat16 weights. */
    expect_invalid("r3r.yaml", "optimizer:\n  fp32_main_params: false\n  main_param_storage: residual16\n", 1,
                   "r3r.yaml:3: optimizer.main_param_storage", "r3r.yaml:2: optimizer.fp32_main_params", NULL);
    expect_invalid("r3s.yaml", "optimizer:\n  main_param_storage: residual16\n  stochastic_rounding: true\n", 1,
                   "r3s.yaml:2: optimizer.main_param_storage", "rounded to nearest even",
                   "r3s.yaml:3: optimizer.stochastic_rounding", NULL);
    expect_invalid("r3c.yaml", "optimizer:\n  main_param_storage: residual16\nkernels:\n  backend: cuda\n", 1,
                   "r3c.yaml:2: optimizer.main_param_storage", "not supported on kernels.backend cuda",
                   "r3c.yaml:4: kernels.backend", NULL);
    expect_invalid("r3f.yaml", "model_init_dtype: float16\noptimizer:\n  main_param_storage: residual16\n", 1,
                   "r3f.yaml:3: optimizer.main_param_storage", "r3f.yaml:1: model_init_dtype",
                   "not the high half of its FP32 value", NULL);
    expect_load_error("r3x.yaml", "optimizer:\n  main_param_storage: bf16\n",
                      "r3x.yaml:2:", "optimizer.main_param_storage", "expected one of fp32, residual16", NULL);
    expect_load_error("r3h.yaml", "optimizer:\n  muon_config:\n    muon_ns_form: gramm\n",
                      "r3h.yaml:3:", "optimizer.muon_config.muon_ns_form", "expected one of standard, gram, torch",
                      NULL);
    /* max_norm, batch sizes, the global batch multiple. */
    expect_invalid("r4.yaml", "training:\n  max_grad_norm: 0\n", 1,
                   "r4.yaml:2: training.max_norm (as training.max_grad_norm)", "expected a number > 0", "found 0.0",
                   NULL);
    expect_invalid("r5.yaml", "runner_config:\n  batch_size: 0\n", 1,
                   "r5.yaml:2: training.local_batch_size (as runner_config.batch_size)", "expected an integer > 0",
                   "found 0", NULL);
    expect_invalid("r6.yaml", "training:\n  local_batch_size: 4\n  global_batch_size: 20\n", 2,
                   "r6.yaml:3: training.global_batch_size", "expected a multiple of", "4 x 2 = 8",
                   "r6.yaml:2: training.local_batch_size", "found 20", NULL);
    /* asym5 with more than five steps, in both dialects. */
    expect_invalid("r7.yaml", "optimizer:\n  ns_steps: 7\n", 1,
                   "r7.yaml:2: optimizer.muon_config.muon_ns_steps (as optimizer.ns_steps)",
                   "expected at most 5 with muon_ns_variant asym5", "optimizer.muon_config.muon_ns_variant (default)",
                   "found 7", NULL);
    /* η ≤ lr_end for PolynomialWithWarmUpLR; with MindFormers' one learning_rate it is one error on that key. */
    expect_invalid("r8.yaml",
                   "lr_schedule:\n  type: PolynomialWithWarmUpLR\n  learning_rate: 1.0e-4\n  lr_end: 1.0e-4\n", 1,
                   "r8.yaml:3: optimizer.adamw_config.adamw_lr (as lr_scheduler.learning_rate)",
                   "expected lr_scheduler.learning_rate > lr_end", "found 0.0001 <= 0.0001",
                   "r8.yaml:4: lr_scheduler.lr_end", NULL);
    {
        static ht_config cfg;
        ht_error err = {0};
        assert_ht_ok(load_text("r9.yaml",
                               "lr_schedule:\n  type: PolynomialWithWarmUpLR\n  learning_rate: 1.0e-4\n"
                               "  lr_end: 1.0e-3\n",
                               &cfg, &err),
                     &err);
        assert_int_equal(ht_config_validate(&cfg, 1, &err), HT_ERR_CONFIG);
        assert_true(strstr(err.msg, "configuration errors") == NULL); /* one, not two */
        /* A specific muon_lr above lr_end leaves only AdamW's shared one wrong. */
        assert_ht_ok(ht_config_set(&cfg, "optimizer.muon_config.muon_lr=0.01", &err), &err);
        assert_int_equal(ht_config_validate(&cfg, 1, &err), HT_ERR_CONFIG);
        assert_contains(err.msg, "optimizer.adamw_config.adamw_lr (as lr_scheduler.learning_rate)");
        assert_true(strstr(err.msg, "muon_lr") == NULL);
    }
    /* Not YAML, a wrong type, a duplicate key. */
    expect_load_error("r10.yaml", "training:\n  steps: [1\n", "r10.yaml:", "not valid YAML", NULL);
    expect_load_error("r11.yaml", "training:\n  max_steps: \"ten\"\n", "r11.yaml:2:", "training.max_steps",
                      "expected an integer", "found \"ten\" (a string)", NULL);
    expect_load_error("r12.yaml", "training:\n  steps: 1\n  max_steps: 2\n", "r12.yaml:3:", "training.max_steps",
                      "duplicate key", "training.steps was already set on line 2", NULL);
    /* docs/NUMERICS.md: matched_adamw_rms >= 0, custom coefficients finite and not shorter than ns_steps. */
    expect_invalid("r13.yaml", "optimizer:\n  matched_adamw_rms: -0.2\n", 1,
                   "r13.yaml:2: optimizer.muon_config.muon_matched_adamw_rms (as optimizer.matched_adamw_rms)",
                   "expected a number >= 0", "found -0.2", NULL);
    expect_load_error("r14.yaml", "optimizer:\n  ns_coefficients: [3.4, .nan, 2.0]\n",
                      "r14.yaml:2:", "optimizer.ns_coefficients", "expected null, [a, b, c]", "found a sequence", NULL);
    expect_invalid("r15.yaml",
                   "optimizer:\n  muon_config:\n    muon_ns_variant: custom\n    muon_ns_steps: 6\n"
                   "    muon_ns_coefficients: [[[3.4445, -4.775, 2.0315], 3], [2.0, -1.5, 0.5]]\n",
                   1, "r15.yaml:5: optimizer.muon_config.muon_ns_coefficients",
                   "expected a schedule of at least muon_ns_steps = 6 steps",
                   "r15.yaml:4: optimizer.muon_config.muon_ns_steps", "found 4", NULL);
    {
        /* Non-finite coefficients can only come from code; the validator still refuses them. */
        static ht_config cfg;
        ht_error err = {0};
        char *set[] = {"optimizer.muon_config.muon_ns_variant=custom",
                       "optimizer.muon_config.muon_ns_coefficients=[1.0, 2.0, 3.0]"};
        assert_ht_ok(ht_config_load(NULL, 2, set, &cfg, &err), &err);
        assert_ht_ok(ht_config_validate(&cfg, 1, &err), &err); /* [a, b, c] runs ns_steps times: never short */
        cfg.optimizer.muon.ns_coefficients.abc[0][1] = INFINITY;
        assert_int_equal(ht_config_validate(&cfg, 1, &err), HT_ERR_CONFIG);
        assert_contains(err.msg, "optimizer.muon_config.muon_ns_coefficients (--set)");
        assert_contains(err.msg, "expected finite coefficients");
        assert_contains(err.msg, "found [1, inf, 3]");
        /* A segmented schedule without ns_steps given runs its own length. */
        char *seg[] = {"optimizer.muon_config.muon_ns_variant=custom",
                       "optimizer.muon_config.muon_ns_coefficients=[[1.0, 2.0, 3.0]]"};
        assert_ht_ok(ht_config_load(NULL, 2, seg, &cfg, &err), &err);
        assert_ht_ok(ht_config_validate(&cfg, 1, &err), &err);
    }
    /* fp16 loss scaling. */
    expect_invalid("r16.yaml", "training:\n  loss_scale_backoff_factor: 1.5\n", 1,
                   "r16.yaml:2: training.loss_scale_backoff_factor", "expected a number in (0, 1)", "found 1.5", NULL);
    expect_invalid("r17.yaml", "training:\n  loss_scale_growth_factor: 1\n", 1,
                   "r17.yaml:2: training.loss_scale_growth_factor", "expected a number > 1", "found 1.0", NULL);
    expect_invalid("r18.yaml", "training:\n  loss_scale_initial: 2\n  loss_scale_min: 4\n", 1,
                   "r18.yaml:2: training.loss_scale_initial", "expected at least training.loss_scale_min = 4",
                   "r18.yaml:3: training.loss_scale_min", "found 2", NULL);
    expect_invalid("r19.yaml", "training:\n  loss_scale_hysteresis: 0\n  loss_scale_growth_interval: -1\n", 1,
                   "2 configuration errors", "r19.yaml:2: training.loss_scale_hysteresis", "expected an integer > 0",
                   "r19.yaml:3: training.loss_scale_growth_interval", "found -1", NULL);
    expect_invalid("r20.yaml", "training:\n  loss_scale_min: 0\n", 1, "r20.yaml:2: training.loss_scale_min",
                   "expected a number > 0", "found 0.0", NULL);
}

/* ---------------------------------------------------------------- the log */

static void test_log(void **state) {
    (void)state;
    static ht_config cfg;
    ht_error err = {0};
    const char *path = write_config("log.yaml", "training:\n  steps: 77\n");
    char *set[] = {"training.seed=5"};
    assert_ht_ok(ht_config_load(path, 1, set, &cfg, &err), &err);

    char out_path[1200];
    snprintf(out_path, sizeof(out_path), "%s/stderr.txt", scratch_dir("log_out"));
    fflush(stderr);
    int saved = dup(STDERR_FILENO);
    int fd = open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    assert_true(saved >= 0 && fd >= 0);
    dup2(fd, STDERR_FILENO);
    close(fd);
    ht_config_log(&cfg);
    fflush(stderr);
    dup2(saved, STDERR_FILENO);
    close(saved);

    char *text = NULL;
    size_t size = 0;
    assert_ht_ok(ht_read_file(out_path, &text, &size, &err), &err);
    assert_contains(text, "Trainer config from ");
    assert_contains(text, "training.steps");
    assert_contains(text, "77");
    assert_contains(text, "file, line 2");
    assert_contains(text, "command line");
    assert_contains(text, "optimizer.adamw_config.no_weight_decay");
    assert_contains(text, "[\"*bias*\", \"*norm*\", \"*ln_*\"]");
    assert_contains(text, "fsdp_config.mix_precision.reduce_dtype");
    assert_true(strstr(text, "total_steps") == NULL);
    /* One line per key, plus the title and the header. */
    int lines = 0;
    for (const char *p = text; *p; p++) lines += *p == '\n';
    assert_int_equal(lines, ht_config_key_count() - 1 + 2);
    /* Aligned: the value column starts at the same offset on every key line. */
    const char *a = strstr(text, "training.steps"), *b = strstr(text, "model.name");
    const char *a_line = a, *b_line = b;
    while (a_line > text && a_line[-1] != '\n') a_line--;
    while (b_line > text && b_line[-1] != '\n') b_line--;
    const char *a_val = strstr(a, "77"), *b_val = strstr(b, "qwen2");
    assert_int_equal(a_val - a_line, b_val - b_line);
    free(text);
}

static void test_log_section(void **state) {
    (void)state;
    static ht_config cfg;
    ht_error err = {0};
    const char *path = write_config("sec.yaml", "optimizer:\n  muon_config:\n    muon_momentum: 0.9\n"
                                                "lr_scheduler:\n  learning_rate: 0.003\n");
    char *set[] = {"optimizer.muon_config.muon_ns_steps=4"};
    assert_ht_ok(ht_config_load(path, 1, set, &cfg, &err), &err);

    char out_path[1200];
    snprintf(out_path, sizeof(out_path), "%s/stderr.txt", scratch_dir("log_section_out"));
    fflush(stderr);
    int saved = dup(STDERR_FILENO);
    int fd = open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    assert_true(saved >= 0 && fd >= 0);
    dup2(fd, STDERR_FILENO);
    close(fd);
    ht_config_log_section(&cfg, "muon", "optimizer.muon_config.");
    fflush(stderr);
    dup2(saved, STDERR_FILENO);
    close(saved);

    char *text = NULL;
    size_t size = 0;
    assert_ht_ok(ht_read_file(out_path, &text, &size, &err), &err);
    assert_contains(text, "Effective muon config");
    assert_contains(text, "default");
    assert_contains(text, "configured");
    assert_contains(text, "final");
    assert_contains(text, "0.9 (file, line 3)");
    assert_contains(text, "0.003 (file, line 5, as lr_scheduler.learning_rate)");
    assert_contains(text, "4 (command line)");
    assert_true(strstr(text, "adamw_lr") == NULL);               /* only the section */
    assert_true(strstr(text, "optimizer.muon_config.") == NULL); /* names relative to the prefix */
    /* A row per key under the prefix, plus the title and the header; unconfigured rows show "-". */
    int lines = 0, keys = 0;
    for (const char *p = text; *p; p++) lines += *p == '\n';
    for (int i = 0; i < ht_config_key_count(); i++)
        keys += strncmp(ht_config_key_name(i), "optimizer.muon_config.", 22) == 0;
    assert_int_equal(lines, keys + 2);
    const char *row = strstr(text, "muon_ns_dtype");
    assert_non_null(row);
    const char *eol = strchr(row, '\n');
    char line[512];
    snprintf(line, sizeof(line), "%.*s", (int)(eol - row), row);
    assert_contains(line, "float32  ");
    assert_contains(line, " -  ");
    free(text);
}

/* Hostile files are refused fast: more than 1 MiB, or brackets nested past
 * 64 levels (libyaml's time grows with the square of that nesting); brackets
 * inside quotes and comments do not count. */
static void test_size_and_nesting_caps(void **state) {
    (void)state;
    static ht_config cfg;
    ht_error err = {0};
    char *text = malloc((2 << 20) + 1);
    memset(text, '[', 2 << 20);
    text[2 << 20] = '\0';
    double t0 = ht_time_seconds();
    assert_int_equal(load_text("huge.yaml", text, &cfg, &err), HT_ERR_CONFIG);
    assert_non_null(strstr(err.msg, "expected a configuration of at most 1048576 bytes"));
    text[100000] = '\0';
    assert_int_equal(load_text("deep.yaml", text, &cfg, &err), HT_ERR_CONFIG);
    assert_non_null(strstr(err.msg, "deep.yaml:1: brackets nested deeper than 64 levels"));
    assert_true(ht_time_seconds() - t0 < 1.0);
    free(text);
    char quoted[512], brackets[101];
    memset(brackets, '[', 100);
    brackets[100] = '\0';
    snprintf(quoted, sizeof(quoted), "data:\n  path: \"%s\"  # %s\n", brackets, brackets);
    assert_ht_ok(load_text("quoted.yaml", quoted, &cfg, &err), &err);
    assert_string_equal(cfg.data.path, brackets);
}

/* A FIFO, a device or a directory as the config is an error naming the file
 * and what it is, at once: opened plainly, a FIFO waits for a writer forever
 * (the watchdog fails the test instead of hanging). */
static void test_config_that_is_not_a_file(void **state) {
    (void)state;
    static ht_config cfg;
    ht_error err = {0};
    char fifo[1200];
    snprintf(fifo, sizeof(fifo), "%s/fifo.yaml", scratch_dir("config_fifo"));
    assert_int_equal(mkfifo(fifo, 0600), 0);
    watchdog(5, "ht_config_load of a FIFO");
    assert_int_equal(ht_config_load(fifo, 0, NULL, &cfg, &err), HT_ERR_IO);
    watchdog(0, NULL);
    assert_contains(err.msg, "fifo.yaml: expected a file, found a FIFO (named pipe)");
    assert_int_equal(ht_config_load("/dev/null", 0, NULL, &cfg, &err), HT_ERR_IO);
    assert_contains(err.msg, "/dev/null: expected a file, found a character device");
    assert_int_equal(ht_config_load(scratch_dir("config_dir"), 0, NULL, &cfg, &err), HT_ERR_IO);
    assert_contains(err.msg, "config_dir: expected a file, found a directory");
}

/* The 1 MiB cap is checked on the file's size before a byte is read: a
 * sparse 3 GiB file costs neither the time nor the memory of reading it. */
static void test_config_size_checked_before_reading(void **state) {
    (void)state;
    static ht_config cfg;
    ht_error err = {0};
    char path[1200];
    snprintf(path, sizeof(path), "%s/huge.yaml", scratch_dir("config_sparse"));
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, (off_t)3 << 30), 0);
    close(fd);
    double rss = peak_rss_mib(), t0 = ht_time_seconds();
    assert_int_equal(ht_config_load(path, 0, NULL, &cfg, &err), HT_ERR_CONFIG);
    double took = ht_time_seconds() - t0, grew = peak_rss_mib() - rss;
    unlink(path);
    assert_contains(err.msg, "huge.yaml: 3221225472 bytes; expected a configuration of at most 1048576 bytes");
    printf("  refused in %.4f s, peak RSS +%.0f MiB\n", took, grew);
    if (took > 5.0 || grew > 256) fail_msg("the cap cost %.1f s and %.0f MiB: the file was read", took, grew);
}

/* With model.from_pretrained the model keys are the folder's config.json's:
 * the values in force, sourced "config.json of <folder>" in the log; a key
 * the file set otherwise is named as unused; model.lora is not the folder's. */
static void test_pretrained_architecture_in_force(void **state) {
    (void)state;
    static ht_config cfg;
    ht_error err = {0};
    assert_ht_ok(load_text("pretrained.yaml",
                           "model:\n  hidden_size: 512\n  from_pretrained: /models/tiny\n  lora:\n    rank: 4\n", &cfg,
                           &err),
                 &err);
    ht_model_config arch = cfg.model.arch;
    arch.hidden_size = 48;
    arch.num_hidden_layers = 2;
    arch.vocab_size = 100;
    arch.tie_word_embeddings = true;
    char out_path[1200];
    snprintf(out_path, sizeof(out_path), "%s/stderr.txt", scratch_dir("config_pretrained"));
    fflush(stderr);
    int saved = dup(STDERR_FILENO), fd = open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    assert_true(saved >= 0 && fd >= 0);
    dup2(fd, STDERR_FILENO);
    close(fd);
    ht_config_use_pretrained(&cfg, &arch);
    ht_config_log(&cfg);
    fflush(stderr);
    dup2(saved, STDERR_FILENO);
    close(saved);
    char *text = NULL;
    size_t size = 0;
    assert_ht_ok(ht_read_file(out_path, &text, &size, &err), &err);
    assert_int_equal(cfg.model.arch.hidden_size, 48);
    assert_int_equal(cfg.model.lora.rank, 4);
    int line = -1;
    assert_int_equal(ht_config_key_source(&cfg, "model.hidden_size", &line), HT_CONFIG_SOURCE_PRETRAINED);
    assert_int_equal(line, 0);
    assert_int_equal(ht_config_key_source(&cfg, "model.num_hidden_layers", &line), HT_CONFIG_SOURCE_PRETRAINED);
    assert_int_equal(ht_config_key_source(&cfg, "model.lora.rank", &line), HT_CONFIG_SOURCE_FILE);
    assert_contains(text, "model.hidden_size: 512 (file, line 2) is not used: the model is /models/tiny/config.json's, "
                          "which says 48");
    assert_true(strstr(text, "model.num_hidden_layers: 4") == NULL); /* a default overridden: no warning */
    const char *row = strstr(text, "  model.num_hidden_layers ");
    assert_non_null(row);
    size_t n = strcspn(row, "\n");
    char got[512];
    snprintf(got, sizeof(got), "%.*s", (int)(n < sizeof(got) ? n : sizeof(got) - 1), row);
    if (!strstr(got, " 2 ") || !strstr(got, "config.json of /models/tiny")) fail_msg("the row says: %s", got);
    free(text);
}

/* MindSpeed-MM's parallel.fully_shard_parallel_size is fsdp_config.shard_size,
 * auto included; both spellings in one file are a duplicate. */
static void test_mindspeed_shard_size(void **state) {
    (void)state;
    static ht_config cfg;
    ht_error err = {0};
    assert_ht_ok(load_text("ms1.yaml", "parallel:\n  fully_shard_parallel_size: 4\n", &cfg, &err), &err);
    assert_int_equal(cfg.fsdp.shard_size, 4);
    assert_string_equal(ht_config_key_spelling(&cfg, "fsdp_config.shard_size"), "parallel.fully_shard_parallel_size");
    assert_ht_ok(load_text("ms2.yaml", "parallel:\n  fully_shard_parallel_size: auto\n", &cfg, &err), &err);
    assert_int_equal(cfg.fsdp.shard_size, 0);
    assert_int_not_equal(
        load_text("ms3.yaml", "parallel:\n  fully_shard_parallel_size: 2\nfsdp_config:\n  shard_size: 2\n", &cfg, &err),
        HT_OK);
    assert_non_null(strstr(err.msg, "fully_shard_parallel_size"));
}

/* model.lora: its defaults (PEFT's: off, alpha 8, q_proj and v_proj), PEFT's
 * field names as aliases in every dialect, and the rules on its values. */
static void test_lora_keys(void **state) {
    (void)state;
    static ht_config cfg;
    ht_error err = {0};
    ht_config_defaults(&cfg);
    assert_int_equal(cfg.model.lora.rank, 0);
    assert_true(cfg.model.lora.alpha == 8.0 && cfg.model.lora.dropout == 0.0);
    assert_int_equal(cfg.model.lora.target_modules.count, 2);
    assert_string_equal(cfg.model.lora.target_modules.items[0], "q_proj");
    assert_string_equal(cfg.model.lora.target_modules.items[1], "v_proj");
    assert_false(cfg.model.lora.use_rslora || cfg.model.lora.use_muon);
    assert_string_equal(cfg.model.lora.from_pretrained, "");
    static const char *const texts[] = {
        "model:\n  lora:\n    r: 4\n    lora_alpha: 32\n    lora_dropout: 0.1\n    target_modules: [o_proj]\n",
        /* MindSpeed-MM's dialect (a parallel section): the same keys. */
        "parallel:\n  fully_shard_parallel_size: auto\nmodel:\n  lora:\n    r: 4\n    lora_alpha: 32\n"
        "    lora_dropout: 0.1\n    target_modules: [o_proj]\n",
    };
    for (int i = 0; i < 2; i++) {
        assert_ht_ok(load_text("lora.yaml", texts[i], &cfg, &err), &err);
        assert_ht_ok(ht_config_validate(&cfg, 1, &err), &err);
        assert_int_equal(cfg.model.lora.rank, 4);
        assert_true(cfg.model.lora.alpha == 32 && cfg.model.lora.dropout == 0.1);
        assert_string_equal(ht_config_key_spelling(&cfg, "model.lora.rank"), "model.lora.r");
        assert_string_equal(ht_config_key_spelling(&cfg, "model.lora.alpha"), "model.lora.lora_alpha");
        assert_string_equal(cfg.model.lora.target_modules.items[0], "o_proj");
    }
    expect_load_error("lora_dup.yaml", "model:\n  lora:\n    r: 4\n    rank: 8\n", "lora_dup.yaml:4:", "duplicate key",
                      NULL);
    expect_load_error("lora_typo.yaml", "model:\n  lora:\n    rnak: 4\n", "lora_typo.yaml:3:", "model.lora.rnak", NULL);
    expect_invalid("lora_targets.yaml", "model:\n  lora:\n    rank: 4\n    target_modules: []\n", 1,
                   "lora_targets.yaml:4: model.lora.target_modules", "because model.lora.rank > 0", NULL);
    expect_invalid("lora_alpha.yaml", "model:\n  lora:\n    rank: 4\n    alpha: 0\n", 1,
                   "lora_alpha.yaml:4: model.lora.alpha", "a number > 0", NULL);
    expect_invalid("lora_dropout.yaml", "model:\n  lora:\n    r: 4\n    lora_dropout: 1.0\n", 1,
                   "model.lora.dropout (as model.lora.lora_dropout)", "[0, 1)", NULL);
    expect_invalid("lora_rank.yaml", "model:\n  lora:\n    rank: -2\n", 1, "model.lora.rank", "found -2", NULL);
    expect_invalid("lora_from.yaml", "model:\n  lora:\n    from_pretrained: /a\n", 1,
                   "lora_from.yaml:3: model.lora.from_pretrained", "needs model.lora.rank > 0", NULL);
    /* Rank 0 is off whatever the rest says. */
    assert_ht_ok(load_text("lora_off.yaml", "model:\n  lora:\n    target_modules: []\n    alpha: 0\n", &cfg, &err),
                 &err);
    assert_ht_ok(ht_config_validate(&cfg, 1, &err), &err);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults),
        cmocka_unit_test(test_default_yaml),
        cmocka_unit_test(test_full_file),
        cmocka_unit_test(test_deepseek_keys),
        cmocka_unit_test(test_deepseek_arch_errors),
        cmocka_unit_test(test_format_roundtrip),
        cmocka_unit_test(test_missing_file),
        cmocka_unit_test(test_not_yaml),
        cmocka_unit_test(test_empty_file),
        cmocka_unit_test(test_top_level_not_mapping),
        cmocka_unit_test(test_unknown_key),
        cmocka_unit_test(test_wrong_types),
        cmocka_unit_test(test_duplicate_key),
        cmocka_unit_test(test_set_overrides),
        cmocka_unit_test(test_schedule_defaults),
        cmocka_unit_test(test_set_errors),
        cmocka_unit_test(test_switch_keys),
        cmocka_unit_test(test_paths_as_a_shell_takes_them),
        cmocka_unit_test(test_fp32_main_params_rule),
        cmocka_unit_test(test_hyperparallel_defaults),
        cmocka_unit_test(test_validation_rules),
        cmocka_unit_test(test_mindformers_and_hyperparallel_dialects),
        cmocka_unit_test(test_dialect_examples),
        cmocka_unit_test(test_mindformers_dialect_meanings),
        cmocka_unit_test(test_mindspeed_dialect),
        cmocka_unit_test(test_shared_aliases),
        cmocka_unit_test(test_mindformers_lr_keys),
        cmocka_unit_test(test_contract_rules),
        cmocka_unit_test(test_log),
        cmocka_unit_test(test_log_section),
        cmocka_unit_test(test_mindspeed_shard_size),
        cmocka_unit_test(test_context_parallel_mesh),
        cmocka_unit_test(test_size_and_nesting_caps),
        cmocka_unit_test(test_config_that_is_not_a_file),
        cmocka_unit_test(test_config_size_checked_before_reading),
        cmocka_unit_test(test_pretrained_architecture_in_force),
        cmocka_unit_test(test_lora_keys),
        cmocka_unit_test(test_pipeline_parallel_mesh),
    };
    if (getenv("HT_TEST_FILTER")) cmocka_set_test_filter(getenv("HT_TEST_FILTER"));
    return cmocka_run_group_tests(tests, NULL, NULL);
}
