#!/usr/bin/env python3
"""PyTorch FSDP2 peer for hypertrain's data-parallel benchmark (bench/run_dist.sh):
the 31M-parameter Qwen2 model of torch_train_step.py (vocab 8192, hidden 512,
8 layers, 8 heads, 2 KV heads, intermediate 1408, untied embeddings, q/k/v
biases) sharded over ranks with torch.distributed.fsdp.fully_shard on the gloo
backend, on CPU.

Sharding: one FSDP unit for embed_tokens, one per decoder layer, and the root
(final norm + lm_head); reshard_after_forward=True. FSDP holds the FP32 main
params; forward/backward run in bf16 (MixedPrecisionPolicy param_dtype bf16,
reduce_dtype fp32). Gradients are reduce-scattered after every micro-batch.
Optimizers: torch.optim.Muon (lr 0.02, momentum 0.95, nesterov, weight decay
0.1, adjust_lr_fn "match_rms_adamw") on the decoder layers' 2-D weights,
torch.optim.AdamW (lr 1e-3, betas (0.9, 0.999), weight decay 0.01) on the
rest. If Muon fails on the DTensor shards the run falls back to AdamW on every
param and says so in the output line.

One step = --accum micro-batches of B x T random tokens per rank (forward +
cross-entropy + backward) + clip_grad_norm_(1.0) + optimizer steps + zero_grad.
Rank 0 prints one line with global tokens/s and s/step over --steps timed
steps after --warmup untimed ones, and every rank's peak RSS.

Usage: torchrun --standalone --nproc_per_node=N bench/peers/torch_fsdp2_step.py
           [--threads 1] [--steps 5] [--warmup 1] [--batch 2] [--seq 256] [--hf-config DIR]
           [--global-batch 8] [--accum A] [--attn sdpa|eager]
           [--optimizer muon|adamw]
"""

import argparse
import os
import resource
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

# The same 31M model as the one-process peer (one definition for both).
from torch_train_step import build_model


def shard(model, mesh):
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kw = dict(mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    if not getattr(model.config, "tie_word_embeddings", False):  # a tied one belongs to the root with lm_head
        fully_shard(model.model.embed_tokens, **kw)
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)  # root unit: final norm + lm_head


def make_optimizers(model, kind):
    """kind "muon": Muon on the decoder layers' 2-D weights, AdamW on the rest;
    "adamw": AdamW on everything."""
    muon_params, adamw_params = [], []
    for name, p in model.named_parameters():
        if kind == "muon" and ".layers." in name and p.ndim == 2:
            muon_params.append(p)
        else:
            adamw_params.append(p)
    opts = []
    if muon_params:
        kw = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
        try:
            opts.append(torch.optim.Muon(muon_params, adjust_lr_fn="match_rms_adamw", **kw))
        except (TypeError, ValueError):  # a torch without adjust_lr_fn
            opts.append(torch.optim.Muon(muon_params, **kw))
    opts.append(torch.optim.AdamW(adamw_params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01))
    return opts, len(muon_params), len(adamw_params)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batch", type=int, default=2, help="local batch B (sequences per micro-batch per rank)")
    ap.add_argument("--seq", type=int, default=256, help="sequence length T")
    ap.add_argument("--global-batch", type=int, default=8, help="sequences per step over all ranks")
    ap.add_argument("--accum", type=int, default=0, help="micro-batches per step (default: global/(B*world))")
    ap.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    ap.add_argument("--hf-config", metavar="DIR",
                    help="a Hugging Face folder: its architecture with random FP32 weights instead of the 31M model")
    ap.add_argument("--optimizer", choices=["muon", "adamw"], default="muon",
                    help="muon: Muon + AdamW (falls back to adamw if Muon fails on DTensor)")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.set_num_threads(args.threads)

    accum = args.accum or args.global_batch // (args.batch * world)
    if accum < 1 or (not args.accum and accum * args.batch * world != args.global_batch):
        raise SystemExit(f"global batch {args.global_batch} is not a multiple of batch {args.batch} x {world} ranks")

    torch.manual_seed(0)  # the same initial weights on every rank
    if args.hf_config:
        from transformers import AutoConfig, AutoModelForCausalLM
        cfg = AutoConfig.from_pretrained(args.hf_config)
        cfg._attn_implementation = args.attn
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    else:
        model, cfg = build_model(args.attn)
    model.train()
    nparams = sum(p.numel() for p in model.parameters())
    shard(model, mesh)

    gen = torch.Generator().manual_seed(1000 + rank)  # different data per rank
    tokens = torch.randint(0, cfg.vocab_size, (accum, args.batch, args.seq + 1), generator=gen)
    inputs, targets = tokens[..., :-1], tokens[..., 1:]  # (A, B, T) each

    opt_kind = args.optimizer
    opts, n_muon, n_adamw = make_optimizers(model, opt_kind)

    def step():
        total = 0.0
        for a in range(accum):
            logits = model(input_ids=inputs[a]).logits  # (B, T, V), bf16
            loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), targets[a].reshape(-1)) / accum
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad(set_to_none=True)
        return total

    note = ""
    for i in range(args.warmup):
        try:
            step()
        except Exception as e:  # Muon on DTensor shards
            if opt_kind != "muon" or i > 0:
                raise
            err = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            if rank == 0:
                print(f"# torch.optim.Muon failed on FSDP2 DTensor params ({err}); falling back to AdamW", flush=True)
            # the failed step may have updated some params already; the run is a benchmark, not a training run
            model.zero_grad(set_to_none=True)
            opt_kind, note = "adamw", " (Muon unsupported on DTensor)"
            opts, n_muon, n_adamw = make_optimizers(model, opt_kind)
            step()

    dist.barrier()
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    dist.barrier()
    dt = (time.perf_counter() - t0) / args.steps

    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024  # ru_maxrss is in KiB on Linux
    rss_all = [None] * world
    dist.all_gather_object(rss_all, rss_mib)

    if rank == 0:
        tokens_per_step = args.batch * args.seq * accum * world
        optname = "muon+adamw" if opt_kind == "muon" else "adamw"
        print(f"torch_fsdp2 ranks={world} threads={args.threads} tokens_per_s={tokens_per_step / dt:.1f} "
              f"step_s={dt:.3f} peak_rss_mib_per_rank=[{', '.join(str(r) for r in rss_all)}] "
              f"optimizer={optname}{note} torch={torch.__version__.split('+')[0]} "
              f"batch={args.batch} seq={args.seq} accum={accum} global_batch={args.batch * accum * world} "
              f"steps={args.steps} params={nparams} muon_params={n_muon} adamw_params={n_adamw} "
              f"attn={args.attn} final_loss={loss:.4f} loadavg_1m_before={load_before:.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
