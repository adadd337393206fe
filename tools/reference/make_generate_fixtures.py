#!/usr/bin/env python3
"""Write the reference fixtures that hypertrain's generation tests compare against.

For each case, a model folder the other fixture scripts already wrote (its
config.json + model.safetensors, float32) is loaded with transformers'
AutoModelForCausalLM.from_pretrained (attn_implementation="eager",
experts_implementation="eager" where the model has experts, eval mode) and
continued greedily with model.generate(do_sample=False, use_cache=True,
output_logits=True): the prompt in one forward, then one token per forward
through transformers' own key/value cache. No token stops it (eos_token_id
None), so every case has max_new_tokens new tokens.

Cases (the folder under tests/fixtures/; prompt length n; new tokens):

  qwen2_untied   model/qwen2_untied   Qwen2, q/k/v biases, GQA 2:1      n 9,  new 16
  llama_tied     model/llama_tied     Llama, tied embeddings             n 5,  new 16
  moe_untied     moe/moe_untied       Qwen2-MoE, layer 1 dense, top-2    n 7,  new 16
  dsv3_a         dsv3/dsv3_a          DeepSeek-V3: MLA with q LoRA,      n 6,  new 16
                                      interleaved YaRN rope, grouped
                                      routing, a shared expert
  dsv3_b         dsv3/dsv3_b          DeepSeek-V3: plain q_proj, default n 11, new 12
                                      rope, 13 experts, tied

tests/fixtures/generate/<case>.safetensors:

  prompt   I32 (n,)         the prompt's ids (drawn from torch.Generator seeded
                            with the case's index, in [0, vocab))
  tokens   I32 (new,)       generate's new ids (sequences[0, n:])
  logits   F32 (new, V)     the logits each new token was chosen from
                            (output_logits: before any processor)
  margin   F32 (new,)       each row's largest logit minus its second largest:
                            a greedy choice a 1e-5 error cannot flip needs
                            more than 2e-5 (checked here)

metadata: "model" = the folder, relative to tests/fixtures/.

Rerunning writes identical bytes (CPU, float32, fixed prompts).
"""
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "..", "tests", "fixtures")

CASES = [
    ("qwen2_untied", "model/qwen2_untied", 9, 16),
    ("llama_tied", "model/llama_tied", 5, 16),
    ("moe_untied", "moe/moe_untied", 7, 16),
    ("dsv3_a", "dsv3/dsv3_a", 6, 16),
    ("dsv3_b", "dsv3/dsv3_b", 11, 12),
]


def load(folder):
    kwargs = {"dtype": torch.float32, "attn_implementation": "eager"}
    try:
        return AutoModelForCausalLM.from_pretrained(folder, experts_implementation="eager", **kwargs)
    except (TypeError, ValueError):
        return AutoModelForCausalLM.from_pretrained(folder, **kwargs)


def make(index, name, rel, n, new):
    folder = os.path.join(FIXTURES, rel)
    model = load(folder).eval()
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(index)
    prompt = torch.randint(0, V, (1, n), generator=g)
    with torch.no_grad():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            use_cache=True,
            max_new_tokens=new,
            min_new_tokens=new,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, n:].to(torch.int32)
    logits = torch.stack([l[0] for l in out.logits]).to(torch.float32)
    assert tokens.shape[0] == new, (name, tokens.shape)
    assert torch.equal(logits.argmax(-1).to(torch.int32), tokens), name
    top2 = logits.topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]).contiguous()
    assert float(margin.min()) > 2e-5, (name, float(margin.min()))
    # The cache's continuation equals one forward over the whole sequence.
    with torch.no_grad():
        whole = model(out.sequences).logits[0, n - 1 : n - 1 + new]
    assert torch.allclose(whole, logits, atol=1e-4), (name, float((whole - logits).abs().max()))
    path = os.path.join(FIXTURES, "generate", name + ".safetensors")
    save_file(
        {"prompt": prompt[0].to(torch.int32).contiguous(), "tokens": tokens.contiguous(), "logits": logits, "margin": margin},
        path,
        metadata={"model": rel},
    )
    print(f"{name}: prompt {prompt[0].tolist()} -> {tokens.tolist()} (smallest margin {float(margin.min()):.3g})")


def main():
    torch.manual_seed(0)
    os.makedirs(os.path.join(FIXTURES, "generate"), exist_ok=True)
    for i, (name, rel, n, new) in enumerate(CASES):
        make(i, name, rel, n, new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
