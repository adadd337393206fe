#!/usr/bin/env python3
"""PyTorch + transformers peer for bench/run_first_step.sh: the time from
the interpreter's start to the end of the first training step of a model
loaded from a Hugging Face folder, as a user's script takes it: import torch
and transformers, from_pretrained (bfloat16), torch's AdamW, one step
(forward, loss, backward, optimizer step) on a batch of random tokens.

--make DIR writes DIR once: Qwen2.5-0.5B's architecture (vocab 151936,
hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, tied),
random weights, bfloat16 safetensors (what both sides load).

Prints one JSON line: seconds from start to the first step's end, and the
parts (imports, load, step).
Usage: torch_first_step.py DIR [--batch 4] [--seq 512] [--threads 2] | --make DIR
"""
import time

T0 = time.time()
import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

QWEN05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
               num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
               rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)


def make(path):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**QWEN05B, torch_dtype="bfloat16")).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--make", action="store_true")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if a.make:
        make(a.dir)
        return
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(a.threads)
    t_import = time.time()
    model = AutoModelForCausalLM.from_pretrained(a.dir, dtype=torch.bfloat16)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    t_load = time.time()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (a.batch, a.seq + 1), generator=g)
    out = model(input_ids=ids[:, :-1], labels=ids[:, 1:])
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    t_step = time.time()
    print(json.dumps({"engine": "pytorch", "torch": torch.__version__, "seconds_to_first_step": round(t_step - T0, 2),
                      "imports": round(t_import - T0, 2), "load": round(t_load - t_import, 2),
                      "step": round(t_step - t_load, 2), "loss": round(out.loss.item(), 4)}))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
