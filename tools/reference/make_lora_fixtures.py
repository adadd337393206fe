#!/usr/bin/env python3
"""Write the reference fixtures that hypertrain's LoRA tests compare against.

For each case, a small random Qwen2 or Llama model (float32, eager attention,
weights redrawn N(0, 0.1) as in make_model_fixtures.py) is wrapped by
Hugging Face PEFT (LoraConfig, task_type CAUSAL_LM, lora_dropout 0.0, bias
"none"). PEFT initialises lora_B to zero; both lora_A and lora_B are redrawn
N(0, 0.1) so that both gradients are nonzero and the adapters move the logits.
tests/fixtures/lora/<case>/ then holds:

  base/                 the base model before wrapping, save_pretrained
                        (config.json + model.safetensors), float32
  adapter/              PEFT's PeftModel.save_pretrained output
                        (adapter_config.json + adapter_model.safetensors;
                        the model card README.md PEFT also writes is removed)
  merged/               merge_and_unload() then save_pretrained: plain HF
                        weights with W + scale * B @ A folded in
  fixture.safetensors   one batch and what PEFT computes for it:

  inputs         I32 (B, T)     tokens fed to the model
  targets        I32 (B, T)     next tokens (inputs shifted by one)
  logits         F32 (B, T, V)  logits of the LoRA (unmerged) model
  loss           F32 (1,)       mean cross entropy of logits vs targets
  merged_logits  F32 (B, T, V)  logits of merged/ reloaded with from_pretrained
  grad.<name>    F32            d loss / d param for every trainable parameter
                                (lora_A / lora_B only; the base is frozen),
                                named as in adapter_model.safetensors, e.g.
                                base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight

PEFT's scale is lora_alpha / r (lora_alpha / sqrt(r) with use_rslora);
lora_A is (r, in_features), lora_B is (out_features, r); the adapted layer
computes x @ W^T + scale * (x @ A^T) @ B^T.

The script checks: the adapter file holds exactly the trainable parameters
under those names; base/ + adapter/ reloaded with PeftModel.from_pretrained
give the same logits; merged/ has the base's tensor names and each merged
weight equals W + scale * B @ A; merged_logits match logits to 1e-5 relative.
Every run with the same library versions writes the same bytes (fixed seeds).
Usage: python3 tools/reference/make_lora_fixtures.py [OUT_DIR]
"""

import json
import math
import os
import sys

import peft
import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DeepseekV3Config, LlamaConfig, Qwen2Config

# The batch and model sizes of the dense fixtures: the same models, adapted.
from make_model_fixtures import B, SIZES, T  # noqa: E402  (a sibling script)

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOL = 1e-5

# (case, config class, extra config fields, LoraConfig fields, seed)
CASES = [
    ("qwen2_tied_qv", Qwen2Config,
     dict(tie_word_embeddings=True, use_sliding_window=False),
     dict(target_modules=["q_proj", "v_proj"], r=4, lora_alpha=8), 21),
    ("llama_untied_all", LlamaConfig,
     dict(tie_word_embeddings=False, attention_bias=False, mlp_bias=False),
     dict(target_modules=ALL_LINEAR, r=8, lora_alpha=16), 22),
    ("qwen2_untied_rslora", Qwen2Config,
     dict(tie_word_embeddings=False, use_sliding_window=False),
     dict(target_modules=["o_proj", "down_proj"], r=4, lora_alpha=16, use_rslora=True), 23),
    # DeepSeek-V3's Multi-Latent Attention, every layer dense: adapters on
    # each of its projections, the query and key/value latents' too; YaRN and
    # interleaved rotary pairs on. (PEFT takes a DeepSeek-V3 model for a
    # fused-expert one and refuses gate_proj without up_proj.)
    ("deepseek_mla", DeepseekV3Config,
     dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12,
          num_key_value_heads=4, first_k_dense_replace=2, n_routed_experts=4, n_group=1, topk_group=1,
          num_experts_per_tok=2, moe_intermediate_size=16, num_nextn_predict_layers=0,
          tie_word_embeddings=False, rope_interleave=True,
          rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                           "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 1.0}),
     dict(target_modules=["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
          r=4, lora_alpha=8), 24),
]


def redraw(params, gen):
    """N(0, 0.1) for every weight and bias, 1 + N(0, 0.1) for norm weights."""
    with torch.no_grad():
        for name, p in params:
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.1
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)


def save_hf(model, path):
    """save_pretrained, keeping only config.json + model.safetensors."""
    model.save_pretrained(path)
    gen_cfg = os.path.join(path, "generation_config.json")
    if os.path.exists(gen_cfg):
        os.remove(gen_cfg)


def load_hf(path):
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                dtype=torch.float32)


def adapter_name(param_name):
    """named_parameters() name -> adapter_model.safetensors name: PEFT drops
    the adapter name ("default") that sits between lora_A/lora_B and weight."""
    return param_name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


def rel_err(got, want):
    scale = want.abs().max().item()
    return (got - want).abs().max().item() / scale


def make_case(out_dir, case, cls, extra, lora, seed):
    torch.manual_seed(seed)  # PEFT's own (overwritten) lora_A init uses it
    gen = torch.Generator().manual_seed(seed)
    cfg = cls(**{**SIZES, **extra})  # a case's own sizes win
    cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                             dtype=torch.float32)
    redraw(model.named_parameters(), gen)
    case_dir = os.path.join(out_dir, case)
    base_dir = os.path.join(case_dir, "base")
    adapter_dir = os.path.join(case_dir, "adapter")
    merged_dir = os.path.join(case_dir, "merged")
    save_hf(model, base_dir)  # before get_peft_model, which edits the model in place

    V = cfg.vocab_size
    tokens = torch.randint(0, V, (B, T + 1), generator=gen)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    with torch.no_grad():
        base_logits = model(input_ids=inputs, use_cache=False).logits

    lcfg = LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, bias="none", **lora)
    pm = get_peft_model(model, lcfg)
    # PEFT stores target_modules as a set; its save_pretrained writes
    # list(set), whose order follows string hashing (PYTHONHASHSEED). A sorted
    # list keeps adapter_config.json byte-identical across runs.
    pm.peft_config["default"].target_modules = sorted(lcfg.target_modules)
    trainable = [(n, p) for n, p in pm.named_parameters() if p.requires_grad]
    if not trainable or any(".lora_A." not in n and ".lora_B." not in n for n, _ in trainable):
        sys.exit(f"{case}: unexpected trainable parameters {[n for n, _ in trainable]}")
    redraw(trainable, gen)
    pm.train()  # dropout is 0.0 (nn.Identity); train mode only matters for the cache

    logits = pm(input_ids=inputs, use_cache=False).logits  # (B, T, V)
    loss = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
    loss.backward()
    logits = logits.detach()
    moved = rel_err(logits, base_logits)
    if moved < 1e-2:
        sys.exit(f"{case}: adapters barely change the logits ({moved:.2e})")

    pm.save_pretrained(adapter_dir)
    card = os.path.join(adapter_dir, "README.md")  # model card boilerplate
    if os.path.exists(card):
        os.remove(card)

    # The adapter file holds exactly the trainable parameters, under the
    # names the gradients are stored with.
    saved = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    want = {adapter_name(n): p.detach() for n, p in trainable}
    if set(saved) != set(want):
        sys.exit(f"{case}: adapter names {sorted(saved)} != trainable {sorted(want)}")
    for k, v in want.items():
        if not torch.equal(saved[k], v):
            sys.exit(f"{case}: saved {k} differs from the parameter")

    tensors = {
        "inputs": inputs.to(torch.int32),
        "targets": targets.to(torch.int32),
        "logits": logits.float().contiguous(),
        "loss": loss.detach().float().reshape(1),
    }
    for n, p in trainable:
        g = p.grad
        if g is None or not g.abs().max().item() > 0:
            sys.exit(f"{case}: zero gradient for {n}")
        tensors["grad." + adapter_name(n)] = g.detach().float().contiguous()

    r, alpha = lcfg.r, lcfg.lora_alpha
    scale = alpha / math.sqrt(r) if lcfg.use_rslora else alpha / r
    for mod in pm.modules():  # PEFT's LoRA layers keep scaling[adapter name]
        s = getattr(mod, "scaling", None)
        if isinstance(s, dict) and "default" in s and abs(s["default"] - scale) > 1e-12:
            sys.exit(f"{case}: PEFT scaling {s['default']} != {scale}")

    merged = pm.merge_and_unload()
    save_hf(merged, merged_dir)

    # merged/ has the base's names, and each target weight is W + scale * B @ A.
    base_sd = load_file(os.path.join(base_dir, "model.safetensors"))
    merged_sd = load_file(os.path.join(merged_dir, "model.safetensors"))
    if set(base_sd) != set(merged_sd):
        sys.exit(f"{case}: merged names differ from base: "
                 f"{sorted(set(base_sd) ^ set(merged_sd))}")
    prefix = "base_model.model."
    n_merged = 0
    for k in base_sd:
        a_key = prefix + k.replace(".weight", ".lora_A.weight")
        if a_key in saved:
            b_key = a_key.replace(".lora_A.", ".lora_B.")
            expect = base_sd[k] + scale * (saved[b_key] @ saved[a_key])
            if (merged_sd[k] - expect).abs().max().item() > 1e-6:
                sys.exit(f"{case}: merged {k} != W + scale * B @ A")
            n_merged += 1
        elif not torch.equal(base_sd[k], merged_sd[k]):
            sys.exit(f"{case}: untargeted weight {k} changed by the merge")
    if n_merged != len(saved) // 2:
        sys.exit(f"{case}: merged {n_merged} weights, adapter has {len(saved) // 2} pairs")

    back = load_hf(merged_dir)
    with torch.no_grad():
        merged_logits = back(input_ids=inputs, use_cache=False).logits
    merr = rel_err(merged_logits, logits)
    if merr > TOL:
        sys.exit(f"{case}: merged logits differ from LoRA logits (relative {merr:.3e})")
    tensors["merged_logits"] = merged_logits.float().contiguous()

    # base/ + adapter/ load back, through PEFT, to the same function.
    reloaded = PeftModel.from_pretrained(load_hf(base_dir), adapter_dir)
    with torch.no_grad():
        again = reloaded(input_ids=inputs, use_cache=False).logits
    if not torch.equal(again, logits):
        sys.exit(f"{case}: base + adapter reload gives different logits "
                 f"(max abs err {(again - logits).abs().max().item()})")

    # One metadata key: safetensors writes the metadata map in hash order, so
    # several keys would make the header bytes differ from run to run.
    about = f"case {case}; torch {torch.__version__}; peft {peft.__version__}; scale {scale!r}"
    save_file(tensors, os.path.join(case_dir, "fixture.safetensors"), metadata={"about": about})
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        keys = len(json.load(f))
    print(f"{case}: lora params={sum(p.numel() for _, p in trainable)} "
          f"tensors={len(trainable)} scale={scale:g} loss={loss.item():.6f} "
          f"adapter moves logits {moved:.3f} (relative), merged rel err {merr:.2e}, "
          f"adapter_config keys={keys}, reload=identical")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "tests", "fixtures", "lora")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # one thread: reductions sum in a fixed order
    for case, cls, extra, lora, seed in CASES:
        make_case(out_dir, case, cls, extra, lora, seed)


if __name__ == "__main__":
    main()
