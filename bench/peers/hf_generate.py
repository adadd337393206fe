#!/usr/bin/env python3
"""transformers' generate beside `hypertrain generate` (bench/run_generate.sh).

--make DIR SIZE: a random float32 Qwen2 model of SIZE ("default": the default
config's byte-level model; "small": hidden 512, 8 layers, 8 heads over 2
key/value heads, MLP 1408, vocab 32000: 62M parameters) saved with
save_pretrained (N(0, 0.02) weights, seed 0).

DIR --prompt-ids IDS --new N --threads T: greedy generate (do_sample=False,
use_cache=True, eos None) of N tokens after the prompt; prints one JSON line:
the new ids, the prompt's seconds (the first token) and the tokens/s of the
rest, timed as hypertrain times them (one warm-up call first).
"""
import argparse
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

SIZES = {
    "default": dict(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512),
    "small": dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024),
}


def make(folder, size):
    torch.manual_seed(0)
    cfg = Qwen2Config(rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, **SIZES[size])
    model = Qwen2ForCausalLM(cfg).to(torch.float32)
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)


class Timer:
    """A logits processor that notes when each token's logits are ready."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def run(args):
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = torch.tensor([[int(x) for x in args.prompt_ids.split(",")]])
    kw = dict(do_sample=False, use_cache=True, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
        timer = Timer()
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, logits_processor=[timer], **kw)
    new = out[0, ids.shape[1]:].tolist()
    first = timer.times[0] - t0
    rate = (len(new) - 1) / (timer.times[-1] - timer.times[0])
    print(json.dumps({"engine": "transformers", "prompt_s": round(first, 4), "tokens_per_s": round(rate, 1),
                      "tokens": ",".join(map(str, new))}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("--make", choices=sorted(SIZES))
    p.add_argument("--prompt-ids")
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if args.make:
        make(args.folder, args.make)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
