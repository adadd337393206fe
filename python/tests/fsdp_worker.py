"""One rank of test_fsdp.py (torchrun --nproc-per-node N, gloo): a small
model trained by hypertrain.optim's Muon + AdamW under PyTorch's
fully_shard, with the gradient norm clipped over the mesh, against the same
training in one process computed on this rank alone. Exits non-zero with
the worst tensor when a param parts by more than the bound."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from hypertrain import optim

STEPS, BATCH, MAX_NORM = 3, 12, 0.2
# the sharded bound (docs/NUMERICS.md, sharded runs against one process): the gradients' sums are taken in
# another order (each rank's batch, then the reduce-scatter), the updates are the same computation
BOUND = 1e-5


def model():
    torch.manual_seed(0)  # rows not divisible by 4 ranks: uneven shards (30 and 10 rows)
    return torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.Tanh(), torch.nn.Linear(30, 24), torch.nn.Tanh(),
                               torch.nn.Linear(24, 10))


def optimizer(m, strategy="allgather"):
    mats = [p for p in m.parameters() if p.ndim == 2]
    vecs = [p for p in m.parameters() if p.ndim < 2]
    return optim.get_hyper_optimizer(model=m, muon_params=mats, adamw_params=vecs,
                                     muon_kwargs={"lr": 0.02, "momentum": 0.95, "comm_strategy": strategy},
                                     adamw_kwargs={"lr": 3e-3, "weight_decay": 0.1})


def data(step):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 20, generator=gen), torch.randn(BATCH, 10, generator=gen)


def train_sharded(rank, per, ref_norms, strategy):
    m = model()
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(m)
    assert all(type(p).__name__ == "DTensor" for p in m.parameters())
    opt = optimizer(m, strategy)
    for step in range(STEPS):
        x, y = data(step)
        torch.nn.functional.mse_loss(m(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
        norm = optim.clip_grad_norm_(m.parameters(), MAX_NORM).item()
        if abs(norm - ref_norms[step]) > 1e-5 * ref_norms[step]:
            sys.exit(f"rank {rank}: step {step + 1}: grad norm {norm} over the mesh, one process {ref_norms[step]}")
        if ref_norms[step] <= MAX_NORM:
            sys.exit(f"step {step + 1}: the norm {ref_norms[step]} does not clip: the case tests less than it says")
        opt.step()
        opt.zero_grad()
    return m


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = model()
    ref_opt = optimizer(ref)
    ref_norms = []
    for step in range(STEPS):
        x, y = data(step)
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_norms.append(optim.clip_grad_norm_(ref.parameters(), MAX_NORM).item())
        ref_opt.step()
        ref_opt.zero_grad()

    per = BATCH // world
    m = train_sharded(rank, per, ref_norms, "allgather")
    # deredundancy: each matrix's owner orthogonalizes it and scatters the rows: the same bits
    d = train_sharded(rank, per, ref_norms, "deredundancy")
    owners = optim._owners([p for p in d.parameters() if p.ndim == 2])
    if len(set(owners.values())) != min(world, 3):  # 3 matrices over the ranks: balanced, not all on one
        sys.exit(f"rank {rank}: deredundancy's owners {sorted(owners.values())} on {world} ranks")
    for (name, p), q in zip(m.named_parameters(), d.parameters()):
        if not torch.equal(p.to_local(), q.to_local()):
            sys.exit(f"rank {rank}: {name}: Muon's deredundancy parts from allgather")
    worst = (0.0, "")
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        full = p.full_tensor()
        worst = max(worst, ((full - q.detach()).abs().max().item() / q.detach().abs().max().item(), name))
    if worst[0] > BOUND:
        sys.exit(f"rank {rank} of {world}: {worst[1]} parts from one process by {worst[0]:.3g} (bound {BOUND})")
    if rank == 0:
        print(f"fully_shard on {world} ranks: {STEPS} steps of Muon + AdamW within {worst[0]:.3g} of one process "
              f"({worst[1]} the farthest), grad norms over the mesh within 1e-5, deredundancy bitwise allgather")
    dist.barrier()  # no rank tears gloo down while another still talks to it (an abort at exit, 1 run in 3)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
