#!/usr/bin/env python3
"""HyperParallel's optimizer guide (seed 002), its own example adapted to run:
a small transformers Qwen2 (float32, random init) learning to count (each
sequence a run of consecutive byte values from a random start), Muon on the
projection matrices, AdamW on the rest, a cosine schedule with warmup, the
seed's training loop. The one change to the seed's code: its name filter also
sends q/k/v's biases to Muon, which takes matrices only (a bias goes to AdamW).

Usage: python3 python/examples/seed_002.py [STEPS]
"""

import sys

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hypertrain.optim import get_hyper_optimizer
from hypertrain.lr_scheduler import get_hyper_lr_scheduler

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
torch.manual_seed(0)
model = Qwen2ForCausalLM(Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))

muon_params = []
adamw_params = []
for name, param in model.named_parameters():
    if not param.requires_grad:
        continue
    # the large projections go to Muon (their matrices: a bias is not one)
    if any(key in name for key in ["q_proj", "k_proj", "v_proj", "o_proj",
                                   "gate_proj", "up_proj", "down_proj"]) and param.ndim == 2:
        muon_params.append(param)
    else:
        # embedding, bias, norm and the rest to AdamW
        adamw_params.append(param)

optimizer = get_hyper_optimizer(
    model=model,
    muon_params=muon_params,
    adamw_params=adamw_params,
    muon_kwargs={"lr": 0.02, "momentum": 0.95},
    adamw_kwargs={"lr": 3e-4, "weight_decay": 0.1},
)
scheduler = get_hyper_lr_scheduler(
    optimizer=optimizer,
    scheduler_type="cosine",
    total_steps=steps,
    warmup_steps=steps // 10,
)

gen = torch.Generator().manual_seed(1)
starts = torch.randint(0, 256, (steps, 4, 1), generator=gen)
data = (starts + torch.arange(33)) % 256  # (steps, batch 4, 33 tokens)
for step, batch in enumerate(data):
    lrs = optimizer.param_groups[0]["lr"], optimizer.param_groups[-1]["lr"]  # this step's
    loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    print(f"step {step + 1:3d}/{steps} | loss {loss.item():.4f} | lr muon {lrs[0]:.3e}, adamw {lrs[1]:.3e}")
