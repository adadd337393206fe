#!/usr/bin/env python3
"""PyTorch tensor-parallel peer for hypertrain's bench/run_tp.sh: transformers'
Qwen2ForCausalLM with Qwen2.5-0.5B's shapes (torch_train_step.MODELS), float32,
random init, split over the ranks with torch.distributed.tensor.parallel on the
gloo backend, on CPU.

The plan is Megatron's, as hypertrain's: q/k/v, gate and up ColwiseParallel,
o_proj and down RowwiseParallel, the embedding RowwiseParallel (vocabulary
rows) and the LM head ColwiseParallel (vocabulary columns, the logits left
sharded) with loss_parallel(), so no rank holds a token's whole logits row;
the tied embedding and head share one sharded weight. --sp adds sequence
parallelism: the norms SequenceParallel, the residual stream sharded on the
sequence, each attention and MLP input gathered (PrepareModuleInput) and each
row-parallel output reduce-scattered; positions are passed whole, since
transformers derives them from the hidden states' length otherwise.

One step = forward of B x T tokens (the same on every rank of the group) +
cross-entropy + backward + clip_grad_norm_(1.0) + AdamW (lr 1e-3, weight
decay 0.01) + zero_grad. Rank 0 prints one line: tokens/s, s/step over
--steps timed steps after --warmup untimed ones, every rank's peak RSS. A
failure (an op gloo or DTensor lacks on CPU) is printed as such, not hidden.

Usage: torchrun --standalone --nproc_per_node=2 bench/peers/torch_tp_step.py
           [--threads 1] [--steps 3] [--warmup 1] [--batch 1] [--seq 1024] [--sp]
"""

import argparse
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_train_step import MODELS  # noqa: E402  (one definition of the shapes)


def plan_layers(model, mesh, sp):
    """Megatron's layout on every decoder layer; with sp the norms and the residual stream on the sequence."""
    for layer in model.model.layers:
        plan = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
        }
        if sp:
            plan.update({
                "input_layernorm": SequenceParallel(),
                "post_attention_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(layer, mesh, plan)
        if not sp:
            replicate(layer.input_layernorm, mesh)
            replicate(layer.post_attention_layernorm, mesh)


def replicate(module, mesh):
    """A module whole on every rank, its params Replicate DTensors (so that the clip and AdamW see DTensors
    only, as torchtitan's replicated norms), its input and output plain tensors: no communication."""
    distribute_module(module, mesh,
                      input_fn=lambda mod, inputs, mesh: tuple(
                          DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs),
                      output_fn=lambda mod, out, mesh: out.to_local())


def plan_ends(model, mesh, sp):
    """The embedding by vocabulary rows, the LM head by vocabulary columns (the logits stay sharded), one weight."""
    tied = model.config.tie_word_embeddings
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate()),
        "lm_head": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Shard(-1),
                                   use_local_output=False),
    }
    if sp:
        plan["model.norm"] = SequenceParallel()
    parallelize_module(model, mesh, plan)
    if not sp:
        replicate(model.model.norm, mesh)
    if tied:  # both shard dim 0 of the (V, C) weight: one DTensor for both
        model.lm_head.weight = model.model.embed_tokens.weight


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--sp", action="store_true", help="sequence parallelism too")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)  # the same initial weights on every rank
    shapes = dict(MODELS["qwen2.5-0.5b"], max_position_embeddings=max(8192, args.seq))
    cfg = Qwen2Config(**shapes, rms_norm_eps=1e-6, attn_implementation="sdpa")
    model = Qwen2ForCausalLM(cfg).float()
    model.train()
    nparams = sum(p.numel() for p in model.parameters())
    what = "tensor parallel" + (" + sequence parallel" if args.sp else "")
    try:
        plan_layers(model, mesh, args.sp)
        plan_ends(model, mesh, args.sp)
    except Exception as e:
        if rank == 0:
            print(f"torch_tp ranks={world} FAILED to apply the {what} plan: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:300] if str(e) else ''}", flush=True)
        dist.destroy_process_group()
        return 1
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01)

    gen = torch.Generator().manual_seed(1000)  # the same tokens on every rank of the group
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(args.seq).unsqueeze(0).expand(args.batch, -1)

    def step():
        logits = model(input_ids=inputs, position_ids=positions).logits  # (B, T, V) sharded on V
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()

    try:
        for _ in range(args.warmup):
            step()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = step()
        dist.barrier()
    except Exception as e:
        if rank == 0:
            print(f"torch_tp ranks={world} FAILED in a {what} step: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:300] if str(e) else ''}", flush=True)
        dist.destroy_process_group()
        return 1
    dt = (time.perf_counter() - t0) / args.steps
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024  # KiB on Linux
    rss_all = [None] * world
    dist.all_gather_object(rss_all, rss_mib)
    if rank == 0:
        print(f"torch_tp ranks={world} threads={args.threads} sp={int(args.sp)} "
              f"tokens_per_s={args.batch * args.seq / dt:.1f} step_s={dt:.3f} "
              f"peak_rss_mib_per_rank=[{', '.join(str(r) for r in rss_all)}] torch={torch.__version__.split('+')[0]} "
              f"batch={args.batch} seq={args.seq} steps={args.steps} params={nparams} final_loss={loss:.4f}",
              flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
