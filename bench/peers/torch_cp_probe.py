#!/usr/bin/env python3
"""Whether PyTorch's context parallelism (torch.distributed.tensor.experimental.
context_parallel, the ring attention peer of hypertrain's parallel.ring_attention_size)
runs on CPU with gloo: one causal SDPA of (1, 4, 64, 16) q/k/v sharded on the
sequence over the ranks, forward and backward. Each rank prints "ok" or the
error torch raises (with torch 2.15.0: the CPU flash-attention op has no
sharding strategy, so the peer does not run on CPU; bench/RESULTS.md says so).

Usage: torchrun --standalone --nproc_per_node=2 bench/peers/torch_cp_probe.py
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)  # the same q, k, v on every rank; context_parallel keeps each rank's chunks
    q, k, v = (torch.randn(1, 4, 64, 16) for _ in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            # the buffers are resized in place, so the leaves that need grad are copies of them
            a, b, c = (t.clone().requires_grad_() for t in (q, k, v))
            out = F.scaled_dot_product_attention(a, b, c, is_causal=True)
            out.sum().backward()
        print(f"torch_cp rank {rank}: ok, output {tuple(out.shape)} of the sequence's (1, 4, 64, 16)")
    except Exception as e:
        print(f"torch_cp rank {rank}: FAILED on CPU (torch {torch.__version__.split('+')[0]}): "
              f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
