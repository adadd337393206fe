"""One rank of test_dcp.py (torchrun, gloo): the FP32 main-param wrapper around
get_hyper_optimizer's Muon + AdamW on a bf16 model under fully_shard, saved
with torch's distributed checkpoint (dcp.save of get_model_state_dict and
get_optimizer_state_dict) and loaded with set_model_state_dict and
set_optimizer_state_dict on another number of ranks.

    dcp_worker.py save DIR   (4 ranks) train, save DIR/dcp and each rank's plain
                             state_dict(), go on; resume on 4 ranks from both
                             (bitwise the run that went on); measure the floor
    dcp_worker.py load DIR   (2 or 1 ranks; on 1 also without fully_shard) load
                             DIR/dcp: the state bitwise the saved one, then go on
                             within the floor rule of the run that went on

Every run takes the batch as micro-batches of the saving run's rows a rank,
so the bf16 forward and backward are the same computations on any number of
ranks. The floor rule (docs/NUMERICS.md, "Sharded runs against one
process"): the resumed run sums the micro-batches' FP32 gradients over
another number of ranks, in another order, and the optimizer carries that
forward: each main param within max(1e-5, 2 x its
floor) of the run that went on, the floor the largest distance six 4-rank
resumes from the same checkpoint reach with every gradient multiplied by
1 +- 2^-23, 2^-22, 2^-21 (rounding noise alone); each loss the same way.
Exits non-zero naming the worst tensor."""

import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard

from fsdp_worker import BATCH, MAX_NORM, data, fp32_optimizer, model, relative
from hypertrain import optim

TRAINED, GO_ON = 3, 3  # steps before the checkpoint, and after it
SAVED_WORLD = 4
FACTORS = [1 + s * 2.0 ** -e for e in (23, 22, 21) for s in (1, -1)]
BOUND = 1e-5


def build(shard=True):
    m = model().to(torch.bfloat16)
    if shard:
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(m)
    return m, fp32_optimizer(m)


def full(t):
    """A copy of the whole tensor (on a 1-rank mesh full_tensor() is the live shard itself)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t.detach()).clone()


def step(m, opt, at, rank, world, factor=None):
    """One step on this rank's rows of batch `at`, as micro-batches of the saving run's rows a rank (so every
    world size runs the same bf16 computations, and only the FP32 sums of the gradients take another order);
    the loss: the mean of the micro-batches' means over all ranks."""
    per, micro = BATCH // world, BATCH // SAVED_WORLD
    x, y = (t.to(torch.bfloat16) for t in data(at))
    loss = torch.zeros(1)
    for lo in range(rank * per, (rank + 1) * per, micro):
        part = torch.nn.functional.mse_loss(m(x[lo:lo + micro]).float(), y[lo:lo + micro].float()) / (per // micro)
        part.backward()
        loss += part.detach()
    if factor is not None:  # the floor runs: every gradient times 1 +- 2^-k
        for p in m.parameters():
            p.grad.mul_(factor)
    optim.clip_grad_norm_(m.parameters(), MAX_NORM)
    opt.step()
    opt.zero_grad()
    if world > 1:
        dist.all_reduce(loss)
    return loss.item() / world


def go_on(m, opt, rank, world, factor=None):
    """GO_ON steps from the checkpoint: the loss and every main param (whole) after each."""
    losses, mains = [], []
    for i in range(GO_ON):
        losses.append(step(m, opt, TRAINED + i, rank, world, factor))
        mains.append({n: full(p.main_param) for n, p in m.named_parameters()})
    return losses, mains


def state_of(m, opt):
    """The optimizer's state (main params, moments, step counts) and the model params, whole."""
    out = {f"model {n}": full(p) for n, p in m.named_parameters()}
    for n, p in m.named_parameters():
        for key, v in opt.state[p].items():
            out[f"{n} {key}"] = full(v)
    return out


def save_dcp(m, opt, path):
    dcp.save({"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}, checkpoint_id=path)


def load_dcp(m, opt, path):
    """torch's resume: a fresh model's and optimizer's state dicts as the layout, dcp.load into them, set."""
    sd = {"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(m, sd["model"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # main params refreshed from the model would warn
        set_optimizer_state_dict(m, opt, sd["optim"])


def distances(run, ref):
    """Per step: the losses' relative distance, and each main param's (max |a - b| / max |b|)."""
    return [(abs(a - b) / abs(b), {n: relative(ma[n], mb[n]) for n in mb})
            for a, b, ma, mb in zip(run[0], ref[0], run[1], ref[1])]


def save(root, rank, world):
    if world != SAVED_WORLD:
        sys.exit(f"dcp_worker.py save: run on {SAVED_WORLD} ranks, not {world}")
    m, opt = build()
    for at in range(TRAINED):
        step(m, opt, at, rank, world)
    save_dcp(m, opt, root / "dcp")
    torch.save({"model": m.state_dict(), "optim": opt.state_dict()}, root / f"plain-{rank}.pt")
    saved = state_of(m, opt)
    went_on = go_on(m, opt, rank, world)
    if rank == 0:
        torch.save(saved, root / "saved_state.pt")
        torch.save(went_on, root / "went_on.pt")
    for how in ("dcp", "plain"):  # the same mesh: the same computation, bit for bit
        n, o = build()
        if how == "dcp":
            load_dcp(n, o, root / "dcp")
        else:
            plain = torch.load(root / f"plain-{rank}.pt", weights_only=False)
            n.load_state_dict(plain["model"])
            o.load_state_dict(plain["optim"])
        again = go_on(n, o, rank, world)
        if again[0] != went_on[0] or any(not torch.equal(a[k], b[k]) for a, b in zip(again[1], went_on[1])
                                         for k in b):
            sys.exit(f"rank {rank}: resumed on {world} ranks from the {how} checkpoint: not the bits of the run "
                     "that went on")
    floor = None
    for factor in FACTORS:
        n, o = build()
        load_dcp(n, o, root / "dcp")
        d = distances(go_on(n, o, rank, world, factor), went_on)
        floor = d if floor is None else [(max(a[0], b[0]), {k: max(a[1][k], b[1][k]) for k in a[1]})
                                         for a, b in zip(floor, d)]
    if rank == 0:
        torch.save(floor, root / "floor.pt")
        worst = max((v, k) for _, per in floor for k, v in per.items())
        print(f"saved on {world} ranks: resumed there from DCP and from the plain state_dict bitwise; floor "
              f"{worst[0]:.3g} ({worst[1]}), losses {max(f[0] for f in floor):.3g}")


def load(root, rank, world):
    saved = torch.load(root / "saved_state.pt")
    went_on = torch.load(root / "went_on.pt")
    floor = torch.load(root / "floor.pt")
    bounds, running = [], (0.0, {})
    for f in floor:  # the floor up to each step
        running = (max(running[0], f[0]), {k: max(running[1].get(k, 0.0), v) for k, v in f[1].items()})
        bounds.append((max(BOUND, 2 * running[0]), {k: max(BOUND, 2 * v) for k, v in running[1].items()}))
    layouts = [("fully_shard", True)] + ([("no fully_shard", False)] if world == 1 else [])
    for label, shard in layouts:
        m, opt = build(shard)
        load_dcp(m, opt, root / "dcp")
        got = state_of(m, opt)
        if sorted(got) != sorted(saved):
            sys.exit(f"rank {rank} ({label}): loaded state keys {sorted(set(got) ^ set(saved))} differ")
        for key, t in saved.items():
            if not torch.equal(got[key], t):
                sys.exit(f"rank {rank} ({label}): {key} loaded on {world} ranks is not the saved one "
                         f"(by {relative(got[key].float(), t.float()):.3g})")
        worst_loss, worst_main = (0.0, ""), (0.0, "")
        for i, (loss, mains) in enumerate(distances(go_on(m, opt, rank, world), went_on)):
            b_loss, b_main = bounds[i]
            worst_loss = max(worst_loss, (loss / b_loss, f"loss {i + 1}: {loss:.3g} of {b_loss:.3g}"))
            for k, v in mains.items():
                worst_main = max(worst_main, (v / b_main[k], f"{k} after step {i + 1}: {v:.3g} of {b_main[k]:.3g}"))
        for worst in (worst_loss, worst_main):
            if worst[0] > 1.0:
                sys.exit(f"rank {rank} ({label}): resumed on {world} ranks, parts from the run that went on: "
                         f"{worst[1]}")
        blind, o = build(shard)  # the model alone, its optimizer fresh: must part, else the check is blind
        sd = {"model": get_model_state_dict(blind)}
        dcp.load(sd, checkpoint_id=root / "dcp")
        set_model_state_dict(blind, sd["model"])
        o.reload_model_params()
        far = max(v / bounds[i][1][k] for i, (_, mains) in enumerate(distances(go_on(blind, o, rank, world),
                                                                                went_on))
                  for k, v in mains.items())
        if far <= 1.0:
            sys.exit(f"rank {rank} ({label}): a fresh optimizer goes on within the bound too: the check is blind")
        if rank == 0:
            print(f"loaded on {world} ranks ({label}): the state bitwise the saved one; {GO_ON} steps on, against "
                  f"the floor rule's bounds: worst main param {worst_main[1] or '0'}, worst {worst_loss[1]}")


def main():
    mode, root = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    (save if mode == "save" else load)(root, rank, world)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Every check has passed and been printed: leave without the interpreter's teardown, where a gloo thread
    # still joinable aborts the process now and then ("terminate called without an active exception", exit -6)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
