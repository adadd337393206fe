#!/usr/bin/env python3
"""Write the reference fixtures that hypertrain's DeepSeek-V3 tests compare against.

For each case, a small random DeepSeek-V3 model (transformers'
DeepseekV3ForCausalLM, float32, attn_implementation="eager",
experts_implementation="eager", model.train() with every dropout 0.0) is saved
to tests/fixtures/dsv3/<case>/ with save_pretrained(save_original_format=False)
(config.json + model.safetensors; generation_config.json is removed), next to
fixture.safetensors. Everything below was read in, and checked against,
transformers 5.24.0 (models/deepseek_v3/modeling_deepseek_v3.py,
configuration_deepseek_v3.py, modeling_rope_utils.py) with torch 2.15.0.

Cases (shared: vocab 100, 4 heads, num_key_value_heads 4, max_position_embeddings
64, attention_bias false, silu, num_mtp_layers 0 (written to config.json as
num_nextn_predict_layers: 0), B = 2, T = 13):

                      dsv3_a            dsv3_b             dsv3_c
  hidden_size C       56                48                 52
  num_hidden_layers   3                 2                  3
  first_k_dense_repl. 1 (layer 0 dense) 0 (all MoE)        2 (layers 0, 1 dense)
  intermediate_size   48                64 (unused)        40
  moe_intermediate I  12                16                 16
  q_lora_rank         24                null (q_proj)      20
  kv_lora_rank r      16                12                 24
  qk_nope_head_dim    8                 10                 4
  qk_rope_head_dim    4                 6                  8
  v_head_dim          12                8                  6
  rope_interleave     true              false              false
  rope                yarn, theta 1e4,  default,           yarn, theta 500,
                      factor 4, orig    theta 2000         factor 8, orig 8,
                      16, beta_fast 32,                    beta_fast 32,
                      beta_slow 1,                         beta_slow 0.05,
                      mscale 1.0,                          mscale 0.707,
                      mscale_all_dim 1                     mscale_all_dim 0.8
  n_routed_experts E  8                 13                 8
  n_group/topk_group  4 / 2             1 / 1              2 / 1
  num_experts_per_tok 2                 3                  3
  n_shared_experts    1                 2                  0
  norm_topk_prob      true              false              true
  routed_scaling      2.5               1.5                1.0
  tie_word_embeddings false             true               false
  rms_norm_eps        1e-6              1e-3               1e-5

The rope keys go in config.rope_parameters (transformers 5 has no separate
rope_scaling / rope_theta fields; a legacy rope_scaling dict with "type" is
accepted: rope_scaling={"type": "yarn", ...} with rope_theta=... becomes
rope_parameters with rope_type "yarn" added).

dsv3_b's 13 experts make the mean count 26 * 3 / 13 = 6 an integer, so the
bias update's sign(0) = 0 is exercised (the seed is redrawn until some
expert gets exactly 6 tokens). dsv3_c's beta_slow 0.05
gives a YaRN ramp with fractional entries (1/3, 2/3); dsv3_a's ramp is [0, 1].

fixture.safetensors (F32 unless said; <l> is a layer index in the model; the
MoE layers are first_k_dense_replace .. L-1: 1, 2 for dsv3_a; 0, 1 for
dsv3_b; 2 for dsv3_c; N = B*T = 26 rows, row r is token (r // T, r % T)):

  inputs              I32 (B, T)   tokens fed to the model
  targets             I32 (B, T)   next tokens (inputs shifted by one)
  logits              F32 (B, T, V) model(input_ids=inputs).logits
  loss                F32 (1,)     F.cross_entropy(logits.view(-1, V),
                                   targets.view(-1)) (mean)
  grad.<name>         F32          d loss / d param for every name in
                                   model.named_parameters() (same shapes;
                                   dsv3_c's zero-size shared-expert
                                   parameters have zero-size gradients)
  rope.inv_freq       F32 (d/2,)   model.model.rotary_emb.inv_freq,
                                   d = qk_rope_head_dim (formulas below)
  rope.cos, rope.sin  F32 (T, d)   the rotary module's output for positions
                                   0..T-1: cat(f, f) with f = pos * inv_freq,
                                   cos/sin multiplied by attention_factor
  attn_scale          F32 (1,)     the softmax scale (self_attn.scaling)
  attn_max.<l>        F32 (H,)     for EVERY layer: per head, the largest
                                   q.k * attn_scale over the batch and all
                                   (query, key) pairs, including those above
                                   the causal diagonal (taken before the
                                   mask); recorded from query_states /
                                   key_states at the eager attention call
  routing.<l>         I32 (N, k)   each token's k routed experts, sorted
                                   ascending by expert id (transformers' own
                                   topk uses sorted=False; the order is not
                                   meaningful)
  routing_weight.<l>  F32 (N, k)   the combine weight of each expert in
                                   routing.<l>, same order (transformers'
                                   topk_weights, routed_scaling_factor
                                   included)
  tokens_per_expert.<l> I32 (E,)   number of tokens routed to each expert
                                   over the batch (sums to N * k)
  group_margin.<l>    F32 (N,)     g_(topk_group) - g_(topk_group+1) of the
                                   sorted group scores (below); +inf where
                                   topk_group == n_group (dsv3_b: no group
                                   is excluded)
  topk_margin.<l>     F32 (N,)     b_(k) - b_(k+1) of the biased scores of the
                                   allowed experts, sorted
  bias_after.<l>      F32 (E,)     the aux-loss-free bias update (below)
                                   applied once, rate 1e-3, to the layer's
                                   e_score_correction_bias (in
                                   model.safetensors) with
                                   tokens_per_expert.<l>
  bf16.logits         F32 (B, T, V) transformers itself after
                                   model.to(torch.bfloat16), widened to F32
  bf16.loss           F32 (1,)     F.cross_entropy of bf16.logits in FP32
  bf16.routing.<l>    I32 (N, k)   that model's expert sets, sorted as
                                   routing.<l> (equal to it: checked)
  bf16_load.logits, bf16_load.loss, bf16_load.routing.<l>
                                   the same for the model that
                                   from_pretrained(dir, dtype=torch.bfloat16)
                                   builds (see "bf16" below; checked equal,
                                   bit for bit, to from_pretrained itself)

Parameter names and shapes (dsv3_a; every name of model.named_parameters(),
exactly the tensors of model.safetensors plus one buffer per MoE layer):

  model.embed_tokens.weight                          (100, 56)
  model.layers.<l>.input_layernorm.weight            (56,)
  model.layers.<l>.self_attn.q_a_proj.weight         (24, 56)   (q_lora, C)
  model.layers.<l>.self_attn.q_a_layernorm.weight    (24,)
  model.layers.<l>.self_attn.q_b_proj.weight         (48, 24)   (H*(nope+rope), q_lora)
  model.layers.<l>.self_attn.kv_a_proj_with_mqa.weight (20, 56) (r + rope, C)
  model.layers.<l>.self_attn.kv_a_layernorm.weight   (16,)      (r,)
  model.layers.<l>.self_attn.kv_b_proj.weight        (80, 16)   (H*(nope+v), r)
  model.layers.<l>.self_attn.o_proj.weight           (56, 48)   (C, H*v)
  model.layers.<l>.post_attention_layernorm.weight   (56,)
  dense layer 0:
  model.layers.0.mlp.{gate,up}_proj.weight           (48, 56)
  model.layers.0.mlp.down_proj.weight                (56, 48)
  MoE layers 1, 2:
  model.layers.<l>.mlp.gate.weight                   (8, 56)    router (E, C)
  model.layers.<l>.mlp.gate.e_score_correction_bias  (8,)       buffer, not a
                                                     parameter (no grad.*)
  model.layers.<l>.mlp.experts.gate_up_proj          (8, 24, 56) (E, 2I, C):
      rows [0, I) of expert e are its gate_proj, rows [I, 2I) its up_proj
  model.layers.<l>.mlp.experts.down_proj             (8, 56, 12) (E, C, I)
  model.layers.<l>.mlp.shared_experts.{gate,up}_proj.weight (12, 56) (I*n_shared, C)
  model.layers.<l>.mlp.shared_experts.down_proj.weight (56, 12)
  model.norm.weight                                  (56,)
  lm_head.weight                                     (100, 56)  (untied only)

dsv3_b has self_attn.q_proj.weight (H*(nope+rope), C) = (64, 48) instead of
q_a_proj / q_a_layernorm / q_b_proj, and no lm_head.weight (tied to
model.embed_tokens.weight, absent from named_parameters and the file).
dsv3_c (n_shared_experts 0): transformers still builds the shared expert,
with intermediate size 0: mlp.shared_experts.gate_proj.weight and
up_proj.weight are (0, C) and down_proj.weight is (C, 0); they are saved in
model.safetensors as zero-size F32 tensors (from_pretrained reads them back)
and their grad.* entries are zero-size too; the shared expert adds 0.

On disk. save_original_format=False keeps the in-memory names above (3-D
experts; 47 tensors for dsv3_a). The default save (save_original_format=True;
deepseek_v3 uses the qwen2_moe conversion) writes the Hub's per-expert layout
instead: model.layers.<l>.mlp.experts.<e>.gate_proj.weight (I, C),
.up_proj.weight (I, C), .down_proj.weight (C, I) (91 tensors for dsv3_a),
other names unchanged; from_pretrained reads either (both reloaded: identical
logits). e_score_correction_bias is a persistent buffer: it is in
state_dict() and in model.safetensors in both layouts (F32, (E,)), and
from_pretrained loads it. config.json also carries "head_dim":
qk_rope_head_dim and "qk_head_dim": nope + rope (derived, written by
__post_init__): head_dim there is NOT the attention head size.

Forward, as transformers computes it (x: (B, T, C) residual stream; all
Linear layers without bias):

  RMSNorm(x; w, eps) = w * x / sqrt(mean(x^2) + eps), computed in FP32.
  input_layernorm, post_attention_layernorm and model.norm use rms_norm_eps;
  q_a_layernorm and kv_a_layernorm are built as DeepseekV3RMSNorm(dim) and use
  the class default eps = 1e-6 whatever rms_norm_eps is (checked; dsv3_b,
  dsv3_c have rms_norm_eps 1e-3, 1e-5).

  Attention (h = input_layernorm(x)):
    q      = q_b_proj(q_a_layernorm(q_a_proj(h)))  or  q_proj(h)
             viewed (B, T, H, nope + rope): q_nope = [..., :nope],
             q_rot = [..., nope:]
    ckv    = kv_a_proj_with_mqa(h)                  (B, T, r + rope)
    c_kv   = kv_a_layernorm(ckv[..., :r]);  k_rot = ckv[..., r:] (one rope key
             shared by all heads, not normed)
    kv     = kv_b_proj(c_kv) viewed (B, T, H, nope + v): k_nope = [..., :nope],
             value = [..., nope:]
    q_rot, k_rot rotated (below); query = cat(q_nope, q_rot),
    key = cat(k_nope, k_rot broadcast to H heads)
    attn   = softmax(query . key * scale + causal mask) @ value  (softmax FP32)
    x     += o_proj(attn reshaped (B, T, H * v))

  Softmax scale: scale = (nope + rope)^-0.5, and if rope_type != "default"
  and mscale_all_dim is set (non-zero): scale *= m^2 with
  m = 0.1 * mscale_all_dim * ln(factor) + 1 (1 if factor <= 1).
  dsv3_a: 12^-0.5 * (1 + 0.1 ln 4)^2 = 0.3742606704; dsv3_b: 16^-0.5 = 0.25;
  dsv3_c: 12^-0.5 * (1 + 0.08 ln 8)^2 = 0.3927092480.

  Rotary, d = qk_rope_head_dim (config.head_dim = d), positions 0..T-1:
    default: inv_freq_i = theta^(-2i/d), i < d/2; attention_factor = 1.
    YaRN (_compute_yarn_parameters, truncate defaults to true):
      pos_i  = theta^(2i/d)
      corr(n) = d * ln(orig_max / (n * 2 pi)) / (2 ln theta)
      low = max(floor(corr(beta_fast)), 0), high = min(ceil(corr(beta_slow)), d-1)
      (high += 0.001 if low == high)
      ramp_i = clamp((i - low) / (high - low), 0, 1)
      inv_freq_i = (1 / (factor pos_i)) * ramp_i + (1 / pos_i) * (1 - ramp_i)
      (ramp 0: the original frequency, ramp 1: divided by factor)
      attention_factor = mscale(factor, mscale) / mscale(factor, mscale_all_dim)
        if both mscale and mscale_all_dim are set (non-zero), else
        mscale(factor, 1); mscale(s, m) = 0.1 m ln(s) + 1 (1 if s <= 1)
      dsv3_a: ramp [0, 1], inv_freq [1, 0.0025], attention_factor 1.0 exactly;
      dsv3_c: ramp [0, 1/3, 2/3, 1], inv_freq [1, 0.14979425, 0.0186339,
      0.00118218], attention_factor 0.9834194555. The frequencies do not
      depend on T (no dynamic update for yarn).
    cos = cos(pos * inv_freq) * attention_factor, sin likewise: the factor
    multiplies cos AND sin, so both q_rot and k_rot carry it and q_rot . k_rot
    is scaled by attention_factor^2 (independently of the softmax scale).
    rope_interleave false (rotate_half): pair (x_i, x_{i+d/2}) rotated by
      angle_i: out_i = x_i cos - x_{i+d/2} sin, out_{i+d/2} = x_{i+d/2} cos +
      x_i sin.
    rope_interleave true (apply_rotary_pos_emb_interleave): pair (x_{2i},
      x_{2i+1}) rotated by angle_i, and the result is written de-interleaved:
      out = cat([x_{2i} cos - x_{2i+1} sin]_i, [x_{2i+1} cos + x_{2i} sin]_i).
      q and k get the same permutation, so q_rot . k_rot equals the in-place
      interleaved rotation's: an implementation may keep the pairs in place.
    The "interleave" applies to q_rot and k_rot only (not to the nope part).

  Dense MLP (layers < first_k_dense_replace): down(silu(gate(h)) * up(h)),
  intermediate_size.

  MoE (h: (N, C) post-attention-norm rows):
    z  = h @ W_gate^T in FP32 (h and W cast to FP32);  s = sigmoid(z)
    b  = s + e_score_correction_bias                       (choice only)
    group scores g[t, j] = sum of the 2 largest b in group j (groups of
      E / n_group consecutive experts); the topk_group best groups are kept,
      the other experts' b set to -inf; idx = topk(b, k) (sorted=False)
    w  = s[idx] (the UNbiased sigmoid scores); if norm_topk_prob:
      w /= sum(w) + 1e-20; then w *= routed_scaling_factor (always, also with
      norm_topk_prob false)
    y  = sum_j w_j * down_e(silu(gate_e h) * up_e h), e = idx_j, with
      [gate_e; up_e] = gate_up_proj[e] and down_e = down_proj[e] (eager: the
      experts are visited in increasing index, each index_add_s its rows into
      a zeros tensor of h's dtype)
    out = y + shared_experts(h)  (an MLP of intermediate I * n_shared_experts;
      no sigmoid gate, unlike Qwen2-MoE)
  The script re-implements this whole forward in float64 from the weights
  (reference_forward) and asserts its routing equals transformers' and its
  logits are within 1e-5 relative (max abs error / max |logits|; seen 4e-7
  to 7e-7).

bf16. Two bf16 runs are stored. bf16.*: model.to(torch.bfloat16) casts every
parameter AND buffer, so the routers' weight, e_score_correction_bias and
the rotary inv_freq are bf16-rounded too (inv_freq 0.0025 becomes
0.00250244...; the angles are then computed in FP32 from the rounded value and
cos/sin cast to bf16). bf16_load.*: from_pretrained(dtype=torch.bfloat16)
keeps mlp.gate.weight and e_score_correction_bias in FP32
(_keep_in_fp32_modules_strict) and computes inv_freq in FP32 (checked: these
are exactly its FP32 tensors); everything else is bf16. The two differ by up
to 0.023 (dsv3_a), 0.047 (dsv3_b), 0.039 (dsv3_c) in the logits (max
|logits| ~3.5). In both the router runs in FP32 (z from FP32-cast operands;
sigmoid, bias, groups, topk, normalisation and scaling in FP32), each
expert's bf16 output times its FP32 weight is computed in FP32 (type
promotion) and rounded to bf16 before index_add_ into the bf16 sum;
RMSNorm normalises in FP32 and multiplies by the weight in bf16; the
attention softmax is FP32 and cast back to bf16. Both bf16 runs choose the
same expert sets as FP32 for every token (checked; a seed is redrawn
otherwise).

Aux-loss-free bias update (bias_after.<l>), following Megatron-Core
(NVIDIA/Megatron-LM, megatron/core/transformer/moe/moe_utils.py,
get_updated_expert_bias, called once per global batch from
finalize_model_grads._update_router_expert_bias with
config.moe_router_bias_update_rate; the counts are the router's
local_tokens_per_expert, an FP32 buffer summing routing_map over tokens,
all-reduced over TP x DP x CP; the bias is an FP32 buffer):

    average_tokens = tokens_per_expert.sum(-1, keepdim=True) / E
    offset         = average_tokens - tokens_per_expert
    expert_bias    = expert_bias + sign(offset) * rate        (sign(0) = 0)

i.e. an under-loaded expert (count below the mean) gets +rate, an overloaded
one -rate, one at the mean 0. Computed in numpy float32 and checked equal to
a torch transcription of those lines (rate 1e-3). dsv3_b has experts at the
mean (sign 0) in both layers.

Weights: every parameter is redrawn (the default init is std 0.02 with unit
norms and a zero bias): 2-D / 3-D weights N(0, 1/fan_in) (fan_in the last
dimension), the untied embedding N(0, 1) (tied: N(0, 1/C), as it is also
the LM head), norm weights 1 + N(0, 0.15^2), routers N(0, 9/C) (logits of
std ~3: sigmoid scores spread over ~0.3), e_score_correction_bias N(0, 0.1^2).
Losses are 5.1-5.5 (ln 100 = 4.61), max |logits| ~3.5, attn_max 2.6-6.2.
A seed is rejected and the next one (seed + 1000) drawn unless, in every MoE
layer: every token's group margin and topk margin are > 5e-3 (at 1e-3 the
engine's bf16, which rounds the router input once where transformers rounds
it twice, moved two routed rows of dsv3_b to other experts); the bias
changes at least one token's expert set against routing without it; where
topk_group < n_group the group limit changes at least one token's set against
a topk over all experts; both bf16 models choose the FP32 sets; and (dsv3_b)
some expert's count equals the mean. dsv3_a takes seed 8021, dsv3_b 65022,
dsv3_c 23 (ATTEMPTS raised to 400 for them); the script prints the seeds, margins, counts and how many tokens
the bias and the group limit change. It also reloads every directory with
from_pretrained (FP32: identical logits; bf16: identical to bf16_load.*).

Every run with the same library versions writes the same bytes (fixed seeds,
one thread, a single metadata key).
Usage: python3 tools/reference/make_dsv3_fixtures.py [OUT_DIR [CASE ...]]
"""

import copy
import math
import os
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, DeepseekV3Config
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as mdsv3
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_model_fixtures import B, T  # noqa: E402  same batch shape as the dense fixtures

MIN_MARGIN = 5e-3  # smallest topk / group margin accepted (biased scores)
BIAS_RATE = 1e-3  # moe_router_bias_update_rate of the bias_after.<l> reference
ATTEMPTS = 400
LINEAR_GAIN = 1.0  # 2-D / 3-D weights: N(0, (gain / sqrt(fan_in))^2)
ROUTER_GAIN = 3.0  # router rows: N(0, (3 / sqrt(C))^2): logits of std ~3
BIAS_STD = 0.1  # e_score_correction_bias: N(0, 0.1^2), the scores' spread is ~0.3
NORM_NOISE = 0.15  # norm weights 1 + N(0, 0.15^2)

COMMON = dict(
    vocab_size=100,
    num_attention_heads=4,
    num_key_value_heads=4,  # MLA: every head has its own k / v from the latent
    max_position_embeddings=64,
    attention_bias=False,
    attention_dropout=0.0,
    hidden_act="silu",
    num_mtp_layers=0,  # written as num_nextn_predict_layers: the model has no MTP weights
)

# (case, config fields, seed, extra conditions)
CASES = [
    ("dsv3_a",
     dict(hidden_size=56, num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=12,
          q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12,
          rope_interleave=True,
          rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                               original_max_position_embeddings=16, beta_fast=32, beta_slow=1,
                               mscale=1.0, mscale_all_dim=1.0),
          n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2, n_shared_experts=1,
          norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=1,
          tie_word_embeddings=False, rms_norm_eps=1e-6),
     21, dict(sign0=False)),
    ("dsv3_b",
     dict(hidden_size=48, num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=16,
          q_lora_rank=None, kv_lora_rank=12, qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=8,
          rope_interleave=False,
          rope_parameters=dict(rope_type="default", rope_theta=2000.0),
          n_routed_experts=13, n_group=1, topk_group=1, num_experts_per_tok=3, n_shared_experts=2,
          norm_topk_prob=False, routed_scaling_factor=1.5, first_k_dense_replace=0,
          tie_word_embeddings=True, rms_norm_eps=1e-3),
     22, dict(sign0=True)),
    ("dsv3_c",
     dict(hidden_size=52, num_hidden_layers=3, intermediate_size=40, moe_intermediate_size=16,
          q_lora_rank=20, kv_lora_rank=24, qk_nope_head_dim=4, qk_rope_head_dim=8, v_head_dim=6,
          rope_interleave=False,
          rope_parameters=dict(rope_type="yarn", rope_theta=500.0, factor=8.0,
                               original_max_position_embeddings=8, beta_fast=32, beta_slow=0.05,
                               mscale=0.707, mscale_all_dim=0.8),
          n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=3, n_shared_experts=0,
          norm_topk_prob=True, routed_scaling_factor=1.0, first_k_dense_replace=2,
          tie_word_embeddings=False, rms_norm_eps=1e-5),
     23, dict(sign0=False)),
]


def make_config(fields):
    cfg = DeepseekV3Config(**COMMON, **copy.deepcopy(fields))
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg


def routers(model):
    """{layer index: router module} for the MoE layers, in layer order."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, DeepseekV3TopkRouter):
            out[int(name.split(".")[2])] = mod  # model.layers.<l>.mlp.gate
    return dict(sorted(out.items()))


def redraw_params(model, cfg, gen):
    """Replace the default init (std 0.02, unit norms, zero bias) with values
    large enough that every weight, norm and the routing bias matter."""
    C = cfg.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.numel() == 0:
                continue  # n_shared_experts 0: the (0, C) / (C, 0) shared expert
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):  # *_layernorm.weight, model.norm.weight
                p.copy_(1.0 + NORM_NOISE * noise)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(ROUTER_GAIN / math.sqrt(C) * noise)
            elif name == "model.embed_tokens.weight":
                # tied: it is also the LM head, whose input is RMS-normed (~1)
                std = LINEAR_GAIN / math.sqrt(C) if cfg.tie_word_embeddings else 1.0
                p.copy_(std * noise)
            else:  # nn.Linear (out, in) and experts (E, out, in): fan_in is the last dim
                p.copy_(LINEAR_GAIN / math.sqrt(p.shape[-1]) * noise)
        for layer, gate in routers(model).items():
            gate.e_score_correction_bias.copy_(
                BIAS_STD * torch.randn(gate.e_score_correction_bias.shape, generator=gen))


# ---------------------------------------------------------------- routing

def route(scores, bias, n_group, topk_group, k):
    """transformers' DeepseekV3TopkRouter choice, op for op, in the scores'
    dtype (FP32). Returns (indices (N, k), group scores (N, G), masked
    biased scores (N, E))."""
    N, E = scores.shape
    sfc = scores + bias
    group_scores = sfc.view(N, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(N, n_group, E // n_group).reshape(N, E)
    masked = sfc.masked_fill(~score_mask.bool(), float("-inf"))
    idx = torch.topk(masked, k=k, dim=-1, sorted=False)[1]
    return idx, group_scores, masked


def sets(idx):
    return idx.sort(dim=-1).values


def margins(group_scores, masked, topk_group, k):
    gs = group_scores.sort(dim=-1, descending=True).values
    if topk_group < gs.shape[1]:
        gm = gs[:, topk_group - 1] - gs[:, topk_group]
    else:  # every group allowed: nothing to separate
        gm = torch.full((gs.shape[0],), float("inf"))
    ms = masked.sort(dim=-1, descending=True).values
    if not torch.isfinite(ms[:, k]).all():
        sys.exit("fewer than k + 1 experts allowed: topk margin undefined")
    return gm, ms[:, k - 1] - ms[:, k]


class RouterTap:
    """Records each router's input rows and outputs."""

    def __init__(self, model):
        self.rec = {}
        self.handles = [mod.register_forward_hook(self._hook(layer))
                        for layer, mod in routers(model).items()]

    def _hook(self, layer):
        def hook(mod, args, out):
            logits, weights, idx = out
            self.rec[layer] = dict(x=args[0].detach(), logits=logits.detach(),
                                   weights=weights.detach(), idx=idx.detach(),
                                   bias=mod.e_score_correction_bias.detach().clone())
        return hook

    def close(self):
        for h in self.handles:
            h.remove()


class AttnTap:
    """Wraps the eager attention function (looked up by name in the modeling
    module at each call) to record, per layer, the largest q.k * scaling of
    each head over the whole (B, T, T) block, before the causal mask."""

    def __init__(self):
        self.rec = {}
        self.masked = {}
        self.orig = mdsv3.eager_attention_forward

    def __enter__(self):
        orig = self.orig

        def tap(module, query, key, value, attention_mask, scaling, **kw):
            with torch.no_grad():
                k = mdsv3.repeat_kv(key, module.num_key_value_groups)
                s = torch.matmul(query, k.transpose(2, 3)) * scaling  # (B, H, T, T)
                self.rec[module.layer_idx] = s.amax(dim=(0, 2, 3)).float()
                if attention_mask is not None:
                    sm = (s + attention_mask).amax(dim=(0, 2, 3)).float()
                    self.masked[module.layer_idx] = sm
                self.scaling = scaling
            return orig(module, query, key, value, attention_mask, scaling=scaling, **kw)

        mdsv3.eager_attention_forward = tap
        return self

    def __exit__(self, *exc):
        mdsv3.eager_attention_forward = self.orig


def bf16_cast(model):
    """transformers' model cast with model.to(torch.bfloat16): every
    parameter and buffer becomes bf16, the routers' weight and
    e_score_correction_bias and the rotary inv_freq included."""
    return copy.deepcopy(model).to(torch.bfloat16)


def bf16_as_loaded(model):
    """What from_pretrained(dtype=torch.bfloat16) builds (checked against it
    after saving): bf16 everywhere except the modules in
    _keep_in_fp32_modules_strict (mlp.gate.weight, e_score_correction_bias),
    which stay FP32, and the rotary inv_freq, computed in FP32 at init."""
    bf = copy.deepcopy(model).to(torch.bfloat16)
    with torch.no_grad():
        for layer, gate in routers(bf).items():
            src = routers(model)[layer]
            gate.weight.data = src.weight.detach().clone()
            gate.e_score_correction_bias.data = src.e_score_correction_bias.detach().clone()
        rot, src = bf.model.rotary_emb, model.model.rotary_emb
        rot.inv_freq.data = src.inv_freq.detach().clone()
        rot.original_inv_freq.data = src.original_inv_freq.detach().clone()
    return bf


def run(model, inputs):
    tap = RouterTap(model)
    try:
        out = model(input_ids=inputs, use_cache=False)
    finally:
        tap.close()
    return out, tap.rec


# ------------------------------------------------------- independent check

def yarn_reference(rp, dim):
    """YaRN inv_freq and attention factor, float64, from the formulas in the
    docstring (not transformers' code)."""
    base, factor = rp["rope_theta"], rp["factor"]
    omax = rp["original_max_position_embeddings"]
    bf, bs = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1
    mscale, mscale_all = rp.get("mscale"), rp.get("mscale_all_dim")

    def get_mscale(s, m=1.0):
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    if mscale and mscale_all:
        att = get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
    else:
        att = get_mscale(factor)

    def corr(r):
        return dim * math.log(omax / (r * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(corr(bf)), 0), min(math.ceil(corr(bs)), dim - 1)
    if low == high:
        high += 0.001
    i = np.arange(dim // 2, dtype=np.float64)
    ramp = np.clip((i - low) / (high - low), 0.0, 1.0)
    extra = 1.0 - ramp  # weight of the original (extrapolated) frequency
    pos = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inv = (1.0 / (factor * pos)) * ramp + (1.0 / pos) * extra
    return inv, att, ramp, (low, high)


def softmax_scale_reference(cfg):
    rp = cfg.rope_parameters
    s = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if rp.get("rope_type", "default") != "default" and rp.get("mscale_all_dim"):
        m = 0.1 * rp["mscale_all_dim"] * math.log(rp["factor"]) + 1.0 if rp["factor"] > 1 else 1.0
        s = s * m * m
    return s


def rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def rope_apply(x, cos, sin, interleave):
    """x (..., T, d); cos/sin (T, d/2) of the frequencies."""
    if interleave:  # pairs (x[2i], x[2i+1]); output de-interleaved (evens' results first)
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:  # pairs (x[i], x[i + d/2])
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reference_forward(model, cfg, inputs):
    """The whole model in float64 from its weights, written from the
    docstring's formulas. Returns (logits, {layer: sorted routing})."""
    P = {n: p.detach().double() for n, p in model.named_parameters()}
    Bf = {n: b.detach().double() for n, b in model.named_buffers()}
    H, nope, rd, vd = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                       cfg.v_head_dim)
    r = cfg.kv_lora_rank
    eps = cfg.rms_norm_eps
    rp = cfg.rope_parameters
    if rp["rope_type"] == "yarn":
        inv, att, _, _ = yarn_reference(rp, rd)
    else:
        inv, att = 1.0 / rp["rope_theta"] ** (np.arange(0, rd, 2, dtype=np.float64) / rd), 1.0
    ang = torch.arange(T, dtype=torch.float64)[:, None] * torch.tensor(inv)[None, :]
    cos, sin = torch.cos(ang) * att, torch.sin(ang) * att  # (T, rd/2)
    scale = softmax_scale_reference(cfg)
    causal = torch.ones(T, T, dtype=torch.bool).tril()

    x = P["model.embed_tokens.weight"][inputs]  # (B, T, C)
    Bn = x.shape[0]
    routing = {}
    for l in range(cfg.num_hidden_layers):
        pre = f"model.layers.{l}."
        h = rms(x, P[pre + "input_layernorm.weight"], eps)
        a = pre + "self_attn."
        if cfg.q_lora_rank is None:
            q = h @ P[a + "q_proj.weight"].T
        else:
            q = rms(h @ P[a + "q_a_proj.weight"].T, P[a + "q_a_layernorm.weight"], 1e-6)
            q = q @ P[a + "q_b_proj.weight"].T
        q = q.view(Bn, T, H, nope + rd).transpose(1, 2)  # (B, H, T, qk)
        ckv = h @ P[a + "kv_a_proj_with_mqa.weight"].T  # (B, T, r + rd)
        c_kv, k_rot = ckv[..., :r], ckv[..., r:]
        c_kv = rms(c_kv, P[a + "kv_a_layernorm.weight"], 1e-6)
        kv = (c_kv @ P[a + "kv_b_proj.weight"].T).view(Bn, T, H, nope + vd).transpose(1, 2)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        q_rot = rope_apply(q[..., nope:], cos, sin, cfg.rope_interleave)
        k_rot = rope_apply(k_rot[:, None], cos, sin, cfg.rope_interleave)  # shared by heads
        s = (q[..., :nope] @ k_nope.transpose(-1, -2) + q_rot @ k_rot.transpose(-1, -2)) * scale
        s = s.masked_fill(~causal, float("-inf"))
        o = (torch.softmax(s, dim=-1) @ v).transpose(1, 2).reshape(Bn, T, H * vd)
        x = x + o @ P[a + "o_proj.weight"].T

        h = rms(x, P[pre + "post_attention_layernorm.weight"], eps)
        m = pre + "mlp."
        if l < cfg.first_k_dense_replace:
            y = (F.silu(h @ P[m + "gate_proj.weight"].T) * (h @ P[m + "up_proj.weight"].T)) \
                @ P[m + "down_proj.weight"].T
        else:
            hf = h.reshape(-1, h.shape[-1])
            E, k, G, tg = (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group,
                           cfg.topk_group)
            s_ = torch.sigmoid(hf @ P[m + "gate.weight"].T)  # (N, E)
            sb = s_ + Bf[m + "gate.e_score_correction_bias"]
            gs = sb.view(-1, G, E // G).topk(2, dim=-1).values.sum(-1)
            allowed = torch.zeros_like(gs, dtype=torch.bool)
            allowed.scatter_(1, gs.topk(tg, dim=-1).indices, True)
            allowed = allowed.repeat_interleave(E // G, dim=1)
            idx = sb.masked_fill(~allowed, float("-inf")).topk(k, dim=-1).indices
            w = s_.gather(1, idx)
            if cfg.norm_topk_prob:
                w = w / (w.sum(-1, keepdim=True) + 1e-20)
            w = w * cfg.routed_scaling_factor
            I = cfg.moe_intermediate_size
            yf = torch.zeros_like(hf)
            for j in range(k):
                for t in range(hf.shape[0]):
                    e = idx[t, j]
                    gu = P[m + "experts.gate_up_proj"][e] @ hf[t]
                    yf[t] += w[t, j] * (P[m + "experts.down_proj"][e]
                                        @ (F.silu(gu[:I]) * gu[I:]))
            if cfg.n_shared_experts > 0:
                sh = m + "shared_experts."
                yf = yf + (F.silu(hf @ P[sh + "gate_proj.weight"].T)
                           * (hf @ P[sh + "up_proj.weight"].T)) @ P[sh + "down_proj.weight"].T
            y = yf.view_as(h)
            routing[l] = idx.sort(-1).values
        x = x + y
    x = rms(x, P["model.norm.weight"], eps)
    head = P["model.embed_tokens.weight"] if cfg.tie_word_embeddings else P["lm_head.weight"]
    return x @ head.T, routing


# ------------------------------------------------------------ bias update

def bias_update_numpy(counts, bias, rate):
    """Megatron-Core get_updated_expert_bias in numpy float32 (the counts and
    the bias are float32 buffers there)."""
    c = np.asarray(counts, dtype=np.float32)
    b = np.asarray(bias, dtype=np.float32)
    mean = np.float32(c.sum(dtype=np.float32) / np.float32(c.shape[-1]))
    return (b + np.sign(mean - c).astype(np.float32) * np.float32(rate)).astype(np.float32)


def bias_update_torch(counts, bias, rate):
    """The same lines as Megatron-Core writes them (without the all-reduce)."""
    tokens_per_expert = counts.float().clone()
    average_tokens = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
    offset = average_tokens - tokens_per_expert
    return bias.float() + torch.sign(offset) * rate


# ------------------------------------------------------------------ cases

def analyse(cfg, rec):
    """Per MoE layer: routing checks. Returns (dict per layer, failure or None)."""
    k, G, tg = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
    res = {}
    for layer, r in rec.items():
        scores = r["logits"].sigmoid()
        idx, gs, masked = route(scores, r["bias"], G, tg, k)
        if not torch.equal(sets(idx), sets(r["idx"])):
            sys.exit(f"layer {layer}: re-implemented routing differs from transformers'")
        gm, tm = margins(gs, masked, tg, k)
        nobias = sets(route(scores, torch.zeros_like(r["bias"]), G, tg, k)[0])
        nogroup = sets(route(scores, r["bias"], 1, 1, k)[0])
        chosen = sets(r["idx"])
        res[layer] = dict(
            idx=chosen, gm=gm, tm=tm,
            bias_changed=int((nobias != chosen).any(-1).sum()),
            group_excluded=int((nogroup != chosen).any(-1).sum()),
        )
        why = None
        if gm.min() <= MIN_MARGIN:
            why = f"group margin {gm.min().item():.2e}"
        elif tm.min() <= MIN_MARGIN:
            why = f"topk margin {tm.min().item():.2e}"
        elif res[layer]["bias_changed"] == 0:
            why = "the bias changes no choice"
        elif tg < G and res[layer]["group_excluded"] == 0:
            why = "the group limit excludes no chosen expert"
        if why:
            return res, f"layer {layer}: {why}"
    return res, None


def build(case, fields, seed, cond):
    """One attempt: the model and its routing, or (None, reason)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    cfg = make_config(fields)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                             experts_implementation="eager",
                                             dtype=torch.float32)
    assert model.config._experts_implementation == "eager"
    redraw_params(model, cfg, gen)
    model.train()  # dropout is 0.0 everywhere
    V = cfg.vocab_size
    tokens = torch.randint(0, V, (B, T + 1), generator=gen)
    with torch.no_grad():
        out, rec = run(model, tokens[:, :-1])
    res, why = analyse(cfg, rec)
    if why:
        return None, why
    if cond["sign0"]:
        E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
        mean = B * T * k / E
        if not any((torch.bincount(r["idx"].reshape(-1), minlength=E) == mean).any()
                   for r in res.values()):
            return None, "no expert count equals the mean (sign 0 untested)"
    bf = {}
    for variant, make in (("bf16", bf16_cast), ("bf16_load", bf16_as_loaded)):
        m = make(model)
        with torch.no_grad():
            out_bf, rec_bf = run(m, tokens[:, :-1])
        for layer in res:
            if not torch.equal(sets(rec_bf[layer]["idx"]), res[layer]["idx"]):
                n = int((sets(rec_bf[layer]["idx"]) != res[layer]["idx"]).any(-1).sum())
                return None, f"{variant} routes {n} tokens of layer {layer} elsewhere"
        bf[variant] = dict(model=m, out=out_bf, rec=rec_bf)
    return dict(cfg=cfg, model=model, tokens=tokens, res=res, bf=bf), None


def make_case(out_dir, case, fields, seed, cond):
    reasons = []
    for attempt in range(ATTEMPTS):
        got, why = build(case, fields, seed + 1000 * attempt, cond)
        if got is not None:
            break
        reasons.append(why)
    else:
        sys.exit(f"{case}: no seed in {ATTEMPTS} attempts met the routing conditions: {reasons}")
    used_seed = seed + 1000 * attempt
    cfg, model, tokens = got["cfg"], got["model"], got["tokens"]
    V, E, k = cfg.vocab_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    L = cfg.num_hidden_layers
    moe_layers = list(routers(model))
    if moe_layers != list(range(cfg.first_k_dense_replace, L)):
        sys.exit(f"{case}: MoE layers {moe_layers}, first_k_dense_replace "
                 f"{cfg.first_k_dense_replace}")
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    tensors = {"inputs": inputs.to(torch.int32), "targets": targets.to(torch.int32)}

    # Rotary and softmax scale, against the formulas.
    rot = model.model.rotary_emb
    rp = cfg.rope_parameters
    rd = cfg.qk_rope_head_dim
    if rp["rope_type"] == "yarn":
        inv_ref, att_ref, ramp, lowhigh = yarn_reference(rp, rd)
    else:
        inv_ref = 1.0 / rp["rope_theta"] ** (np.arange(0, rd, 2, dtype=np.float64) / rd)
        att_ref, ramp, lowhigh = 1.0, None, None
    if not np.allclose(rot.inv_freq.double().numpy(), inv_ref, rtol=1e-6, atol=0):
        sys.exit(f"{case}: inv_freq {rot.inv_freq.tolist()} != formula {inv_ref.tolist()}")
    if abs(rot.attention_scaling - att_ref) > 1e-12:
        sys.exit(f"{case}: attention_scaling {rot.attention_scaling} != formula {att_ref}")
    scale = model.model.layers[0].self_attn.scaling
    if abs(scale - softmax_scale_reference(cfg)) > 1e-12:
        sys.exit(f"{case}: softmax scale {scale} != formula {softmax_scale_reference(cfg)}")
    for l in range(L):
        at = model.model.layers[l].self_attn
        if at.kv_a_layernorm.variance_epsilon != 1e-6 or (
                at.q_a_layernorm is not None and at.q_a_layernorm.variance_epsilon != 1e-6):
            sys.exit(f"{case}: q_a / kv_a layernorm eps is not 1e-6")
        if model.model.layers[l].input_layernorm.variance_epsilon != cfg.rms_norm_eps:
            sys.exit(f"{case}: input_layernorm eps is not rms_norm_eps")
    with torch.no_grad():
        pos = torch.arange(T)[None]
        cos, sin = rot(torch.zeros(1, dtype=torch.float32), pos)
    tensors["rope.inv_freq"] = rot.inv_freq.float().contiguous()
    tensors["rope.cos"] = cos[0].contiguous()
    tensors["rope.sin"] = sin[0].contiguous()
    tensors["attn_scale"] = torch.tensor([scale], dtype=torch.float32)

    # FP32 forward + backward, with the attention tap.
    with AttnTap() as atap:
        out, rec = run(model, inputs)
    if sorted(atap.rec) != list(range(L)):
        sys.exit(f"{case}: attention tap saw layers {sorted(atap.rec)}")
    logits = out.logits
    loss = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
    loss.backward()
    tensors["logits"] = logits.detach().float().contiguous()
    tensors["loss"] = loss.detach().float().reshape(1)
    names = [n for n, _ in model.named_parameters()]
    for n, p in model.named_parameters():
        if p.grad is None:
            sys.exit(f"{case}: no gradient for {n}")
        tensors["grad." + n] = p.grad.detach().float().contiguous()
    model.zero_grad(set_to_none=True)
    if cfg.tie_word_embeddings == ("lm_head.weight" in names):
        sys.exit(f"{case}: lm_head.weight in named_parameters with tie={cfg.tie_word_embeddings}")
    for l in range(L):
        tensors[f"attn_max.{l}"] = atap.rec[l].contiguous()
        if (atap.masked[l] > atap.rec[l]).any():
            sys.exit(f"{case}: masked max above the unmasked one")

    res, why = analyse(cfg, rec)
    if why:
        sys.exit(f"{case}: the saved forward fails the routing checks: {why}")
    bias_before, counts = {}, {}
    for l in moe_layers:
        r = rec[l]
        order = r["idx"].argsort(dim=-1)
        idx_sorted = r["idx"].gather(1, order)
        w_sorted = r["weights"].gather(1, order)
        tensors[f"routing.{l}"] = idx_sorted.to(torch.int32).contiguous()
        tensors[f"routing_weight.{l}"] = w_sorted.float().contiguous()
        c = torch.bincount(r["idx"].reshape(-1), minlength=E)
        counts[l] = c
        tensors[f"tokens_per_expert.{l}"] = c.to(torch.int32).contiguous()
        tensors[f"group_margin.{l}"] = res[l]["gm"].float().contiguous()
        tensors[f"topk_margin.{l}"] = res[l]["tm"].float().contiguous()
        bias_before[l] = r["bias"]
        after = bias_update_numpy(c.numpy(), r["bias"].numpy(), BIAS_RATE)
        after_t = bias_update_torch(c, r["bias"], BIAS_RATE)
        if not np.array_equal(after, after_t.numpy()):
            sys.exit(f"{case}: numpy bias update differs from the torch transcription")
        tensors[f"bias_after.{l}"] = torch.from_numpy(after).contiguous()
        if cfg.norm_topk_prob:
            sums = w_sorted.sum(-1)
            if not torch.allclose(sums, torch.full_like(sums, cfg.routed_scaling_factor),
                                  rtol=1e-6):
                sys.exit(f"{case}: normalised weights do not sum to routed_scaling_factor")

    # Independent float64 forward.
    with torch.no_grad():
        ref_logits, ref_routing = reference_forward(model, cfg, inputs)
    for l in moe_layers:
        if not torch.equal(ref_routing[l], tensors[f"routing.{l}"].long()):
            sys.exit(f"{case}: float64 reference routes layer {l} differently")
    ref_err = ((ref_logits - logits.double()).abs().max() / ref_logits.abs().max()).item()
    if ref_err > 1e-5:
        sys.exit(f"{case}: float64 reference logits differ: {ref_err:.3e} relative")

    # bf16: transformers' own model in bfloat16, same batch, two ways.
    for variant in ("bf16", "bf16_load"):
        b = got["bf"][variant]
        bl = b["out"].logits.float()
        tensors[f"{variant}.logits"] = bl.contiguous()
        tensors[f"{variant}.loss"] = F.cross_entropy(bl.reshape(-1, V),
                                                     targets.reshape(-1)).reshape(1)
        for l in moe_layers:
            idx_bf = sets(b["rec"][l]["idx"])
            if not torch.equal(idx_bf, tensors[f"routing.{l}"].long()):
                sys.exit(f"{case}: {variant} routing of layer {l} differs")
            tensors[f"{variant}.routing.{l}"] = idx_bf.to(torch.int32).contiguous()
    bf_logits = tensors["bf16.logits"]
    bf_dtypes = {n: str(b.dtype) for n, b in got["bf"]["bf16"]["model"].named_buffers()}

    # Save the model.
    case_dir = os.path.join(out_dir, case)
    os.makedirs(case_dir, exist_ok=True)
    model.save_pretrained(case_dir, save_original_format=False)
    gen_cfg = os.path.join(case_dir, "generation_config.json")
    if os.path.exists(gen_cfg):
        os.remove(gen_cfg)
    with safe_open(os.path.join(case_dir, "model.safetensors"), "pt") as f:
        saved = {n: f.get_slice(n).get_shape() for n in f.keys()}
        saved_bias = {l: f.get_tensor(f"model.layers.{l}.mlp.gate.e_score_correction_bias")
                      for l in moe_layers}
    want = set(names) | {f"model.layers.{l}.mlp.gate.e_score_correction_bias" for l in moe_layers}
    if set(saved) != want:
        sys.exit(f"{case}: model.safetensors names differ: {sorted(set(saved) ^ want)}")
    for l in moe_layers:
        if not torch.equal(saved_bias[l], bias_before[l]):
            sys.exit(f"{case}: saved e_score_correction_bias of layer {l} differs")
    # What the default (Hub) layout would be: per-expert 2-D tensors.
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, save_original_format=True)
        with safe_open(os.path.join(tmp, "model.safetensors"), "pt") as f:
            hub = {n: f.get_slice(n).get_shape() for n in f.keys()}
        hub_back = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="eager",
                                                        experts_implementation="eager",
                                                        dtype=torch.float32)
        with torch.no_grad():
            for p in hub_back.parameters():
                p.data = p.data.clone()
            hub_logits = hub_back(input_ids=inputs, use_cache=False).logits
        if not torch.equal(hub_logits, logits.detach()):
            sys.exit(f"{case}: the default (per-expert) save reloads to different logits")
    l0 = moe_layers[0]
    I, C = cfg.moe_intermediate_size, cfg.hidden_size
    for e in range(E):
        for n, shape in (("gate_proj", [I, C]), ("up_proj", [I, C]), ("down_proj", [C, I])):
            key = f"model.layers.{l0}.mlp.experts.{e}.{n}.weight"
            if hub.get(key) != shape:
                sys.exit(f"{case}: default save lacks {key} {shape}: {hub.get(key)}")
    if any("gate_up_proj" in n for n in hub) or \
            f"model.layers.{l0}.mlp.gate.e_score_correction_bias" not in hub:
        sys.exit(f"{case}: unexpected default-save layout")

    save_file(tensors, os.path.join(case_dir, "fixture.safetensors"), metadata={"case": case})

    # Self-check: what was saved loads back to the same function.
    back = AutoModelForCausalLM.from_pretrained(case_dir, attn_implementation="eager",
                                                experts_implementation="eager",
                                                dtype=torch.float32)
    with torch.no_grad():
        for p in back.parameters():  # fresh aligned memory: same GEMM rounding
            p.data = p.data.clone()
        again = back(input_ids=inputs, use_cache=False).logits
    if not torch.equal(again, logits.detach()):
        err = (again - logits).abs().max().item()
        sys.exit(f"{case}: reloaded model gives different logits (max abs err {err})")

    # bf16_load.* is what from_pretrained(dtype=bfloat16) computes.
    back_bf = AutoModelForCausalLM.from_pretrained(case_dir, attn_implementation="eager",
                                                   experts_implementation="eager",
                                                   dtype=torch.bfloat16)
    kept = sorted(n for n, p in list(back_bf.named_parameters()) + list(back_bf.named_buffers())
                  if p.dtype == torch.float32)
    want_kept = sorted([f"model.layers.{l}.mlp.gate.{n}" for l in moe_layers
                        for n in ("weight", "e_score_correction_bias")]
                       + ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"])
    if kept != want_kept:
        sys.exit(f"{case}: from_pretrained(bf16) keeps {kept} in FP32")
    with torch.no_grad():
        for p in back_bf.parameters():
            p.data = p.data.clone()
        again_bf = back_bf(input_ids=inputs, use_cache=False).logits.float()
    if not torch.equal(again_bf, tensors["bf16_load.logits"]):
        err = (again_bf - tensors["bf16_load.logits"]).abs().max().item()
        sys.exit(f"{case}: from_pretrained(bf16) logits differ from bf16_as_loaded ({err})")
    load_vs_cast = (tensors["bf16_load.logits"] - bf_logits).abs().max().item()

    nparams = sum(p.numel() for p in model.parameters())
    bf_err = ((bf_logits - logits).abs().max() / logits.abs().max()).item()
    print(f"{case}: seed={used_seed} (attempt {attempt}; rejected: {reasons}) params={nparams} "
          f"loss={loss.item():.6f} (log V {math.log(V):.4f}) bf16.loss="
          f"{tensors['bf16.loss'].item():.6f} |logits|max={logits.abs().max().item():.3f} "
          f"f64 ref rel err={ref_err:.2e} bf16 rel err={bf_err:.2e} reload=identical")
    print(f"  bf16_load.loss={tensors['bf16_load.loss'].item():.6f}, max |bf16_load.logits - "
          f"bf16.logits| = {load_vs_cast:.4g}; from_pretrained(bf16) = bf16_as_loaded bit for bit")
    print(f"  rope {rp['rope_type']}: inv_freq={[round(v, 8) for v in rot.inv_freq.tolist()]} "
          f"attention_factor={rot.attention_scaling:.10f} softmax scale={scale:.10f}"
          + (f" ramp={ramp.tolist()} low,high={lowhigh}" if ramp is not None else ""))
    print("  attn_max per layer: " + "; ".join(
        f"{l}: {[round(v, 3) for v in atap.rec[l].tolist()]}" for l in range(L)))
    for l in moe_layers:
        print(f"  layer {l}: min group margin {res[l]['gm'].min().item():.4e}, min topk margin "
              f"{res[l]['tm'].min().item():.4e}, bias changes {res[l]['bias_changed']} tokens, "
              f"group limit changes {res[l]['group_excluded']} tokens, counts "
              f"{counts[l].tolist()} (mean {B * T * k / E}), bias_after - bias "
              f"{((tensors[f'bias_after.{l}'] - bias_before[l]) / BIAS_RATE).round().tolist()}")
    print(f"  bf16 model buffers: {bf_dtypes}")
    print(f"  model.safetensors: {len(saved)} tensors; default save: {len(hub)} tensors")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "tests", "fixtures", "dsv3")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # one thread: reductions sum in a fixed order
    only = sys.argv[2:] or None
    for case, fields, seed, cond in CASES:
        if only is None or case in only:
            make_case(out_dir, case, fields, seed, cond)


if __name__ == "__main__":
    main()
