"""The C trainer from Python: hypertrain.train() runs a YAML config in this
process, as `hypertrain train CONFIG --set ...` does on one rank, and
hypertrain.load_checkpoint() reads a checkpoint's tensors by name. train()
needs no PyTorch.

The package carries the repository's configs (CONFIGS, a folder) and the
default corpus (CORPUS: the text files of Debian's fortunes, which
configs/default.yaml reads from /usr/share/games/fortunes), so train() with no
config runs the default model on them from any directory."""

import json
import math
import mmap
import os
import struct
from pathlib import Path

from . import _C

CONFIGS = Path(__file__).resolve().parent / "configs"
CORPUS = Path(__file__).resolve().parent / "data" / "fortunes"
LOG_LEVELS = ("debug", "info", "warning", "error")  # the engine's log sink's levels (HT_LOG_DEBUG ..)


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


def _level(log_level, quiet):
    """The engine's log level (0 debug .. 3 error) for log_level and quiet; None: as it is (info)."""
    if quiet and log_level not in (None, "warning"):
        raise ValueError(f"hypertrain.train: quiet=True is log_level='warning'; log_level={log_level!r} says "
                         "otherwise: give one of them")
    if quiet:
        log_level = "warning"
    if log_level is None:
        return None
    if log_level not in LOG_LEVELS:
        raise ValueError(f"hypertrain.train: log_level {log_level!r}; expected one of {', '.join(LOG_LEVELS)}")
    return LOG_LEVELS.index(log_level)


def train(config=None, overrides=None, *, log_level=None, quiet=False):
    """Runs the trainer on `config` (a YAML file's path; None: the package's
    configs/default.yaml on the package's corpus, CORPUS, unless the
    overrides set data.path) with `overrides` ({"section.key": value} or
    ["section.key=value", ...], as --set) in this process, one rank, the GIL
    released while it runs; SIGINT or SIGTERM asks it to stop at the next
    step, saving a checkpoint (a second one ends the process). The engine
    logs to stderr: log_level "debug", "info" (the default: the config, the
    model, the memory plan, every step), "warning" or "error" for this call;
    quiet=True is "warning" (warnings and errors only). Several ranks:
    `mpirun -n N hypertrain train` (the CLI). A bad config raises ValueError,
    a failed run RuntimeError, with the engine's sentence; a stopped run
    raises KeyboardInterrupt once its checkpoint is saved. Returns a
    TrainResult."""
    level = _level(log_level, quiet)
    if isinstance(overrides, dict):
        sets = [f"{k}={_yaml_value(v)}" for k, v in overrides.items()]
    else:
        sets = [str(s) for s in (overrides or [])]
    if config is None:
        config = CONFIGS / "default.yaml"
        if not config.is_file():
            raise FileNotFoundError(f"hypertrain.train: this install has no packaged configs ({CONFIGS}): give a "
                                    "config path (the repository's configs/default.yaml)")
        if not any(s.split("=", 1)[0].strip() == "data.path" for s in sets):
            if not CORPUS.is_dir():
                raise FileNotFoundError(f"hypertrain.train: this install has no packaged corpus ({CORPUS}): set "
                                        "data.path (a text file or folder)")
            sets.insert(0, f"data.path={CORPUS}")
    path = os.fsdecode(os.fspath(config))
    if "\0" in path:  # the C side reads C strings: a NUL would end it there, silently
        raise ValueError(f"hypertrain.train: the config path {path!r} holds a NUL character")
    for s in sets:
        if "\0" in s:
            raise ValueError(f"hypertrain.train: the override {s!r} holds a NUL character (the engine would read "
                             "it only up to there)")
    output_dir, stopped_by = _C.train(path, sets, -1 if level is None else level)
    out = Path(output_dir)
    metrics = []
    if (out / "metrics.jsonl").exists():
        with open(out / "metrics.jsonl") as f:
            metrics = [json.loads(line) for line in f if line.strip()]
    latest = _follow_latest(out) if (out / "latest").exists() else None
    result = TrainResult(output_dir=str(out), metrics=metrics,
                         final=next((m for m in reversed(metrics) if "loss" in m), None), stopped_by=stopped_by,
                         latest=str(latest) if latest is not None else None)
    if stopped_by and not any("loss" in m for m in metrics):
        raise KeyboardInterrupt(f"hypertrain.train: stopped by signal {stopped_by} before step 1: nothing was "
                                "trained and no checkpoint saved; the same call starts the run")
    if stopped_by and result.latest is None:
        raise KeyboardInterrupt(f"hypertrain.train: stopped by signal {stopped_by} at step {result.final['step']} "
                                "without a checkpoint (checkpoint.save_interval is 0): the steps of this run are lost")
    if stopped_by:
        raise KeyboardInterrupt(f"hypertrain.train: stopped by signal {stopped_by} after saving a checkpoint "
                                f"({result.latest}); the same call resumes it with checkpoint.restore_from=latest")
    return result


# safetensors' dtype names -> torch's and numpy's, and their sizes in bytes
_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "I32": "int32", "I64": "int64",
              "U16": "uint16", "U8": "uint8"}
_ST_SIZES = {"F32": 4, "BF16": 2, "F16": 2, "I32": 4, "I64": 8, "U16": 2, "U8": 1}
_ST_MAX_HEADER = 100_000_000  # the reference implementation's limit, and the engine's (ckpt.h HT_ST_MAX_HEADER)
_ST_MAX_DIMS = 8  # ckpt.h HT_ST_MAX_DIMS
_LATEST_MAX = 4096  # one checkpoint name (src/ckpt/open.c, ht_ckpt_resolve)


def _follow_latest(folder):
    """The checkpoint directory folder/latest names: a direct child of folder (one name: no '/', not '.' or
    '..', no control characters; a symlink only to another child of folder), as the engine resolves it."""
    latest = folder / "latest"
    with open(latest, "rb") as f:
        raw = f.read(_LATEST_MAX + 1)
    if len(raw) > _LATEST_MAX:
        raise OSError(f"hypertrain.load_checkpoint: {latest} is over {_LATEST_MAX} bytes; it holds one "
                      "checkpoint name")
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        name = None
    if not name or name in (".", "..") or "/" in name or not name.isprintable():
        raise OSError(f"hypertrain.load_checkpoint: {latest} holds {raw[:100]!r}, not the name of a checkpoint "
                      f"directory in {folder}")
    target = folder / name
    if not target.is_dir():
        raise OSError(f"hypertrain.load_checkpoint: {latest} names {name!r}, but {target} is not a directory")
    if target.resolve().parent != folder.resolve():
        raise OSError(f"hypertrain.load_checkpoint: {latest} names {name!r}, a link to {target.resolve()}, outside "
                      f"{folder}")
    return target


def _convert(t, as_numpy):
    if not as_numpy:
        return t
    import torch
    return (t.to(torch.float32) if t.dtype == torch.bfloat16 else t).numpy()


class _Twice(ValueError):
    """A JSON object with a key twice (json keeps the last; the engine's reader refuses it)."""


def _unique_keys(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise _Twice(k)
        out[k] = v
    return out


def _whole_number(x):
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _safetensors_header(path, m):
    """A safetensors file's tensors as {name: (dtype, shape, begin, end)}, the header checked as the engine's
    reader checks it (src/ckpt/safetensors.c): its length against the file, JSON, each entry's dtype, shape
    and data offsets (their bytes the shape's), the offsets tiling the data exactly. Each error names the
    file (and the tensor) and what is wrong."""
    def bad(what):
        return OSError(f"hypertrain.load_checkpoint: {path}: {what}")

    if len(m) < 8:
        raise bad(f"{len(m)} bytes, too short for the 8-byte header length (truncated?)")
    (n,) = struct.unpack("<Q", m[:8])
    if n > _ST_MAX_HEADER:
        raise bad(f"header length {n} exceeds the {_ST_MAX_HEADER}-byte limit (not a safetensors file?)")
    if n > len(m) - 8:
        raise bad(f"header length {n} is larger than the {len(m) - 8} bytes after it (truncated?)")
    try:
        header = json.loads(m[8:8 + n].decode("utf-8"), object_pairs_hook=_unique_keys)
    except _Twice as e:
        raise bad(f"the header names {e.args[0]!r} twice") from None
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError among them
        raise bad(f"the header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    tensors, spans = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise bad('"__metadata__" is not an object of strings')
            continue
        if not isinstance(info, dict):
            raise bad(f"tensor {name!r}: its header entry is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in _ST_DTYPES:
            raise bad(f"tensor {name!r}: dtype {dtype!r} (supported: {', '.join(_ST_DTYPES)})")
        if not isinstance(shape, list) or len(shape) > _ST_MAX_DIMS or not all(_whole_number(d) for d in shape):
            raise bad(f"tensor {name!r}: shape {shape!r}; expected at most {_ST_MAX_DIMS} whole numbers")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_whole_number(o) for o in offsets):
            raise bad(f"tensor {name!r}: data_offsets {offsets!r}; expected [begin, end], whole numbers")
        begin, end = offsets
        need = math.prod(shape) * _ST_SIZES[dtype]
        if end < begin or end - begin != need:
            raise bad(f"tensor {name!r}: data_offsets [{begin}, {end}] hold {end - begin} bytes, but shape "
                      f"{shape} of {dtype} needs {need}")
        tensors[name] = (dtype, shape, begin, end)
        spans.append((begin, end, name))
    at, data = 0, len(m) - 8 - n
    for begin, end, name in sorted(spans):
        if begin != at:
            raise bad(f"tensor {name!r} starts at data offset {begin}, where {at} was expected (data overlapping "
                      "or not contiguous)")
        at = end
    if at != data:
        raise bad(f"the tensors cover {at} bytes of data, but the file holds {data} (truncated, or a damaged "
                  "header?)")
    return tensors


def _read_safetensors(path, as_numpy):
    """A Hugging Face safetensors file's tensors (copied out of the file's map), its header checked first."""
    import torch
    out = {}
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < 8:  # mmap refuses an empty file; the check says what is wrong
            _safetensors_header(path, f.read())
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            tensors = _safetensors_header(path, m)
            base = 8 + struct.unpack("<Q", m[:8])[0]
            for name, (dtype, shape, a, b) in tensors.items():
                dt = getattr(torch, _ST_DTYPES[dtype])
                t = torch.frombuffer(bytearray(m[base + a:base + b]), dtype=dt) if b > a else torch.empty(0, dtype=dt)
                out[name] = _convert(t.reshape(shape), as_numpy)
    return out


def load_checkpoint(path, as_numpy=False, keys=None):
    """The tensors of a checkpoint by name: a hypertrain checkpoint directory
    (output_dir/step_X, or output_dir itself for its latest: every file's hash
    checked, the shards of any layout put together into each key's global
    shape, in its saved dtype: the weights under "model." + their Hugging
    Face names, the FP32 main params under
    "_mixed_precision_optimizer.fp32_from_fp16_params.", the optimizer state
    under "optimizer.") or a Hugging Face model directory (the run's `final`:
    model.safetensors, sharded or not, by the Hugging Face names; each file's header checked as the
    engine's reader checks it, OSError naming the file and what is wrong). A folder's `latest` must
    name a checkpoint directory inside it. keys: the names to read (all
    by default). torch tensors, or numpy arrays with as_numpy (bf16 as
    float32: numpy has no bf16). A hypertrain checkpoint's dict has its step
    in .step."""
    import torch
    p = Path(path)
    if (p / "latest").exists() and not (p / "metadata.json").exists():
        p = _follow_latest(p)
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
