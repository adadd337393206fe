#!/usr/bin/env python3
"""Write the fixtures of hypertrain's Multi-Latent Attention tests: DeepSeek-V3
models whose every layer is dense (first_k_dense_replace = num_hidden_layers),
so that the attention is checked on its own, apart from DeepSeekMoE
(make_dsv3_fixtures.py covers the two together).

Cases (tests/fixtures/dsv3/<case>/: config.json, model.safetensors from
save_pretrained, fixture.safetensors), shared: vocab 100, hidden 48, dense
intermediate 80, 2 layers, 4 heads, kv_lora_rank 16, qk_nope_head_dim 8,
qk_rope_head_dim 4, v_head_dim 12 (values wider than the keys), untied, eager
attention, float32, every weight redrawn (normal std 0.3, norms 1 + 0.2 N):

  mla_dense_a   q_lora_rank 24 (q_a_proj -> q_a_layernorm -> q_b_proj),
                rope_interleave true, YaRN (factor 4, original 16 positions,
                beta 32 / 1, mscale 0.707, mscale_all_dim 0.8: cos/sin and
                the softmax scale both carry a factor)
  mla_dense_b   q_lora_rank null (q_proj), rope_interleave false, default RoPE

fixture.safetensors: inputs, targets I32 (2, 13); logits F32 (2, 13, 100);
loss F32 (1,) = F.cross_entropy(logits, targets); grad.<name> for every
parameter.
"""
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "..", "tests", "fixtures", "dsv3")

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.8}
PLAIN = {"rope_type": "default", "rope_theta": 10000.0}
CASES = {
    "mla_dense_a": dict(q_lora_rank=24, rope_interleave=True, rope_parameters=YARN),
    "mla_dense_b": dict(q_lora_rank=None, rope_interleave=False, rope_parameters=PLAIN),
}


def make(name, switches):
    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=100, hidden_size=48, intermediate_size=80, moe_intermediate_size=16,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                           n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                           first_k_dense_replace=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                           v_head_dim=12, max_position_embeddings=64, attention_dropout=0.0,
                           tie_word_embeddings=False, num_nextn_predict_layers=0, attn_implementation="eager",
                           **switches)
    model = DeepseekV3ForCausalLM(cfg).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in n else 0.3 * torch.randn_like(p))
    assert not any(".mlp.experts" in n for n, _ in model.named_parameters()), "a layer is sparse"
    model.train()
    out = os.path.join(OUT, name)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, save_original_format=False)
    gen = os.path.join(out, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)
    inputs = torch.randint(0, 100, (2, 13))
    targets = torch.randint(0, 100, (2, 13))
    logits = model(input_ids=inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.view(-1, 100), targets.view(-1))
    loss.backward()
    tensors = {"inputs": inputs.int(), "targets": targets.int(), "logits": logits.detach().contiguous(),
               "loss": loss.detach().reshape(1)}
    for n, p in model.named_parameters():
        tensors["grad." + n] = p.grad.contiguous()
    save_file(tensors, os.path.join(out, "fixture.safetensors"))
    print(f"{name}: loss {loss.item():.6f}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    for name, switches in CASES.items():
        if len(sys.argv) < 2 or name in sys.argv[1:]:
            make(name, switches)
