#!/usr/bin/env python3
"""Write the reference fixtures that hypertrain's model tests compare against.

For each case, a small random Qwen2 or Llama model (float32, eager attention)
is saved to tests/fixtures/model/<case>/ with save_pretrained (config.json +
model.safetensors), next to fixture.safetensors holding one batch and what
transformers computes for it:

  inputs        I32 (B, T)     tokens fed to the model
  targets       I32 (B, T)     next tokens (inputs shifted by one)
  logits        F32 (B, T, V)  model(input_ids=inputs).logits
  loss          F32 (1,)       mean cross entropy of logits vs targets
  grad.<name>   F32            d loss / d param, for every name in
                               model.named_parameters() (tied models have no
                               lm_head.weight; the embedding gradient then
                               includes the LM-head contribution)

Every run with the same library versions writes the same bytes (fixed seeds).
Usage: python3 tools/reference/make_model_fixtures.py [OUT_DIR]
"""

import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

B, T = 2, 13
SIZES = dict(
    vocab_size=100,
    hidden_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=112,
    max_position_embeddings=64,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
)

# (case, config class, extra config fields, seed)
CASES = [
    ("qwen2_untied", Qwen2Config, dict(tie_word_embeddings=False, use_sliding_window=False), 1),
    ("qwen2_tied", Qwen2Config, dict(tie_word_embeddings=True, use_sliding_window=False), 2),
    ("llama_untied", LlamaConfig,
     dict(tie_word_embeddings=False, attention_bias=False, mlp_bias=False), 3),
    ("llama_tied", LlamaConfig,
     dict(tie_word_embeddings=True, attention_bias=False, mlp_bias=False), 4),
]


def make_config(cls, extra):
    cfg = cls(**SIZES, **extra)
    cfg._attn_implementation = "eager"
    return cfg


def redraw_params(model, gen):
    """Replace the default init (near-zero biases, unit norms) with values
    large enough that a wrong bias, norm or transpose changes the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.1
            if name.endswith("norm.weight"):
                p.copy_(1.0 + noise)
            else:
                p.copy_(noise)


def make_case(out_dir, case, cls, extra, seed):
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    cfg = make_config(cls, extra)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                             dtype=torch.float32)
    redraw_params(model, gen)
    model.train()  # dropout is 0.0; train mode only matters for the cache

    V = cfg.vocab_size
    tokens = torch.randint(0, V, (B, T + 1), generator=gen)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    logits = model(input_ids=inputs, use_cache=False).logits  # (B, T, V)
    loss = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
    loss.backward()

    case_dir = os.path.join(out_dir, case)
    os.makedirs(case_dir, exist_ok=True)
    model.save_pretrained(case_dir)  # transformers 5 writes safetensors only
    # Keep only what `hypertrain export` writes, so the reload below proves
    # that config.json + model.safetensors are enough.
    gen_cfg = os.path.join(case_dir, "generation_config.json")
    if os.path.exists(gen_cfg):
        os.remove(gen_cfg)

    tensors = {
        "inputs": inputs.to(torch.int32),
        "targets": targets.to(torch.int32),
        "logits": logits.detach().float().contiguous(),
        "loss": loss.detach().float().reshape(1),
    }
    for name, p in model.named_parameters():
        tensors["grad." + name] = p.grad.detach().float().contiguous()
    save_file(tensors, os.path.join(case_dir, "fixture.safetensors"),
              metadata={"case": case, "torch": torch.__version__})

    # Self-check: what was saved loads back to the same function.
    back = AutoModelForCausalLM.from_pretrained(case_dir, attn_implementation="eager",
                                                dtype=torch.float32)
    with torch.no_grad():
        again = back(input_ids=inputs, use_cache=False).logits
    if not torch.equal(again, logits.detach()):
        err = (again - logits).abs().max().item()
        sys.exit(f"{case}: reloaded model gives different logits (max abs err {err})")
    nparams = sum(p.numel() for p in model.parameters())
    print(f"{case}: params={nparams} loss={loss.item():.6f} "
          f"grads={len(tensors) - 4} reload=identical")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "tests", "fixtures", "model")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # one thread: reductions sum in a fixed order
    for case, cls, extra, seed in CASES:
        make_case(out_dir, case, cls, extra, seed)


if __name__ == "__main__":
    main()
