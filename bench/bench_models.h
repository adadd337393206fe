/* The models the benchmarks share, so every figure in bench/RESULTS.md is
 * measured on the same architecture as its PyTorch peer. */
#ifndef HT_BENCH_MODELS_H
#define HT_BENCH_MODELS_H

#include <stdbool.h>
#include <stdio.h>

#include "hypertrain/model.h"

/* The 31M-parameter Qwen2 of the train-step and checkpoint benchmarks (and of
 * bench/peers/torch_train_step.py): vocab 8192, hidden 512, 8 layers, 8 heads,
 * 2 KV heads, intermediate 1408, untied embeddings, q/k/v biases. */
static inline ht_model_config bench_model_31m(void) {
    return (ht_model_config){.name = "qwen2",
                             .vocab_size = 8192,
                             .hidden_size = 512,
                             .intermediate_size = 1408,
                             .num_hidden_layers = 8,
                             .num_attention_heads = 8,
                             .num_key_value_heads = 2,
                             .max_position_embeddings = 256,
                             .rope_theta = 10000.0,
                             .rms_norm_eps = 1e-6,
                             .attention_bias = true,
                             .tie_word_embeddings = false,
                             .initializer_range = 0.02};
}

/* Qwen2.5-0.5B's architecture (its config.json): vocab 151936, hidden 896,
 * 24 layers, 14 heads, 2 KV heads (head dim 64), intermediate 4864, tied
 * embeddings, q/k/v biases; random init. */
static inline ht_model_config bench_model_qwen25_05b(void) {
    return (ht_model_config){.name = "qwen2",
                             .vocab_size = 151936,
                             .hidden_size = 896,
                             .intermediate_size = 4864,
                             .num_hidden_layers = 24,
                             .num_attention_heads = 14,
                             .num_key_value_heads = 2,
                             .max_position_embeddings = 8192,
                             .rope_theta = 1000000.0,
                             .rms_norm_eps = 1e-6,
                             .attention_bias = true,
                             .tie_word_embeddings = true,
                             .initializer_range = 0.02};
}

/* A Llama-style 1B, Llama 3.2 1B's shapes: vocab 128256, hidden 2048, 16
 * layers, 32 heads, 8 KV heads (head dim 64), intermediate 8192, tied
 * embeddings, no biases, rope_theta 500000; random init. 1.24B parameters.
 * (Llama 3's rope scaling is left out: it changes no cost.) */
static inline ht_model_config bench_model_llama_1b(void) {
    return (ht_model_config){.name = "llama",
                             .vocab_size = 128256,
                             .hidden_size = 2048,
                             .intermediate_size = 8192,
                             .num_hidden_layers = 16,
                             .num_attention_heads = 32,
                             .num_key_value_heads = 8,
                             .max_position_embeddings = 8192,
                             .rope_theta = 500000.0,
                             .rms_norm_eps = 1e-5,
                             .attention_bias = false,
                             .tie_word_embeddings = true,
                             .initializer_range = 0.02};
}

/* A Qwen2-MoE the size of the 31M model's attention (hidden 512, 8 layers,
 * 8 heads, 2 KV heads, vocab 8192, untied): every layer sparse, 8 experts of
 * width 704 of which each token takes 2 (the dense model's 1408 active), a
 * shared expert of 704, no load-balancing loss. 95M parameters, 48M active
 * per token. As bench/peers/torch_train_step.py --model moe. */
static inline ht_model_config bench_model_moe(void) {
    ht_model_config c = bench_model_31m();
    snprintf(c.name, sizeof(c.name), "qwen2_moe");
    c.moe = (ht_moe_config){.num_experts = 8,
                            .num_experts_per_tok = 2,
                            .moe_intermediate_size = 704,
                            .shared_expert_intermediate_size = 704,
                            .decoder_sparse_step = 1,
                            .router_aux_loss_coef = 0.001};
    return c;
}

/* A DeepSeek-V3 in small (transformers' DeepseekV3ForCausalLM): vocab 8192,
 * hidden 512, 8 layers, 8 heads, untied. Multi-Latent Attention with a query
 * latent of 192, a key/value latent of 128, per-head q/k of 64 + 32 rotary
 * (interleaved pairs) and v of 64; no YaRN (it changes no cost). Layer 0
 * dense (intermediate 1408); layers 1-7 DeepSeekMoE: 32 routed experts of
 * width 352 in 4 groups, the top 4 from the best 2 groups, sigmoid scores
 * normalised and scaled by 2.5, one shared expert of 352 (active width 1760).
 * 141M parameters, 31M of them active per token. dense: every layer keeps
 * the dense MLP (first_k_dense_replace 8), for MLA alone. As
 * bench/peers/torch_train_step.py --model dsv3 / dsv3-dense. */
static inline ht_model_config bench_model_dsv3(bool dense) {
    ht_model_config c = bench_model_31m();
    snprintf(c.name, sizeof(c.name), "deepseek_v3");
    c.num_key_value_heads = c.num_attention_heads;
    c.attention_bias = false;
    c.mla = (ht_mla_config){.q_lora_rank = 192,
                            .kv_lora_rank = 128,
                            .qk_nope_head_dim = 64,
                            .qk_rope_head_dim = 32,
                            .v_head_dim = 64,
                            .rope_interleave = true};
    c.moe = (ht_moe_config){.num_experts = 32,
                            .num_experts_per_tok = 4,
                            .moe_intermediate_size = 352,
                            .norm_topk_prob = true,
                            .n_shared_experts = 1,
                            .n_group = 4,
                            .topk_group = 2,
                            .routed_scaling_factor = 2.5,
                            .first_k_dense_replace = dense ? c.num_hidden_layers : 1};
    return c;
}

#endif
