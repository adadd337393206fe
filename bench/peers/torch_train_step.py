#!/usr/bin/env python3
"""PyTorch peer for hypertrain's training-step benchmark: the 31M-parameter
Qwen2 model (vocab 8192, hidden 512, 8 layers, 8 heads, 2 KV heads,
intermediate 1408, untied embeddings, q/k/v biases), batch 8 x seq 256, on CPU.

One step = forward + cross-entropy loss + backward + AdamW step + zero_grad.
--dtype float32:  plain fp32.
--dtype bfloat16: fp32 weights and optimizer, forward/backward under
                  torch.autocast("cpu", dtype=torch.bfloat16).
Prints one JSON line with tokens/s and ms/step over --steps timed steps,
after --warmup untimed ones.

--model qwen2.5-0.5b: Qwen2.5-0.5B's architecture (vocab 151936, hidden 896,
24 layers, 14 heads, 2 KV heads, intermediate 4864, tied), random init, as
hypertrain's bench_train_step --model qwen2.5-0.5b. --batch/--seq change the
batch. The JSON line also has the process's peak RSS.

Usage: python3 bench/peers/torch_train_step.py [--dtype float32|bfloat16]
           [--threads 2] [--steps 10] [--warmup 2] [--attn sdpa|eager]
           [--model 31m|qwen2.5-0.5b|llama-1b|moe|dsv3|dsv3-dense] [--batch 8] [--seq 256] [--recompute]

--model llama-1b: Llama 3.2 1B's shapes (vocab 128256, hidden 2048, 16 layers,
32 heads, 8 KV heads, intermediate 8192, tied, no biases), random init.
--model dsv3: a small DeepSeek-V3 (DeepseekV3ForCausalLM, 141M params: MLA,
DeepSeekMoE with 32 routed experts, top-4 in 2 of 4 groups, a shared expert,
layer 0 dense); dsv3-dense: every layer dense. Run it with --attn eager.
--recompute: activation checkpointing of every decoder layer, as
bench_train_step --recompute.
--device cuda: on the GPU (as bench_train_step --backend cuda): the weights
and AdamW's state there, autocast("cuda"), the step timed between
synchronisations; the JSON line then has torch.cuda.max_memory_allocated.
--compile: torch.compile(model) (its compilation in the warm-up steps).
"""

import argparse
import contextlib
import json
import os
import resource
import time

import torch
import torch.nn.functional as F
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig,
                          Qwen2MoeForCausalLM)

MODELS = {
    "31m": dict(vocab_size=8192, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=2, intermediate_size=1408, max_position_embeddings=256, rope_theta=10000.0,
                tie_word_embeddings=False),
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, max_position_embeddings=8192,
                         rope_theta=1000000.0, tie_word_embeddings=True),
    # hypertrain's bench_model_llama_1b: Llama 3.2 1B's shapes, random init
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=8192, max_position_embeddings=8192,
                     rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5),
    # hypertrain's bench_model_moe: the 31M model's attention, every layer 8 experts (top-2) of 704 and a
    # shared expert of 704; transformers' default (grouped_mm) experts, its fastest on CPU
    "moe": dict(vocab_size=8192, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=2, intermediate_size=1408, max_position_embeddings=256, rope_theta=10000.0,
                tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=704,
                shared_expert_intermediate_size=704, norm_topk_prob=False, qkv_bias=True),
    # hypertrain's bench_model_dsv3: MLA (q latent 192, kv latent 128, q/k 64 + 32 interleaved rotary, v 64),
    # layer 0 dense, layers 1-7 32 experts of 352 in 4 groups (top-4 from 2 groups) and a shared one
    "dsv3": dict(vocab_size=8192, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=8, intermediate_size=1408, max_position_embeddings=256,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
                 q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                 rope_interleave=True, n_routed_experts=32, num_experts_per_tok=4, moe_intermediate_size=352,
                 n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                 first_k_dense_replace=1, attention_bias=False, num_nextn_predict_layers=0),
}
# the same with every layer's dense MLP: Multi-Latent Attention alone
MODELS["dsv3-dense"] = dict(MODELS["dsv3"], first_k_dense_replace=8)


def build_model(attn, name, seq):
    sizes = dict(MODELS[name])
    sizes["max_position_embeddings"] = max(sizes["max_position_embeddings"], seq)
    sizes.setdefault("rms_norm_eps", 1e-6)
    moe = "num_experts" in sizes
    if name.startswith("dsv3"):
        cfg = DeepseekV3Config(**sizes, use_cache=False)
        cfg._attn_implementation = attn
        model = DeepseekV3ForCausalLM(cfg).to(torch.float32)
        assert model.config._attn_implementation == attn
        return model, cfg
    if name.startswith("llama"):
        cfg = LlamaConfig(**sizes, attention_bias=False, mlp_bias=False, use_cache=False)
        cfg._attn_implementation = attn
        model = LlamaForCausalLM(cfg).to(torch.float32)
        assert model.config._attn_implementation == attn
        return model, cfg
    cfg = (Qwen2MoeConfig if moe else Qwen2Config)(**sizes, use_sliding_window=False, use_cache=False)
    cfg._attn_implementation = attn
    model = (Qwen2MoeForCausalLM if moe else Qwen2ForCausalLM)(cfg).to(torch.float32)
    assert model.config._attn_implementation == attn
    return model, cfg


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    # sdpa measured faster than eager on the 2-core dev box (see README).
    ap.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    ap.add_argument("--model", choices=sorted(MODELS), default="31m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--recompute", action="store_true",
                    help="activation checkpointing of every decoder layer (gradient_checkpointing_enable)")
    args = ap.parse_args()
    BATCH, SEQ = args.batch, args.seq

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, cfg = build_model(args.attn, args.model, SEQ)
    if args.recompute:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    dev = torch.device(args.device)
    model.to(dev)
    nparams = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=gen)
    tokens = tokens.to(dev)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (B, T) each
    forward = torch.compile(model) if args.compile else model

    def autocast():
        if args.dtype == "bfloat16":
            return torch.autocast(args.device, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    def step():
        with autocast():
            logits = forward(input_ids=inputs).logits  # (B, T, V)
            loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size),
                                   targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    for _ in range(args.warmup):
        step()
    load_before = os.getloadavg()[0]  # other work on the box slows the figures
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    sync()
    dt = (time.perf_counter() - t0) / args.steps
    device = {}
    if args.device == "cuda":
        device = {"gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda,
                  "peak_device_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1), "compile": args.compile}

    print(json.dumps({
        "impl": "pytorch",
        "dtype": args.dtype,
        "threads": args.threads,
        "tokens_per_s": round(BATCH * SEQ / dt, 1),
        "step_ms": round(dt * 1e3, 1),
        "params": nparams,
        "torch": torch.__version__,
        "attn": args.attn,
        "batch": BATCH,
        "seq": SEQ,
        "steps": args.steps,
        "final_loss": round(loss, 4),
        "loadavg_1m_before": round(load_before, 2),
        "model": args.model,
        "recompute": args.recompute,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "device": args.device,
        **device,
    }))


if __name__ == "__main__":
    main()
