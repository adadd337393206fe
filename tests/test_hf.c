/* Hugging Face directories: config.json parsing (qwen2, llama, defaults,
 * errors), config write -> read, weights save -> load (single file, sharded
 * with an index, dtype conversion, row shards), and the load errors. */
#include "harness.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "hypertrain/ckpt.h"

static void write_config(const char *dir, const char *json) {
    char path[1200];
    snprintf(path, sizeof(path), "%s/config.json", dir);
    write_file(path, json, strlen(json));
}

static void test_read_qwen2(void **state) {
    (void)state;
    const char *dir = scratch_dir("hf_qwen2");
    /* Qwen2.5-0.5B's config.json: no attention_bias (Qwen2 always has biases), no head_dim. */
    write_config(dir, "{\"architectures\": [\"Qwen2ForCausalLM\"], \"attention_dropout\": 0.0, \"bos_token_id\": "
                      "151643, \"eos_token_id\": 151643, \"hidden_act\": \"silu\", \"hidden_size\": 896, "
                      "\"initializer_range\": 0.02, \"intermediate_size\": 4864, \"max_position_embeddings\": 32768, "
                      "\"max_window_layers\": 24, \"model_type\": \"qwen2\", \"num_attention_heads\": 14, "
                      "\"num_hidden_layers\": 24, \"num_key_value_heads\": 2, \"rms_norm_eps\": 1e-06, "
                      "\"rope_theta\": 1000000.0, \"sliding_window\": 32768, \"tie_word_embeddings\": true, "
                      "\"torch_dtype\": \"bfloat16\", \"transformers_version\": \"4.40.1\", \"use_cache\": true, "
                      "\"use_sliding_window\": false, \"vocab_size\": 151936}");
    ht_model_config cfg;
    ht_error err = {0};
    assert_ht_ok(ht_hf_read_config(dir, &cfg, &err), &err);
    assert_string_equal(cfg.name, "qwen2");
    assert_int_equal(cfg.vocab_size, 151936);
    assert_int_equal(cfg.hidden_size, 896);
    assert_int_equal(cfg.intermediate_size, 4864);
    assert_int_equal(cfg.num_hidden_layers, 24);
    assert_int_equal(cfg.num_attention_heads, 14);
    assert_int_equal(cfg.num_key_value_heads, 2);
    assert_int_equal(cfg.head_dim, 0);
    assert_int_equal(cfg.max_position_embeddings, 32768);
    assert_true(cfg.rope_theta == 1e6);
    assert_true(cfg.rms_norm_eps == 1e-6);
    assert_true(cfg.attention_bias);
    assert_true(cfg.tie_word_embeddings);
    assert_true(cfg.initializer_range == 0.02);
}

static void test_read_llama_defaults(void **state) {
    (void)state;
    const char *dir = scratch_dir("hf_llama");
    write_config(dir, "{\"model_type\": \"llama\", \"vocab_size\": 32000, \"hidden_size\": 4096, "
                      "\"intermediate_size\": 11008, \"num_hidden_layers\": 32, \"num_attention_heads\": 32, "
                      "\"max_position_embeddings\": 2048, \"rope_scaling\": null, \"head_dim\": null}");
    ht_model_config cfg;
    ht_error err = {0};
    assert_ht_ok(ht_hf_read_config(dir, &cfg, &err), &err);
    assert_string_equal(cfg.name, "llama");
    assert_int_equal(cfg.num_key_value_heads, 32); /* defaults to num_attention_heads */
    assert_int_equal(cfg.head_dim, 0);
    assert_true(cfg.rope_theta == 10000.0);
    assert_true(cfg.rms_norm_eps == 1e-6);
    assert_false(cfg.attention_bias);
    assert_false(cfg.tie_word_embeddings);
    assert_true(cfg.initializer_range == 0.02);

    /* transformers 5 spelling: rope_theta inside rope_parameters; explicit head_dim and attention_bias. */
    write_config(dir, "{\"model_type\": \"llama\", \"vocab_size\": 128256, \"hidden_size\": 2048, "
                      "\"intermediate_size\": 8192, \"num_hidden_layers\": 16, \"num_attention_heads\": 32, "
                      "\"num_key_value_heads\": 8, \"head_dim\": 64, \"max_position_embeddings\": 8192, "
                      "\"rms_norm_eps\": 1e-05, \"attention_bias\": true, \"tie_word_embeddings\": true, "
                      "\"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 500000.0}}");
    assert_ht_ok(ht_hf_read_config(dir, &cfg, &err), &err);
    assert_int_equal(cfg.num_key_value_heads, 8);
    assert_int_equal(cfg.head_dim, 64);
    assert_true(cfg.rope_theta == 500000.0);
    assert_true(cfg.rms_norm_eps == 1e-5);
    assert_true(cfg.attention_bias);
    assert_true(cfg.tie_word_embeddings);
}

/* A sparse family's config.json with only the required fields: transformers'
 * defaults (Qwen2MoeConfig's, DeepseekV3Config's), not the YAML's small ones. */
static void test_read_moe_defaults(void **state) {
    (void)state;
    const char *dir = scratch_dir("hf_moe_defaults");
    const char *base = "\"vocab_size\": 100, \"hidden_size\": 64, \"intermediate_size\": 128, "
                       "\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"max_position_embeddings\": 256}";
    char json[512];
    snprintf(json, sizeof(json), "{\"model_type\": \"qwen2_moe\", %s", base);
    write_config(dir, json);
    ht_model_config cfg;
    ht_error err = {0};
    assert_ht_ok(ht_hf_read_config(dir, &cfg, &err), &err);
    const ht_moe_config *mc = &cfg.moe;
    assert_true(cfg.attention_bias); /* qkv_bias */
    assert_int_equal(mc->num_experts, 60);
    assert_int_equal(mc->num_experts_per_tok, 4);
    assert_int_equal(mc->moe_intermediate_size, 1408);
    assert_int_equal(mc->shared_expert_intermediate_size, 5632);
    assert_false(mc->norm_topk_prob);
    assert_int_equal(mc->decoder_sparse_step, 1);
    assert_int_equal(mc->mlp_only_layers.count, 0);
    assert_false(mc->output_router_logits);
    assert_true(mc->router_aux_loss_coef == 0.001);
    assert_int_equal(mc->n_shared_experts + mc->n_group + mc->topk_group + mc->first_k_dense_replace, 0);
    assert_int_equal(cfg.mla.kv_lora_rank + cfg.mla.q_lora_rank, 0);

    snprintf(json, sizeof(json), "{\"model_type\": \"deepseek_v3\", %s", base);
    write_config(dir, json);
    assert_ht_ok(ht_hf_read_config(dir, &cfg, &err), &err);
    const ht_mla_config *a = &cfg.mla;
    assert_false(cfg.attention_bias);
    assert_int_equal(a->q_lora_rank, 1536);
    assert_int_equal(a->kv_lora_rank, 512);
    assert_int_equal(a->qk_nope_head_dim, 128);
    assert_int_equal(a->qk_rope_head_dim, 64);
    assert_int_equal(a->v_head_dim, 128);
    assert_true(a->rope_interleave);
    assert_int_equal(mc->num_experts, 256); /* n_routed_experts */
    assert_int_equal(mc->n_shared_experts, 1);
    assert_int_equal(mc->num_experts_per_tok, 8);
    assert_int_equal(mc->moe_intermediate_size, 2048);
    assert_int_equal(mc->n_group, 8);
    assert_int_equal(mc->topk_group, 4);
    assert_true(mc->routed_scaling_factor == 2.5);
    assert_true(mc->norm_topk_prob);
    assert_int_equal(mc->first_k_dense_replace, 3);
    assert_int_equal(mc->shared_expert_intermediate_size + mc->decoder_sparse_step, 0);
}

static void expect_config_error(const char *dir, const char *json, const char *p1, const char *p2) {
    write_config(dir, json);
    ht_model_config cfg;
    ht_error err = {0};
    ht_status s = ht_hf_read_config(dir, &cfg, &err);
    if (s == HT_OK) fail_msg("accepted %s", json);
    if (!strstr(err.msg, "config.json") || !strstr(err.msg, p1) || (p2 && !strstr(err.msg, p2)))
        fail_msg("message '%s' lacks config.json, '%s' or '%s'", err.msg, p1, p2 ? p2 : "");
}

#define LLAMA_BASE                                                                                                     \
    "\"vocab_size\": 100, \"hidden_size\": 64, \"intermediate_size\": 128, \"num_hidden_layers\": 2, "                 \
    "\"num_attention_heads\": 4, \"max_position_embeddings\": 256"

static void test_config_errors(void **state) {
    (void)state;
    const char *dir = scratch_dir("hf_config_errors");
    expect_config_error(dir, "{\"model_type\": \"mistral\", " LLAMA_BASE "}", "model_type \"mistral\"",
                        "supported: qwen2, llama");
    expect_config_error(dir, "{" LLAMA_BASE "}", "\"model_type\" is missing", NULL);
    expect_config_error(dir,
                        "{\"model_type\": \"llama\", \"vocab_size\": 100, \"intermediate_size\": 128, "
                        "\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"max_position_embeddings\": 256}",
                        "required field \"hidden_size\" is missing", NULL);
    expect_config_error(dir,
                        "{\"model_type\": \"llama\", \"vocab_size\": 100, \"hidden_size\": \"64\", "
                        "\"intermediate_size\": 128, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, "
                        "\"max_position_embeddings\": 256}",
                        "\"hidden_size\" must be a non-negative integer, not a string", NULL);
    expect_config_error(dir, "{\"model_type\": \"llama\", " LLAMA_BASE ", \"num_key_value_heads\": 2.5}",
                        "\"num_key_value_heads\" must be a non-negative integer", NULL);
    expect_config_error(dir, "{\"model_type\": \"llama\", " LLAMA_BASE ", \"tie_word_embeddings\": 1}",
                        "\"tie_word_embeddings\" must be true or false", NULL);
    expect_config_error(dir, "{\"model_type\": \"llama\", " LLAMA_BASE ", \"rope_theta\": \"1e4\"}",
                        "\"rope_theta\" must be a number", NULL);
    expect_config_error(dir,
                        "{\"model_type\": \"llama\", " LLAMA_BASE
                        ", \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0}}",
                        "rope_scaling type llama3 is not supported", NULL);
    expect_config_error(dir, "{\"model_type\": \"qwen2\", " LLAMA_BASE ", \"use_sliding_window\": true}",
                        "use_sliding_window true is not supported", NULL);
    expect_config_error(dir, "{\"model_type\": \"llama\", " LLAMA_BASE ", \"hidden_act\": \"gelu\"}", "hidden_act gelu",
                        NULL);
    expect_config_error(dir, "{\"model_type\": \"llama\", " LLAMA_BASE ",}", "invalid JSON at byte", NULL);

    ht_model_config cfg;
    ht_error err = {0};
    const char *empty = scratch_dir("hf_no_config");
    assert_int_equal(ht_hf_read_config(empty, &cfg, &err), HT_ERR_IO);
    assert_non_null(strstr(err.msg, "config.json"));
}

static ht_model_config small_config(const char *name, bool tied) {
    ht_model_config cfg = {0};
    snprintf(cfg.name, sizeof(cfg.name), "%s", name);
    cfg.vocab_size = 16;
    cfg.hidden_size = 8;
    cfg.intermediate_size = 12;
    cfg.num_hidden_layers = 1;
    cfg.num_attention_heads = 2;
    cfg.num_key_value_heads = 1;
    cfg.max_position_embeddings = 32;
    cfg.rope_theta = 1e6;
    cfg.rms_norm_eps = 1e-6;
    cfg.attention_bias = strcmp(name, "qwen2") == 0;
    cfg.tie_word_embeddings = tied;
    cfg.initializer_range = 0.02;
    return cfg;
}

static void expect_config_equal(const ht_model_config *a, const ht_model_config *b) {
    assert_string_equal(a->name, b->name);
    assert_int_equal(a->vocab_size, b->vocab_size);
    assert_int_equal(a->hidden_size, b->hidden_size);
    assert_int_equal(a->intermediate_size, b->intermediate_size);
    assert_int_equal(a->num_hidden_layers, b->num_hidden_layers);
    assert_int_equal(a->num_attention_heads, b->num_attention_heads);
    assert_int_equal(a->num_key_value_heads, b->num_key_value_heads);
    assert_int_equal(a->head_dim, b->head_dim);
    assert_int_equal(a->max_position_embeddings, b->max_position_embeddings);
    assert_true(a->rope_theta == b->rope_theta);
    assert_true(a->rms_norm_eps == b->rms_norm_eps);
    assert_int_equal(a->attention_bias, b->attention_bias);
    assert_int_equal(a->tie_word_embeddings, b->tie_word_embeddings);
    assert_true(a->initializer_range == b->initializer_range);
}

static void test_config_round_trip(void **state) {
    (void)state;
    const char *dir = scratch_dir("hf_config_rt");
    const char *names[2] = {"qwen2", "llama"};
    for (int i = 0; i < 2; i++) {
        ht_model_config cfg = small_config(names[i], i == 0), back;
        cfg.head_dim = i == 1 ? 4 : 0;
        cfg.rms_norm_eps = 1e-5;
        ht_error err = {0};
        assert_ht_ok(ht_hf_write_config(dir, &cfg, HT_DTYPE_BF16, &err), &err);
        assert_ht_ok(ht_hf_read_config(dir, &back, &err), &err);
        expect_config_equal(&cfg, &back);
        char *text;
        char path[1200];
        snprintf(path, sizeof(path), "%s/config.json", dir);
        assert_ht_ok(ht_read_file(path, &text, NULL, &err), &err);
        assert_non_null(strstr(text, i == 0 ? "\"Qwen2ForCausalLM\"" : "\"LlamaForCausalLM\""));
        assert_non_null(strstr(text, "\"torch_dtype\": \"bfloat16\""));
        assert_non_null(strstr(text, "\"hidden_act\": \"silu\""));
        free(text);
    }
    ht_model_config cfg = small_config("qwen2", false);
    cfg.attention_bias = false;
    ht_error err = {0};
    assert_int_equal(ht_hf_write_config(dir, &cfg, HT_DTYPE_BF16, &err), HT_ERR_CONFIG);
    assert_non_null(strstr(err.msg, "biases"));
    cfg = small_config("gpt2", false);
    assert_int_equal(ht_hf_write_config(dir, &cfg, HT_DTYPE_BF16, &err), HT_ERR_CONFIG);
    assert_non_null(strstr(err.msg, "gpt2"));
}

/* A one-layer decoder's parameters with Hugging Face names. */
static void build_store(ht_param_store *store, const ht_model_config *c, ht_dtype dtype, uint64_t seed) {
    memset(store, 0, sizeof(*store));
    int64_t V = c->vocab_size, H = c->hidden_size, I = c->intermediate_size;
    int64_t KV = (int64_t)c->num_key_value_heads * (H / c->num_attention_heads);
    struct {
        const char *name;
        int ndim;
        int64_t shape[2];
    } defs[] = {
        {"model.embed_tokens.weight", 2, {V, H}},
        {"model.layers.0.input_layernorm.weight", 1, {H, 0}},
        {"model.layers.0.self_attn.q_proj.weight", 2, {H, H}},
        {"model.layers.0.self_attn.q_proj.bias", 1, {H, 0}},
        {"model.layers.0.self_attn.k_proj.weight", 2, {KV, H}},
        {"model.layers.0.self_attn.v_proj.weight", 2, {KV, H}},
        {"model.layers.0.self_attn.o_proj.weight", 2, {H, H}},
        {"model.layers.0.post_attention_layernorm.weight", 1, {H, 0}},
        {"model.layers.0.mlp.gate_proj.weight", 2, {I, H}},
        {"model.layers.0.mlp.up_proj.weight", 2, {I, H}},
        {"model.layers.0.mlp.down_proj.weight", 2, {H, I}},
        {"model.norm.weight", 1, {H, 0}},
        {"lm_head.weight", 2, {V, H}},
    };
    int n = (int)(sizeof(defs) / sizeof(defs[0]));
    if (c->tie_word_embeddings) n--;
    for (int i = 0; i < n; i++) assert_non_null(ht_params_add(store, defs[i].name, defs[i].ndim, defs[i].shape, dtype));
    ht_error err = {0};
    assert_ht_ok(ht_params_allocate(store, &err), &err);
    ht_rng rng;
    ht_rng_seed(&rng, seed);
    for (int i = 0; i < store->count; i++) {
        ht_param *p = &store->items[i];
        size_t numel = (size_t)ht_param_local_numel(p);
        float *tmp = malloc(numel * sizeof(float));
        for (size_t k = 0; k < numel; k++) tmp[k] = ht_rng_normal(&rng);
        ht_convert(p->data, p->dtype, tmp, HT_DTYPE_F32, numel);
        free(tmp);
    }
}

/* Every param of `got` equals `want` converted to got's dtype (through `via`, the file dtype). */
static void expect_same(const ht_param_store *got, const ht_param_store *want, ht_dtype via) {
    assert_int_equal(got->count, want->count);
    for (int i = 0; i < want->count; i++) {
        const ht_param *w = &want->items[i];
        const ht_param *g = ht_params_find(got, w->name);
        assert_non_null(g);
        size_t n = (size_t)ht_param_local_numel(w);
        void *a = malloc(n * 4), *b = malloc(n * 4);
        ht_convert(a, via, w->data, w->dtype, n);
        ht_convert(b, g->dtype, a, via, n);
        if (memcmp(b, g->data, n * ht_dtype_size(g->dtype)) != 0) fail_msg("%s differs after the round trip", w->name);
        free(a);
        free(b);
    }
}

static void test_save_load(void **state) {
    (void)state;
    const char *dir = scratch_dir("hf_save_load");
    ht_model_config cfg = small_config("qwen2", false);
    ht_param_store src, dst;
    ht_error err = {0};
    build_store(&src, &cfg, HT_DTYPE_F32, 1);

    /* F32 file -> F32 params: exact. */
    assert_ht_ok(ht_hf_save(dir, &cfg, &src, HT_DTYPE_F32, 0, &err), &err);
    ht_model_config back;
    assert_ht_ok(ht_hf_read_config(dir, &back, &err), &err);
    expect_config_equal(&cfg, &back);
    build_store(&dst, &cfg, HT_DTYPE_F32, 99);
    assert_ht_ok(ht_hf_load_weights(dir, &dst, &err), &err);
    expect_same(&dst, &src, HT_DTYPE_F32);
    ht_params_free(&dst);

    char path[1200];
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    ht_safetensors *st;
    assert_ht_ok(ht_safetensors_open(path, &st, &err), &err);
    assert_string_equal(ht_safetensors_metadata_get(st, "format"), "pt");
    assert_int_equal(ht_safetensors_count(st), src.count);
    ht_safetensors_close(st);
    snprintf(path, sizeof(path), "%s/model.safetensors.index.json", dir);
    assert_int_equal(access(path, F_OK), -1);

    /* BF16 file -> F32 params and -> F16 params: rounded once to bf16, then converted. */
    assert_ht_ok(ht_hf_save(dir, &cfg, &src, HT_DTYPE_BF16, 0, &err), &err);
    build_store(&dst, &cfg, HT_DTYPE_F32, 99);
    assert_ht_ok(ht_hf_load_weights(dir, &dst, &err), &err);
    expect_same(&dst, &src, HT_DTYPE_BF16);
    ht_params_free(&dst);
    build_store(&dst, &cfg, HT_DTYPE_F16, 99);
    assert_ht_ok(ht_hf_load_weights(dir, &dst, &err), &err);
    expect_same(&dst, &src, HT_DTYPE_BF16);
    ht_params_free(&dst);

    /* A rank's shard of rows: only rows [2, 5) of the embedding are read. */
    build_store(&dst, &cfg, HT_DTYPE_BF16, 99);
    ht_param_store part = {0};
    int64_t shape[2] = {cfg.vocab_size, cfg.hidden_size};
    ht_param *p = ht_params_add(&part, "model.embed_tokens.weight", 2, shape, HT_DTYPE_BF16);
    ht_param_set_rows(p, 2, 5);
    assert_ht_ok(ht_params_allocate(&part, &err), &err);
    assert_ht_ok(ht_hf_load_weights(dir, &part, &err), &err); /* the other tensors only draw a warning */
    ht_param *whole = ht_params_find(&dst, "model.embed_tokens.weight");
    assert_ht_ok(ht_hf_load_weights(dir, &dst, &err), &err);
    assert_memory_equal(p->data, (uint16_t *)whole->data + 2 * cfg.hidden_size, 3 * cfg.hidden_size * 2);
    ht_params_free(&part);

    /* A partial shard cannot be exported. */
    ht_param_set_rows(ht_params_find(&dst, "model.norm.weight"), 0, 3);
    assert_int_equal(ht_hf_save(dir, &cfg, &dst, HT_DTYPE_BF16, 0, &err), HT_ERR_INVALID);
    assert_non_null(strstr(err.msg, "model.norm.weight"));
    ht_params_free(&dst);
    ht_params_free(&src);
}

static void test_sharded(void **state) {
    (void)state;
    const char *dir = scratch_dir("hf_sharded");
    ht_model_config cfg = small_config("llama", true);
    ht_param_store src, dst;
    ht_error err = {0};
    build_store(&src, &cfg, HT_DTYPE_F32, 2);
    assert_null(ht_params_find(&src, "lm_head.weight"));

    /* A single file first: the sharded save must remove it, or it would shadow the shards. */
    assert_ht_ok(ht_hf_save(dir, &cfg, &src, HT_DTYPE_BF16, 0, &err), &err);
    assert_ht_ok(ht_hf_save(dir, &cfg, &src, HT_DTYPE_BF16, 300, &err), &err);
    char path[1200];
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    assert_int_equal(access(path, F_OK), -1);

    snprintf(path, sizeof(path), "%s/model.safetensors.index.json", dir);
    char *text;
    size_t len;
    assert_ht_ok(ht_read_file(path, &text, &len, &err), &err);
    ht_json *index;
    assert_ht_ok(ht_json_parse(text, len, path, &index, &err), &err);
    free(text);
    size_t total = (size_t)ht_params_total_numel(&src) * 2;
    assert_true(ht_json_get(ht_json_get(index, "metadata"), "total_size")->number == (double)total);
    const ht_json *map = ht_json_get(index, "weight_map");
    assert_int_equal(map->count, src.count);
    /* Every shard holds at most 300 bytes unless one tensor alone is larger; count them. */
    int nshards = 0;
    for (size_t i = 0; i < map->count; i++) {
        int k, n;
        assert_int_equal(sscanf(map->items[i].string, "model-%05d-of-%05d.safetensors", &k, &n), 2);
        if (n > nshards) nshards = n;
    }
    assert_true(nshards > 2);
    for (int k = 1; k <= nshards; k++) {
        char shard[1300];
        snprintf(shard, sizeof(shard), "%s/model-%05d-of-%05d.safetensors", dir, k, nshards);
        ht_safetensors *st;
        assert_ht_ok(ht_safetensors_open(shard, &st, &err), &err);
        size_t bytes = 0;
        for (int i = 0; i < ht_safetensors_count(st); i++) {
            const ht_st_tensor *t = ht_safetensors_tensor(st, i);
            bytes += t->nbytes;
            const ht_json *where = ht_json_get(map, t->name);
            assert_non_null(where);
            assert_non_null(strstr(shard, where->string));
        }
        assert_true(bytes <= 300 || ht_safetensors_count(st) == 1);
        ht_safetensors_close(st);
    }
    ht_json_free(index);

    build_store(&dst, &cfg, HT_DTYPE_F32, 99);
    assert_ht_ok(ht_hf_load_weights(dir, &dst, &err), &err);
    expect_same(&dst, &src, HT_DTYPE_BF16);
    ht_params_free(&dst);

    /* A tensor in two shards: shard 1 replaced by a file holding every tensor
     * (other values), so the tensors the index maps to the other shards are
     * there twice. Refused, naming both files, rather than read from either. */
    char other[1100], first[1300];
    snprintf(other, sizeof(other), "%s/other", dir);
    ht_param_store dup;
    build_store(&dup, &cfg, HT_DTYPE_F32, 77);
    assert_ht_ok(ht_hf_save(other, &cfg, &dup, HT_DTYPE_BF16, 0, &err), &err);
    ht_params_free(&dup);
    snprintf(first, sizeof(first), "%s/model-00001-of-%05d.safetensors", dir, nshards);
    snprintf(path, sizeof(path), "%s/model.safetensors", other);
    char keep[1400];
    snprintf(keep, sizeof(keep), "%s.kept", first);
    assert_int_equal(rename(first, keep), 0);
    assert_int_equal(rename(path, first), 0);
    build_store(&dst, &cfg, HT_DTYPE_F32, 99);
    assert_int_equal(ht_hf_load_weights(dir, &dst, &err), HT_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "is in both model-0000"));
    assert_non_null(strstr(err.msg, "and model-00001-of-"));
    ht_params_free(&dst);
    assert_int_equal(rename(keep, first), 0);

    /* An untied save carries lm_head.weight: a tied store ignores it silently. */
    ht_model_config untied = small_config("llama", false);
    ht_param_store full;
    build_store(&full, &untied, HT_DTYPE_F32, 3);
    assert_ht_ok(ht_hf_save(dir, &untied, &full, HT_DTYPE_F32, 0, &err), &err);
    build_store(&dst, &cfg, HT_DTYPE_F32, 99);
    assert_ht_ok(ht_hf_load_weights(dir, &dst, &err), &err);
    assert_memory_equal(ht_params_find(&dst, "model.embed_tokens.weight")->data,
                        ht_params_find(&full, "model.embed_tokens.weight")->data,
                        (size_t)(cfg.vocab_size * cfg.hidden_size) * 4);
    snprintf(path, sizeof(path), "%s/model.safetensors.index.json", dir);
    assert_int_equal(access(path, F_OK), -1); /* the single-file save removed the stale index */
    ht_params_free(&dst);
    ht_params_free(&full);
    ht_params_free(&src);
}

static void test_load_errors(void **state) {
    (void)state;
    const char *dir = scratch_dir("hf_load_errors");
    ht_model_config cfg = small_config("qwen2", false);
    ht_param_store src, dst;
    ht_error err = {0};
    build_store(&src, &cfg, HT_DTYPE_F32, 4);
    assert_ht_ok(ht_hf_save(dir, &cfg, &src, HT_DTYPE_BF16, 0, &err), &err);

    /* A model built from a config with a different hidden_size. */
    ht_model_config wide = cfg;
    wide.hidden_size = 16;
    build_store(&dst, &wide, HT_DTYPE_F32, 99);
    assert_int_equal(ht_hf_load_weights(dir, &dst, &err), HT_ERR_FORMAT);
    if (!strstr(err.msg, "model.safetensors") || !strstr(err.msg, "'model.embed_tokens.weight' has shape [16, 8]") ||
        !strstr(err.msg, "expects [16, 16]"))
        fail_msg("unexpected message: %s", err.msg);
    ht_params_free(&dst);

    /* Params the file lacks are all listed. */
    build_store(&dst, &cfg, HT_DTYPE_F32, 99);
    int64_t shape[2] = {8, 8};
    ht_param_store more = {0};
    for (int i = 0; i < dst.count; i++)
        ht_params_add(&more, dst.items[i].name, dst.items[i].ndim, dst.items[i].shape, HT_DTYPE_F32);
    ht_params_add(&more, "model.layers.1.self_attn.q_proj.weight", 2, shape, HT_DTYPE_F32);
    ht_params_add(&more, "model.layers.1.self_attn.o_proj.weight", 2, shape, HT_DTYPE_F32);
    assert_ht_ok(ht_params_allocate(&more, &err), &err);
    assert_int_equal(ht_hf_load_weights(dir, &more, &err), HT_ERR_FORMAT);
    if (!strstr(err.msg, "2 model parameters are missing") ||
        !strstr(err.msg, "model.layers.1.self_attn.q_proj.weight, model.layers.1.self_attn.o_proj.weight"))
        fail_msg("unexpected message: %s", err.msg);
    ht_params_free(&more);
    ht_params_free(&dst);

    /* An integer param cannot take float weights. */
    ht_param_store ints = {0};
    int64_t one[1] = {8};
    ht_params_add(&ints, "model.norm.weight", 1, one, HT_DTYPE_I32);
    assert_ht_ok(ht_params_allocate(&ints, &err), &err);
    assert_int_equal(ht_hf_load_weights(dir, &ints, &err), HT_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "cannot be converted"));
    ht_params_free(&ints);

    /* An index that points at a shard without the tensor; a directory with no weights. */
    char path[1200];
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    char renamed[1300];
    snprintf(renamed, sizeof(renamed), "%s/model-00001-of-00001.safetensors", dir);
    assert_int_equal(rename(path, renamed), 0);
    snprintf(path, sizeof(path), "%s/model.safetensors.index.json", dir);
    const char *index = "{\"metadata\": {}, \"weight_map\": {\"model.norm.weight\": "
                        "\"model-00001-of-00001.safetensors\", \"ghost\": \"model-00001-of-00001.safetensors\"}}";
    write_file(path, index, strlen(index));
    build_store(&dst, &cfg, HT_DTYPE_F32, 99);
    assert_int_equal(ht_hf_load_weights(dir, &dst, &err), HT_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "maps tensor 'ghost'"));
    remove(path);
    assert_int_equal(ht_hf_load_weights(dir, &dst, &err), HT_ERR_IO);
    assert_non_null(strstr(err.msg, "neither model.safetensors nor"));
    ht_params_free(&dst);
    ht_params_free(&src);
}

int main(void) {
    ht_log_set_level(HT_LOG_ERROR); /* the expected "unused tensors" warnings */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_read_qwen2),        cmocka_unit_test(test_read_llama_defaults),
        cmocka_unit_test(test_read_moe_defaults), cmocka_unit_test(test_config_errors),
        cmocka_unit_test(test_config_round_trip), cmocka_unit_test(test_save_load),
        cmocka_unit_test(test_sharded),           cmocka_unit_test(test_load_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
