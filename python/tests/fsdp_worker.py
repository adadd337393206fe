"""One rank of test_fsdp.py (torchrun --nproc-per-node N, gloo): a small
model trained by hypertrain.optim's Muon + AdamW under PyTorch's
fully_shard, with the gradient norm clipped over the mesh, against the same
training in one process computed on this rank alone; the same with the FP32
main-param wrapper on a bf16 model, and its state dict resumed; the gradient
scaling factor. Exits non-zero with the worst tensor when a param parts by
more than the bound."""

import io
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from hypertrain import optim
from hypertrain.mixed_precision import KEY

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


def train_sharded(rank, per, ref_norms, strategy, mesh=None):
    m = model()
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
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


def check_state_layout(rank, world, per):
    """A state tensor that is not this rank's rows (here the whole matrix, as a state dict of one process would
    hold it) is refused at the step on every rank, naming the param and the key, before any param is written
    or any collective starts."""
    for key, kind in (("momentum_buffer", 0), ("exp_avg", 1)):
        m = model()
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(m)
        opt = optimizer(m)
        x, y = data(0)
        for _ in range(2):
            torch.nn.functional.mse_loss(m(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
            if _ == 0:
                opt.step()
        name, p = next((n, q) for n, q in m.named_parameters() if (q.ndim == 2) == (kind == 0))
        opt.optimizers[kind].state[p][key] = torch.zeros(p.shape)  # the whole matrix's shape, not this rank's rows
        before = [q.to_local().clone() for q in m.parameters()]
        try:
            opt.step()
            sys.exit(f"rank {rank}: {name}'s whole-matrix {key} was accepted by a sharded step")
        except ValueError as e:
            if f"({name})'s state '{key}'" not in str(e):
                sys.exit(f"rank {rank}: the error does not name {name} and {key}: {e}")
        if any(not torch.equal(q.to_local(), b) for q, b in zip(m.parameters(), before)):
            sys.exit(f"rank {rank}: a refused step wrote a param")
    if rank == 0:
        print(f"state layout on {world} ranks: a whole-matrix state in a sharded optimizer refused at the step")


def fsdp_modules(m):
    return [mod for mod in m.modules() if isinstance(mod, FSDPModule)]


def sharded_grads(m, x, y, factor=None, set_factor=True):
    """The local gradients of one backward, with every fully_shard module's gradient scaling factor set."""
    if set_factor:
        for mod in fsdp_modules(m):
            mod.set_gradient_scaling_factor(factor)
    torch.nn.functional.mse_loss(m(x), y).backward()
    grads = [p.grad.to_local().clone() for p in m.parameters()]
    for p in m.parameters():
        p.grad = None
    return grads


def check_scaling(rank, world, per):
    """set_gradient_scaling_factor: the reduced gradients times the factor (the same bits as multiplying the
    unscaled ones), None back to them, after an all-reduce hook already set, and under HSDP on 4 ranks."""
    meshes = [None]
    if world == 4:
        meshes.append(init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    x, y = data(0)
    x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    for mesh in meshes:
        m = model()
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        base = sharded_grads(m, x, y, set_factor=False)
        for factor in (0.5, 3.0, torch.tensor(0.25)):
            for g, b in zip(sharded_grads(m, x, y, factor), base):
                if not torch.equal(g, b * factor):
                    sys.exit(f"rank {rank}: gradient scaling factor {factor}: not the reduced gradients times it")
        if any(not torch.equal(g, b) for g, b in zip(sharded_grads(m, x, y, None), base)):
            sys.exit(f"rank {rank}: gradient scaling factor None: not the unscaled gradients")
        m[0].set_all_reduce_hook(lambda t: t.add_(1.0))  # a hook of the user's: it runs, then the scaling
        for g, b in zip(sharded_grads(m, x, y, 0.5)[:2], base[:2]):
            if not torch.equal(g, (b + 1.0) * 0.5):
                sys.exit(f"rank {rank}: gradient scaling after an all-reduce hook: not (grad + 1) * 0.5")
        m[0].set_all_reduce_hook(lambda t: None)
    for bad in (True, "0.5", torch.ones(2)):
        try:
            m.set_gradient_scaling_factor(bad)
            sys.exit(f"rank {rank}: set_gradient_scaling_factor({bad!r}) was accepted")
        except ValueError:
            pass
    m.set_gradient_scaling_factor(scale_factor=0.5)  # the seed's keyword
    if rank == 0:
        print(f"gradient scaling factor on {world} ranks{' (and HSDP 2 x 2)' if world == 4 else ''}: "
              "the reduced gradients times it, bitwise")


def fp32_optimizer(m):
    mats = [p for p in m.parameters() if p.ndim == 2]
    vecs = [p for p in m.parameters() if p.ndim < 2]
    return optim.get_hyper_optimizer(model=m, muon_params=mats, adamw_params=vecs, fp32_main_params=True,
                                     muon_kwargs={"lr": 0.02, "momentum": 0.95},
                                     adamw_kwargs={"lr": 3e-3, "weight_decay": 0.1})


def relative(a, b):
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


def check_fp32_main_params(rank, world, per):
    """The FP32 main-param wrapper on a bf16 model under fully_shard, against one process that runs each
    rank's rows as a micro-batch of its own (the same bf16 computations, their FP32 sum in another order)."""
    ref = model().to(torch.bfloat16)
    ref_opt = fp32_optimizer(ref)
    m = model().to(torch.bfloat16)
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(m)
    opt = fp32_optimizer(m)
    worst = {}
    for step in range(STEPS):
        x, y = (t.to(torch.bfloat16) for t in data(step))
        for r in range(world):
            torch.nn.functional.mse_loss(ref(x[r * per:(r + 1) * per]), y[r * per:(r + 1) * per]).backward()
        for p in ref.parameters():
            p.main_grad.div_(world)  # FSDP2's average over the ranks
        torch.nn.functional.mse_loss(m(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
        for (name, p), q in zip(m.named_parameters(), ref.parameters()):
            g = p.main_grad
            if p.grad is not g or type(g).__name__ != "DTensor" or g.dtype != torch.float32 or \
                    g.placements != p.placements:
                sys.exit(f"rank {rank}: {name}: grad {type(p.grad)}, main_grad {type(g).__name__} {g.dtype}: "
                         "expected an FP32 DTensor grad of the param's placements, the main_grad")
            worst.setdefault(f"main_grad {step + 1}", []).append((relative(g.full_tensor(), q.main_grad), name))
        norm = optim.clip_grad_norm_(m.parameters(), MAX_NORM).item()
        ref_norm = optim.clip_grad_norm_(ref.parameters(), MAX_NORM).item()
        worst.setdefault(f"grad norm {step + 1}", []).append((abs(norm - ref_norm) / ref_norm, ""))
        opt.step()
        ref_opt.step()
        for (name, p), q in zip(m.named_parameters(), ref.parameters()):
            if not torch.equal(p.to_local(), p.main_param.to_local().to(torch.bfloat16)):
                sys.exit(f"rank {rank}: step {step + 1}: {name}: the bf16 param is not its main param rounded")
            worst.setdefault(f"main_param {step + 1}", []).append(
                (relative(p.main_param.full_tensor(), q.main_param), name))
        opt.zero_grad()
        ref_opt.zero_grad()
    worst = {k: max(v) for k, v in worst.items()}
    for what, (err, name) in worst.items():  # NUMERICS.md's sharded bounds: 1e-6 for a first main_grad
        bound = 1e-6 if what == "main_grad 1" else BOUND
        if err > bound:
            sys.exit(f"rank {rank} of {world}: fp32 main params: {what} {name} parts from one process by "
                     f"{err:.3g} (bound {bound})")
    return m, opt, worst


def check_fp32_resume(rank, world, per, m, opt):
    """The wrapper's state dict under fully_shard: loaded into a fresh sharded model (main params as
    DTensors, or gathered whole as one process would save them), the next step is the same bits."""
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)  # as to disk: each resume its own copy (torch's load keeps the tensors)

    def saved():
        buf.seek(0)
        return torch.load(buf, weights_only=False)

    runs = []
    for layout in ("sharded", "whole", None):
        n = model().to(torch.bfloat16)
        for layer in n:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(n)
        n.load_state_dict(m.state_dict())
        o = fp32_optimizer(n)
        if layout is not None:
            sd = saved()
            if layout == "whole":  # the main params gathered, as one process would save them
                sd[KEY]["fp32_from_fp16_params"] = {k: v.full_tensor() for k, v in
                                                    sd[KEY]["fp32_from_fp16_params"].items()}
            o.load_state_dict(sd)
        runs.append((n, o))
    runs.append((m, opt))
    x, y = (t.to(torch.bfloat16) for t in data(STEPS))
    for n, o in runs:
        torch.nn.functional.mse_loss(n(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
        o.step()
        o.zero_grad()
    for (name, p), a, b in zip(m.named_parameters(), runs[0][0].parameters(), runs[1][0].parameters()):
        if not torch.equal(a.main_param.to_local(), p.main_param.to_local()) or \
                not torch.equal(b.main_param.to_local(), p.main_param.to_local()):
            sys.exit(f"rank {rank}: {name}: a resumed sharded wrapper parts from the run that went on")
    fresh = runs[2][0]
    if all(torch.equal(a.main_param.to_local(), p.main_param.to_local())
           for p, a in zip(m.parameters(), fresh.parameters())):
        sys.exit(f"rank {rank}: the wrapper without its optimizer state matches too: the resume check is blind")


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per = BATCH // world
    check_scaling(rank, world, per)
    check_state_layout(rank, world, per)
    mp, mp_opt, mp_worst = check_fp32_main_params(rank, world, per)
    check_fp32_resume(rank, world, per, mp, mp_opt)
    if rank == 0:
        print("fp32 main params under fully_shard, farthest from one process:",
              ", ".join(f"{k} {v[0]:.3g} {v[1]}" for k, v in mp_worst.items()))
    ref = model()
    ref_opt = optimizer(ref)
    ref_norms = []
    for step in range(STEPS):
        x, y = data(step)
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_norms.append(optim.clip_grad_norm_(ref.parameters(), MAX_NORM).item())
        ref_opt.step()
        ref_opt.zero_grad()

    meshes = [("", None)]
    if world == 4:
        meshes.append((" (HSDP 2 x 2)", init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))))
    for label, mesh in meshes:
        shards = world if mesh is None else mesh.size(1)
        m = train_sharded(rank, per, ref_norms, "allgather", mesh)
        # deredundancy: each matrix's owner (in each replica) orthogonalizes it and scatters the rows: the same bits
        d = train_sharded(rank, per, ref_norms, "deredundancy", mesh)
        owners = optim._owners([p for p in d.parameters() if p.ndim == 2])
        if len(set(owners.values())) != min(shards, 3):  # 3 matrices over the shard ranks: balanced, not on one
            sys.exit(f"rank {rank}{label}: deredundancy's owners {sorted(owners.values())} over {shards} shards")
        for (name, p), q in zip(m.named_parameters(), d.parameters()):
            if not torch.equal(p.to_local(), q.to_local()):
                sys.exit(f"rank {rank}{label}: {name}: Muon's deredundancy parts from allgather")
        worst = (0.0, "")
        for (name, p), q in zip(m.named_parameters(), ref.parameters()):
            full = p.full_tensor()
            worst = max(worst, ((full - q.detach()).abs().max().item() / q.detach().abs().max().item(), name))
        if worst[0] > BOUND:
            sys.exit(f"rank {rank} of {world}{label}: {worst[1]} parts from one process by {worst[0]:.3g} "
                     f"(bound {BOUND})")
        if rank == 0:
            print(f"fully_shard on {world} ranks{label}: {STEPS} steps of Muon + AdamW within {worst[0]:.3g} of one "
                  f"process ({worst[1]} the farthest), grad norms over the mesh within 1e-5, deredundancy bitwise "
                  "allgather")
    dist.barrier()  # no rank tears gloo down while another still talks to it (an abort at exit, 1 run in 3)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Every check has passed and been printed: leave without the interpreter's teardown, where a gloo thread
    # still joinable aborts the process now and then ("terminate called without an active exception", exit -6)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
