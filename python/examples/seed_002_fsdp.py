#!/usr/bin/env python3
"""HyperParallel's optimizer guide (seed 002), its sharded-optimizer block
("分片优化器（FSDP/HSDP 集成）") as written, with hyper_parallel renamed
hypertrain: a small transformers Qwen2 (float32, random init) learning to
count under fully_shard on a data-parallel mesh, each rank its own share of
every batch, with the seed's grouping, scheduler and training loop around it.
What is not the seed's code: the model and data; the grouping's ndim == 2
(its name filter would send q/k/v's biases to Muon, which takes matrices);
and the block's "..." (a placeholder, not Python after keyword arguments)
filled with the seed's own muon_kwargs and adamw_kwargs from its section 1.
init_device_mesh("npu", ...) is a CPU mesh where PyTorch has no Ascend
backend (hypertrain.init_device_mesh says so once).

Usage: torchrun --nproc-per-node 2 python/examples/seed_002_fsdp.py [STEPS]
"""

import os
import sys

import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

from hypertrain.core.optimizer import get_hyper_lr_scheduler

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
dp_size = int(os.environ.get("WORLD_SIZE", "1"))
torch.manual_seed(0)
model = Qwen2ForCausalLM(Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))

# seed 002, 3. 参数分组示例 (the matrices of the named projections to Muon)
muon_param_groups = []
adamw_param_groups = []
for name, param in model.named_parameters():
    if not param.requires_grad:
        continue
    if any(key in name for key in ["q_proj", "k_proj", "v_proj", "o_proj",
                                   "gate_proj", "up_proj", "down_proj"]) and param.ndim == 2:
        muon_param_groups.append(param)
    else:
        adamw_param_groups.append(param)

# ---- seed 002, 分片优化器（FSDP/HSDP 集成）, as written (hyper_parallel -> hypertrain) ----
from hypertrain import fully_shard, init_device_mesh
from hypertrain.core.optimizer import get_hyper_optimizer

mesh = init_device_mesh("npu", (dp_size,), mesh_dim_names=("dp",))
model = fully_shard(model, mesh=mesh)

# FSDP 分片后，优化器状态也自动分片
optimizer = get_hyper_optimizer(
    model=model,
    muon_params=muon_param_groups,
    adamw_params=adamw_param_groups,
    muon_kwargs={"lr": 0.02, "momentum": 0.95},  # the seed's "...": its section 1's kwargs
    adamw_kwargs={"lr": 3e-4, "weight_decay": 0.1},
)
# ---- end of the seed's block ----

scheduler = get_hyper_lr_scheduler(optimizer=optimizer, scheduler_type="cosine", total_steps=steps,
                                   warmup_steps=steps // 10)
rank = dist.get_rank()
gen = torch.Generator().manual_seed(1)
starts = torch.randint(0, 256, (steps, 4 * dp_size, 1), generator=gen)
data = (starts + torch.arange(33)) % 256  # (steps, 4 sequences a rank, 33 tokens)
for step, batch in enumerate(data):
    mine = batch[4 * rank:4 * (rank + 1)]
    loss = model(input_ids=mine[:, :-1], labels=mine[:, :-1]).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    if rank == 0:
        print(f"step {step + 1:3d}/{steps} | loss {mean.item() / dp_size:.4f}")

name, p = next((n, q) for n, q in model.named_parameters() if "q_proj.weight" in n)
buf = optimizer.optimizers[0].state[p]["momentum_buffer"]
local = buf.to_local() if hasattr(buf, "to_local") else buf
if rank == 0:
    print(f"sharded: {name} is a {type(p).__name__} of {tuple(p.shape)}, its Muon momentum_buffer {tuple(local.shape)} "
          f"on rank 0 of {dp_size}")
dist.barrier()
dist.destroy_process_group()
