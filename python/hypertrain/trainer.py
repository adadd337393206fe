"""The C trainer from Python: hypertrain.train() runs a YAML config in this
process, as `hypertrain train CONFIG --set ...` does on one rank, and
hypertrain.load_checkpoint() reads a checkpoint's tensors by name."""

import json
import mmap
import os
import struct
from pathlib import Path

from . import _C


def _yaml_value(v):
    """A Python value as the YAML scalar or flow sequence a --set override takes."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_yaml_value(x) for x in v) + "]"
    return str(v)


class TrainResult(dict):
    """What train() returns: output_dir, metrics (metrics.jsonl's records, one
    a step or evaluation, in order), final (the last record with a training
    loss), stopped_by (the signal that stopped the run after its checkpoint,
    else 0), and latest (the newest checkpoint's directory, or None)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def train(config, overrides=None):
    """Runs the trainer on `config` (a YAML file's path) with `overrides`
    ({"section.key": value} or ["section.key=value", ...], as --set) in this
    process, one rank, the GIL released while it runs; SIGINT or SIGTERM asks
    it to stop at the next step, saving a checkpoint (a second one ends the
    process). Several ranks: `mpirun -n N hypertrain train` (the CLI). A bad
    config raises ValueError, a failed run RuntimeError, with the engine's
    sentence; a stopped run raises KeyboardInterrupt once its checkpoint is
    saved. Returns a TrainResult."""
    if isinstance(overrides, dict):
        sets = [f"{k}={_yaml_value(v)}" for k, v in overrides.items()]
    else:
        sets = [str(s) for s in (overrides or [])]
    output_dir, stopped_by = _C.train(os.fspath(config), sets)
    out = Path(output_dir)
    metrics = []
    if (out / "metrics.jsonl").exists():
        with open(out / "metrics.jsonl") as f:
            metrics = [json.loads(line) for line in f if line.strip()]
    latest = out / "latest"
    result = TrainResult(output_dir=str(out), metrics=metrics,
                         final=next((m for m in reversed(metrics) if "loss" in m), None), stopped_by=stopped_by,
                         latest=str(out / latest.read_text().strip()) if latest.exists() else None)
    if stopped_by:
        raise KeyboardInterrupt(f"hypertrain.train: stopped by signal {stopped_by} after saving a checkpoint "
                                f"({result.latest}); the same call resumes it with checkpoint.restore_from=latest")
    return result


# safetensors' dtype names -> torch's and numpy's
_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "I32": "int32", "I64": "int64",
              "U16": "uint16", "U8": "uint8"}


def _convert(t, as_numpy):
    if not as_numpy:
        return t
    import torch
    return (t.to(torch.float32) if t.dtype == torch.bfloat16 else t).numpy()


def _read_safetensors(path, as_numpy):
    """A Hugging Face safetensors file's tensors (copied out of the file's map)."""
    import torch
    out = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        (n,) = struct.unpack("<Q", m[:8])
        header = json.loads(m[8:8 + n])
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = getattr(torch, _ST_DTYPES[info["dtype"]])
            a, b = info["data_offsets"]
            t = torch.frombuffer(bytearray(m[8 + n + a:8 + n + b]), dtype=dtype) if b > a else torch.empty(
                0, dtype=dtype)
            out[name] = _convert(t.reshape(info["shape"]), as_numpy)
    return out


def load_checkpoint(path, as_numpy=False, keys=None):
    """The tensors of a checkpoint by name: a hypertrain checkpoint directory
    (output_dir/step_X, or output_dir itself for its latest: every file's hash
    checked, the shards of any layout put together into each key's global
    shape, in its saved dtype: the weights under "model." + their Hugging
    Face names, the FP32 main params under
    "_mixed_precision_optimizer.fp32_from_fp16_params.", the optimizer state
    under "optimizer.") or a Hugging Face model directory (the run's `final`:
    model.safetensors, sharded or not, by the Hugging Face names). keys: the names to read (all
    by default). torch tensors, or numpy arrays with as_numpy (bf16 as
    float32: numpy has no bf16). A hypertrain checkpoint's dict has its step
    in .step."""
    import torch
    p = Path(path)
    if (p / "latest").exists() and not (p / "metadata.json").exists():
        p = p / (p / "latest").read_text().strip()
    if not (p / "metadata.json").exists():
        files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
        if not files:
            raise FileNotFoundError(f"hypertrain.load_checkpoint: {path} holds no metadata.json (a hypertrain "
                                    "checkpoint) and no .safetensors file")
        out = {}
        for f in files:
            out.update(_read_safetensors(f, as_numpy))
        return out if keys is None else {k: out[k] for k in keys}
    ck = _C.ckpt_open(str(p))
    listed, step = _C.ckpt_keys(ck)
    wanted = None if keys is None else set(keys)
    if wanted is not None:
        missing = wanted - {name for name, _, _ in listed}
        if missing:
            raise KeyError(f"hypertrain.load_checkpoint: {p} has no key(s) {', '.join(sorted(missing))}")
    out = _Tensors()
    out.step = step
    for name, dtype, shape in listed:
        if wanted is not None and name not in wanted:
            continue
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        _C.ckpt_read(ck, name, t.data_ptr() if t.numel() else None, dtype)
        out[name] = _convert(t, as_numpy)
    return out


class _Tensors(dict):
    """A checkpoint's tensors by name, with the step it was saved at (.step)."""
    step = None
