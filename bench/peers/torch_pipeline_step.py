#!/usr/bin/env python3
"""PyTorch pipeline-parallel peer for hypertrain's bench/run_pipeline.sh:
transformers' Qwen2 decoder (byte vocabulary 256, untied embeddings, q/k/v
biases; the sizes are arguments, by default configs/default.yaml's with 8
layers), float32, random init, split into P stages of whole layers as
hypertrain splits them (L / P each, the first L mod P stages one more; the
embedding on the first stage, the final norm, the LM head and the loss on
the last) and run by torch.distributed.pipelining (PipelineStage +
Schedule1F1B or ScheduleGPipe) on the gloo backend, on CPU, one stage a
rank (torchrun --nproc_per_node P).

One step = the schedule's m micro-batches of B x T random tokens (forward +
cross-entropy on the last stage + backward; the schedule scales the
gradients by 1/m) + the gradient norm over every stage (each stage's sum of
squares, one all-reduce) clipped to 1.0 + AdamW (lr 1e-3, betas (0.9,
0.999), eps 1e-8, weight decay 0.01; torch's AdamW decays every param,
hypertrain's spares biases and norms: the same work) + zero_grad.

The bubble as torch's schedule leaves it: each rank times its stage's
compute (PipelineStage.forward_one_chunk and backward_one_chunk, and the
loss) inside schedule.step(); idle = 1 - compute / the step's schedule time,
the mean over the stages is the bubble measured, as hypertrain's "bubble
measured" is (its exchanges and waits counted as idle in both).

Rank 0 prints one line: global tokens/s and s/step over --steps timed steps
after --warmup untimed ones (the first step infers the stages' shapes), each
stage's compute share, the bubble measured and the formula's (P-1)/(m+P-1).

Usage: torchrun --standalone --nproc_per_node=P bench/peers/torch_pipeline_step.py
           [--schedule 1f1b|gpipe] [--micro 8] [--batch 2] [--seq 256] [--layers 8]
           [--hidden 256] [--intermediate 688] [--heads 8] [--kv-heads 2]
           [--threads 1] [--steps 3] [--warmup 1]
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from transformers import Qwen2Config, Qwen2ForCausalLM


def stage_layers(L, P, s):
    """hypertrain's split (ht_pipeline_stage_of): [s*L/P + min(s, L mod P), ...), one more on the first L mod P."""
    lo = s * (L // P) + min(s, L % P)
    return lo, lo + L // P + (1 if s < L % P else 0)


class Stage(nn.Module):
    """Stage s of the decoder: the embedding on the first, its layers, the final norm and the LM head on the last."""

    def __init__(self, model, lo, hi, first, last):
        super().__init__()
        self.embed_tokens = model.model.embed_tokens if first else None
        self.layers = nn.ModuleList(model.model.layers[lo:hi])
        self.rotary_emb = model.model.rotary_emb
        self.norm = model.model.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x):
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        pos = torch.arange(h.shape[1]).unsqueeze(0)
        rope = self.rotary_emb(h, pos)
        for layer in self.layers:  # no mask: sdpa's causal attention
            h = layer(h, position_ids=pos, position_embeddings=rope)
        if self.lm_head is not None:
            h = self.lm_head(self.norm(h))
        return h


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    ap.add_argument("--micro", type=int, default=8, help="micro-batches a step, m")
    ap.add_argument("--batch", type=int, default=2, help="sequences a micro-batch, B")
    ap.add_argument("--seq", type=int, default=256, help="sequence length T")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=688)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads)
    V, m, B, T = 256, args.micro, args.batch, args.seq

    torch.manual_seed(0)  # the whole model on every rank (it is small), then each keeps its stage
    cfg = Qwen2Config(vocab_size=V, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=max(512, T), rope_theta=10000.0,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False, use_cache=False)
    cfg._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(cfg).to(torch.float32)
    lo, hi = stage_layers(args.layers, P, rank)
    first, last = rank == 0, rank == P - 1
    module = Stage(model, lo, hi, first, last)
    module.train()
    del model
    nparams = sum(p.numel() for p in module.parameters())

    busy = [0.0]  # this rank's seconds computing inside schedule.step()

    def timed(fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                busy[0] += time.perf_counter() - t0
        return wrapper

    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, V), target.reshape(-1))

    stage = PipelineStage(module, rank, P, torch.device("cpu"))
    stage.forward_one_chunk = timed(stage.forward_one_chunk)
    stage.backward_one_chunk = timed(stage.backward_one_chunk)
    sched_cls = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
    schedule = sched_cls(stage, n_microbatches=m, loss_fn=timed(loss_fn))

    opt = torch.optim.AdamW(module.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    params = [p for p in module.parameters()]
    gen = torch.Generator().manual_seed(1000)
    tokens = torch.randint(0, V, (m * B, T + 1), generator=gen)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step():
        losses = []
        busy[0] = 0.0
        t0 = time.perf_counter()
        if first:
            schedule.step(inputs)
        elif last:
            schedule.step(target=targets, losses=losses)
        else:
            schedule.step()
        sched_s = time.perf_counter() - t0
        # the global gradient norm over the stages, clipped to 1.0, then AdamW
        sq = torch.zeros(1, dtype=torch.float64)
        for p in params:
            if p.grad is not None:
                sq += p.grad.double().pow(2).sum()
        dist.all_reduce(sq)
        norm = sq.sqrt().item()
        if norm > 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(1.0 / (norm + 1e-6))
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = torch.stack(losses).mean().item() if losses else 0.0
        return sched_s, busy[0], loss

    for _ in range(args.warmup):
        step()
    dist.barrier()
    load_before = os.getloadavg()[0]
    sched_total = busy_total = 0.0
    loss = 0.0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        s, b, loss = step()
        sched_total += s
        busy_total += b
    dist.barrier()
    dt = (time.perf_counter() - t0) / args.steps

    mine = torch.tensor([sched_total, busy_total, loss], dtype=torch.float64)
    everyone = [torch.zeros(3, dtype=torch.float64) for _ in range(P)]
    dist.all_gather(everyone, mine)
    if rank == 0:
        shares = [float(e[1] / e[0]) for e in everyone]
        bubble = 100.0 * sum(1.0 - s for s in shares) / P
        final_loss = float(everyone[-1][2])
        print(f"torch_pipeline stages={P} schedule={args.schedule} micro={m} batch={B} seq={T} "
              f"tokens_per_s={m * B * T / dt:.1f} step_s={dt:.3f} "
              f"schedule_s={float(everyone[0][0]) / args.steps:.3f} "
              f"computing=[{', '.join(f'{100 * s:.0f}%' for s in shares)}] bubble_measured={bubble:.1f}% "
              f"bubble_formula={100.0 * (P - 1) / (m + P - 1):.1f}% "
              f"layers={[stage_layers(args.layers, P, q) for q in range(P)]} params_stage0={nparams} "
              f"threads={args.threads} steps={args.steps} final_loss={final_loss:.4f} "
              f"torch={torch.__version__.split('+')[0]} loadavg_1m_before={load_before:.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
