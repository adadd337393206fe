#!/usr/bin/env python3
"""Two hypertrain run directories side by side: the training loss of every
step (metrics.jsonl) and every tensor of final/model.safetensors, as
max |a - b| / max |b| per tensor. Used by scripts/device-check.sh to set a
run on the GPU (kernels.backend=cuda) against the same run on the CPU.

    tools/compare_runs.py RUN_A RUN_B [--bound 1e-5]

Prints one line per step and the five worst tensors; with --bound, exits 1
when a tensor is further apart than the bound (0 otherwise). Reads the
safetensors format itself (an 8-byte header length, a JSON header, the
bytes), with torch for bf16 and f16."""
import argparse
import json
import struct
import sys

import torch

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64, "I32": torch.int32}


def tensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        lo, hi = meta["data_offsets"]
        buf = bytearray(data[8 + n + lo : 8 + n + hi])
        t = torch.frombuffer(buf, dtype=DTYPES[meta["dtype"]]) if hi > lo else torch.zeros(0)
        out[name] = t.reshape(meta["shape"]).double()
    return out


def losses(run):
    steps = {}
    with open(f"{run}/metrics.jsonl") as f:
        for line in f:
            m = json.loads(line)
            if "loss" in m and "step" in m:
                steps[m["step"]] = m["loss"]
    return steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--bound", type=float, default=None)
    args = ap.parse_args()
    la, lb = losses(args.a), losses(args.b)
    for s in sorted(set(la) & set(lb)):
        print(f"step {s}: loss {la[s]:.9f} vs {lb[s]:.9f}, {abs(la[s] - lb[s]):.3g} apart")
    ta, tb = tensors(f"{args.a}/final/model.safetensors"), tensors(f"{args.b}/final/model.safetensors")
    if set(ta) != set(tb):
        print(f"the tensors differ: {sorted(set(ta) ^ set(tb))[:5]}")
        return 1
    rel = {}
    for name in ta:
        den = tb[name].abs().max().item() if tb[name].numel() else 0.0
        num = (ta[name] - tb[name]).abs().max().item() if ta[name].numel() else 0.0
        rel[name] = num / den if den > 0 else num
    worst = sorted(rel.items(), key=lambda kv: -kv[1])
    for name, r in worst[:5]:
        print(f"tensor {name}: {r:.3g} apart (max |a - b| / max |b|)")
    print(f"{len(rel)} tensors, the worst {worst[0][1]:.3g} apart" + (f" (bound {args.bound:g})" if args.bound is not None else ""))
    if args.bound is not None and worst[0][1] > args.bound:
        print("FAIL: beyond the bound")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
