"""hypertrain.train() and hypertrain.load_checkpoint(), and the chained
optimizer against the C trainer: a transformers Qwen2 trained by
get_hyper_optimizer in PyTorch, and the same model, data and optimizer
trained by hypertrain's own trainer, agree step by step."""

import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import hypertrain
from hypertrain import optim

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "configs" / "default.yaml"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A deterministic text file (hypertrain's text_bytes: one token per byte)."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    gen = torch.Generator().manual_seed(3)
    words = ["the", "optimizer", "keeps", "an", "fp32", "copy", "of", "every", "weight", "and", "muon",
             "orthogonalizes", "matrices", "while", "adamw", "takes", "the", "rest"]
    text = " ".join(words[i] for i in torch.randint(0, len(words), (12000,), generator=gen).tolist())
    path.write_text(text)
    return path


def tiny(out, corpus, steps=4, **more):
    o = {"model.hidden_size": 64, "model.intermediate_size": 128, "model.num_hidden_layers": 2,
         "model.num_attention_heads": 4, "data.path": str(corpus), "data.seq_len": 32,
         "training.steps": steps, "training.local_batch_size": 2, "training.global_batch_size": 4,
         "training.log_interval": 1, "training.eval_interval": 2, "training.eval_batches": 2,
         "checkpoint.output_dir": str(out), "checkpoint.save_interval": 2, "lr_scheduler.warmup_ratio": 0.0}
    o.update(more)
    return o


def test_train_runs_the_c_trainer_and_load_checkpoint_reads_it(tmp_path, corpus):
    r = hypertrain.train(DEFAULT, tiny(tmp_path / "run", corpus))
    steps = [m for m in r.metrics if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4] and r.final["step"] == 4 and r.stopped_by == 0
    assert steps[-1]["loss"] < steps[0]["loss"], f"the loss did not fall: {[m['loss'] for m in steps]}"
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        assert [json.loads(line) for line in f] == r.metrics
    assert Path(r.latest).name == "step_00000004"
    ck = hypertrain.load_checkpoint(r.latest)
    assert ck.step == 4
    final = hypertrain.load_checkpoint(Path(r.output_dir) / "final")
    names = sorted(final)
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
    prefix = "_mixed_precision_optimizer.fp32_from_fp16_params."
    assert sorted(k for k in ck if k.startswith("model.")) == sorted("model." + n for n in names)
    for name in names:  # the model weights are bf16 (under model.); their FP32 main params round to them
        w = ck["model." + name]
        assert w.dtype == torch.bfloat16 and torch.equal(w, final[name]), name
        main = ck[prefix + name]
        assert main.dtype == torch.float32 and torch.equal(main.to(torch.bfloat16), w), name
    some = hypertrain.load_checkpoint(r.output_dir, keys=["model.lm_head.weight"], as_numpy=True)
    assert list(some) == ["model.lm_head.weight"] and some["model.lm_head.weight"].dtype.name == "float32"
    with pytest.raises(KeyError, match="no key"):
        hypertrain.load_checkpoint(r.latest, keys=["no.such.weight"])


def test_a_resumed_train_call_continues_the_run(tmp_path, corpus):
    """Two steps, then the same call with training.steps 4 and restore_from latest: the steps 3 and 4 and the
    checkpoint are the 4-step run's, bit for bit (a constant lr: the schedule does not depend on the length)."""
    same = {"lr_scheduler.type": "constant"}
    whole = hypertrain.train(DEFAULT, tiny(tmp_path / "whole", corpus, **same))
    hypertrain.train(DEFAULT, tiny(tmp_path / "cut", corpus, steps=2, **same))
    resumed = hypertrain.train(DEFAULT, tiny(tmp_path / "cut", corpus, **same, **{"checkpoint.restore_from": "latest"}))
    losses = {m["step"]: m["loss"] for m in whole.metrics if "loss" in m}
    again = {m["step"]: m["loss"] for m in resumed.metrics if "loss" in m and m["step"] > 2}
    assert sorted(again) == [3, 4] and all(again[s] == losses[s] for s in again), f"{again} against {losses}"
    a, b = hypertrain.load_checkpoint(whole.latest), hypertrain.load_checkpoint(resumed.latest)
    assert a.step == b.step == 4 and sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name}: the resumed run parts from the whole one"


def test_bad_config_and_bad_checkpoint(tmp_path, corpus):
    with pytest.raises(ValueError, match="training.stepz"):
        hypertrain.train(DEFAULT, tiny(tmp_path / "bad", corpus, **{"training.stepz": 3}))
    with pytest.raises(ValueError, match="model.hidden_size"):
        hypertrain.train(DEFAULT, tiny(tmp_path / "bad", corpus, **{"model.hidden_size": -1}))
    with pytest.raises(FileNotFoundError, match="no metadata.json"):
        hypertrain.load_checkpoint(tmp_path)
    r = hypertrain.train(DEFAULT, tiny(tmp_path / "ok", corpus, steps=2))
    rank_file = next(Path(r.latest).glob("*.safetensors"))
    data = bytearray(rank_file.read_bytes())
    data[-1] ^= 0xFF
    rank_file.write_bytes(bytes(data))
    with pytest.raises(OSError, match=rank_file.name):
        hypertrain.load_checkpoint(r.latest)


# ---------------------------------------------------------------- against the C trainer

T, B, STEPS = 32, 4, 3


def test_the_chained_optimizer_trains_as_the_c_trainer(tmp_path, corpus):
    """The same transformers Qwen2 (float32, saved and loaded by from_pretrained), the same windows in order
    (data.shuffle false: window w is bytes [w T, w T + T + 1)), Muon + AdamW as the default config's (sum
    momentum, Nesterov, asym5, matched AdamW RMS 0.2; AdamW without weight decay on biases and norms),
    clipping at 1, a constant lr: get_hyper_optimizer in PyTorch against the C trainer. Bounds
    (docs/NUMERICS.md, the trainer against one process): each step's loss and grad norm within 1e-5
    relative; every weight after each step within 1e-5 of its tensor's largest element, but k_proj.bias,
    left out as NUMERICS.md leaves it out of the sharded runs' checks: its gradient cancels in softmax but
    for RoPE's rotation (~1e-8, AdamW's eps), so even the first step lr g / (|g| + eps) depends on the
    digits float32 noise decides (measured here: 4.7e-4 after step 1, 1.8e-4 and 4.1e-4 after 3; every
    other tensor within 8.6e-6). The grad norms cover its gradient with the others'."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0)
    model = Qwen2ForCausalLM(config).float()
    model.save_pretrained(tmp_path / "init", safe_serialization=True)
    r = hypertrain.train(DEFAULT, {
        "model.from_pretrained": str(tmp_path / "init"), "model_init_dtype": "float32",
        "fsdp_config.mix_precision.param_dtype": "float32", "optimizer.fp32_main_params": False,
        "data.path": str(corpus), "data.seq_len": T, "data.shuffle": False, "data.valid_fraction": 0.0,
        "training.steps": STEPS, "training.local_batch_size": B, "training.global_batch_size": B,
        "training.log_interval": 1, "training.eval_interval": 0, "training.deterministic": True,
        "lr_scheduler.type": "constant", "lr_scheduler.warmup_ratio": 0.0,
        "checkpoint.output_dir": str(tmp_path / "c"), "checkpoint.save_interval": 1,
        "checkpoint.keep_last": STEPS, "checkpoint.save_optimizer": False})
    c_steps = [m for m in r.metrics if "loss" in m]
    c_weights = [hypertrain.load_checkpoint(Path(r.output_dir) / f"step_{s:08d}") for s in range(1, STEPS + 1)]

    tokens = torch.tensor(list(corpus.read_bytes()), dtype=torch.long)
    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n and "lm_head" not in n]
    decay = [p for n, p in model.named_parameters() if (p.ndim < 2 or "embed" in n or "lm_head" in n)
             and "bias" not in n and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if "bias" in n or "norm" in n]
    opt = optim.get_hyper_optimizer(model=model, muon_params=matrices,
                                    adamw_params=[{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
                                    muon_kwargs={"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95},
                                    adamw_kwargs={"lr": 1e-3, "weight_decay": 0.01, "betas": (0.9, 0.999),
                                                  "eps": 1e-8})
    for step in range(STEPS):
        windows = torch.stack([tokens[w * T:w * T + T + 1] for w in range(step * B, step * B + B)])
        logits = model(input_ids=windows[:, :T]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), windows[:, 1:].reshape(-1))
        loss.backward()
        norm = optim.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        c = c_steps[step]
        assert abs(loss.item() - c["loss"]) <= 1e-5 * c["loss"], f"step {step + 1}: loss {loss.item()} {c['loss']}"
        assert abs(norm.item() - c["grad_norm"]) <= 1e-5 * c["grad_norm"], \
            f"step {step + 1}: grad norm {norm.item()} against the C trainer's {c['grad_norm']}"
        for name, p in model.named_parameters():
            if "k_proj.bias" in name:
                continue
            want = c_weights[step]["model." + name]
            d = (p.detach() - want).abs().max().item() / want.abs().max().item()
            assert d <= 1e-5, f"step {step + 1}: {name} {d:.3g} from the C trainer's"


# ---------------------------------------------------------------- bad input the Python side refuses


def test_a_nul_in_an_override_or_the_config_path_is_refused(tmp_path, corpus):
    """The engine reads C strings: an override "data.path=corpus\\0.bak" trained on corpus (the rest silently
    dropped). Refused before the run, naming the override."""
    for sets in (tiny(tmp_path / "nul", corpus, **{"data.path": f"{corpus}\0.bak"}),
                 [f"data.path={corpus}\0.bak"], {"training.steps\0x": 2}):
        with pytest.raises(ValueError, match=r"the override .*\\x00.* holds a NUL character"):
            hypertrain.train(DEFAULT, sets)
    assert not (tmp_path / "nul").exists(), "a run started"
    with pytest.raises(ValueError, match=r"the config path .*\\x00x' holds a NUL character"):
        hypertrain.train(f"{DEFAULT}\0x", tiny(tmp_path / "nul", corpus))


def write_safetensors(path, tensors, header=None):
    """A safetensors file by hand (8-byte length, JSON header, data), so that a test can damage each part."""
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64"}
    entries, data, at = {}, b"", 0
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        entries[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + len(raw)]}
        data, at = data + raw, at + len(raw)
    text = json.dumps(entries if header is None else header(entries)).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return len(text)


def test_load_checkpoint_checks_a_hugging_face_files_header(tmp_path):
    """A damaged safetensors file in a Hugging Face folder is an error naming the file and what is wrong (before:
    a header damaged into "{}" read as no tensors at all, {}, and the others failed with struct, JSON, KeyError
    or reshape errors naming nothing, or read another tensor's bytes)."""
    gen = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(3, 4, generator=gen), "b": torch.randn(4, generator=gen).to(torch.bfloat16),
               "step": torch.tensor([7]), "none": torch.zeros(0, 5)}  # 48 + 8 + 8 + 0 = 64 bytes of data
    good = tmp_path / "good"
    good.mkdir()
    write_safetensors(good / "model.safetensors", tensors)
    got = hypertrain.load_checkpoint(good)
    assert sorted(got) == sorted(tensors) and all(torch.equal(got[k], tensors[k]) for k in tensors)

    # the file's bytes, damaged: (length, header, data) -> bytes
    damaged = {
        "emptied": (lambda n, h, d: n.to_bytes(8, "little") + b"{}" + b" " * (n - 2) + d,
                    r"the tensors cover 0 bytes of data, but the file holds 64"),
        "length past the end": (lambda n, h, d: (10 ** 6).to_bytes(8, "little") + h + d,
                                r"header length 1000000 is larger than the \d+ bytes after it"),
        "huge length": (lambda n, h, d: (2 ** 62).to_bytes(8, "little") + h + d,
                        r"header length \d+ exceeds the 100000000-byte limit"),
        "truncated": (lambda n, h, d: n.to_bytes(8, "little") + h + d[:-10],
                      r"the tensors cover 64 bytes of data, but the file holds 54"),
        "too short": (lambda n, h, d: b"\x05\x00", r"2 bytes, too short for the 8-byte header length"),
        "not JSON": (lambda n, h, d: n.to_bytes(8, "little") + b"#" + h[1:] + d, r"the header is not JSON"),
        "a key twice": (lambda n, h, d: (2 * n).to_bytes(8, "little") + h[:-1] + b", " + h[1:] + d,
                        r"the header names 'w' twice"),
    }
    headers = {  # the header's entries, damaged
        "a list": (lambda e: [e], r"the header is not a JSON object"),
        "dtype": (lambda e: {**e, "w": {**e["w"], "dtype": "F64"}}, r"tensor 'w': dtype 'F64'"),
        "shape": (lambda e: {**e, "w": {**e["w"], "shape": [3, -4]}}, r"tensor 'w': shape \[3, -4\]"),
        "bytes": (lambda e: {**e, "w": {**e["w"], "shape": [4, 4]}},
                  r"tensor 'w': data_offsets \[0, 48\] hold 48 bytes, but shape \[4, 4\] of F32 needs 64"),
        "overlap": (lambda e: {**e, "b": {**e["b"], "data_offsets": [40, 48]}}, r"tensor 'b' starts at data offset 40"),
        "metadata": (lambda e: {**e, "__metadata__": {"format": 1}}, r'"__metadata__" is not an object of strings'),
    }
    for what, (damage, match) in list(damaged.items()) + list(headers.items()):
        folder = tmp_path / what.replace(" ", "_")
        folder.mkdir()
        f = folder / "model.safetensors"
        if what in headers:
            write_safetensors(f, tensors, header=damage)
        else:
            n = write_safetensors(f, tensors)
            raw = f.read_bytes()
            f.write_bytes(damage(n, raw[8:8 + n], raw[8 + n:]))
        with pytest.raises(OSError, match=rf"hypertrain.load_checkpoint: {f}: {match}"):
            hypertrain.load_checkpoint(folder)


def test_load_checkpoint_follows_latest_only_to_a_child(tmp_path):
    """latest names a checkpoint directory inside the folder: one name, no '/', not '..', not a symlink leading
    out (before: followed anywhere, and read what it found there)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    write_safetensors(outside / "model.safetensors", {"secret": torch.ones(2)})
    run = tmp_path / "run"
    run.mkdir()
    (run / "step_00000002").symlink_to(outside)
    (run / "inside").mkdir()
    write_safetensors(run / "inside" / "model.safetensors", {"w": torch.ones(3)})
    for text, match in (("../outside", "not the name of a checkpoint directory"),
                        (str(outside), "not the name of a checkpoint directory"),
                        ("..", "not the name"), ("", "not the name"), ("step\x01", "not the name"),
                        ("step_00000002\n", r"a link to .*outside, outside .*run"),
                        ("missing", "but .*missing is not a directory")):
        (run / "latest").write_text(text)
        with pytest.raises(OSError, match=match):
            hypertrain.load_checkpoint(run)
    (run / "latest").write_text("x" * 5000)
    with pytest.raises(OSError, match="over 4096 bytes"):
        hypertrain.load_checkpoint(run)
    (run / "latest").write_text("inside\n")
    assert list(hypertrain.load_checkpoint(run)) == ["w"]


def test_a_stop_before_step_1_says_nothing_was_saved(tmp_path, corpus):
    """SIGTERM pending and blocked when train() is called (a launcher that blocks it, a signal that came first):
    the run takes it, stops before step 1 and says that nothing was trained or saved, never a checkpoint None;
    the same call then starts the run. In a child process: the signal is the test's own."""
    import subprocess
    import sys
    script = f"""
import os, signal, sys
import hypertrain
overrides = {tiny(tmp_path / "run", corpus)!r}
signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGTERM}})
os.kill(os.getpid(), signal.SIGTERM)
try:
    hypertrain.train({str(DEFAULT)!r}, overrides)
except KeyboardInterrupt as e:
    print("STOPPED:", e)
    sys.exit(0)
print("NOT STOPPED")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "STOPPED: hypertrain.train: stopped by signal 15 before step 1: nothing was trained and no checkpoint " \
           "saved" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "None" not in done.stdout
    assert not (tmp_path / "run" / "latest").exists()
    r = hypertrain.train(DEFAULT, tiny(tmp_path / "run", corpus, **{"checkpoint.restore_from": "latest"}))
    assert r.final["step"] == 4 and r.stopped_by == 0


@pytest.mark.parametrize("name,keys", [("CosineWithRestartsAndWarmUpLR", {}), ("CosineWithWarmUpLR", {}),
                                       ("WarmUpStableDecayLR", {}), ("PolynomialWithWarmUpLR", {}),
                                       ("ConstantWithCoolDownLR", {"decay_steps": 4, "lr_end1": 1e-4}),
                                       ("CosineAnnealingWarmRestarts", {"t_0": 3})])
def test_schedules_from_python_are_the_c_trainers(tmp_path, corpus, name, keys):
    """get_hyper_lr_scheduler with only the type, the warmup and the keys a schedule cannot do without: each
    step's lr is the C trainer's under the same lr_scheduler keys (metrics.jsonl's lr, printed to 7 digits: the
    Python lr printed the same way is the same text). One set of defaults (before: num_cycles 0.5 for
    restarts from Python, 1.0 for the trainer's MindFormers configs)."""
    from hypertrain.lr_scheduler import get_hyper_lr_scheduler
    T, W, lr = 9, 2, 1e-3
    sets = {f"lr_scheduler.{k}": v for k, v in keys.items()}
    run = tiny(tmp_path / "run", corpus, steps=T, **sets, **{
        "lr_scheduler.type": name, "lr_scheduler.warmup_steps": W, "training.eval_interval": 0,
        "checkpoint.save_interval": 0, "optimizer.adamw_config.adamw_lr": lr})
    del run["lr_scheduler.warmup_ratio"]  # given, it wins over warmup_steps: not given at all here
    config = tmp_path / "config.yaml"
    config.write_text("".join(line for line in DEFAULT.read_text().splitlines(keepends=True)
                              if "warmup_ratio:" not in line))
    r = hypertrain.train(config, run)
    theirs = [m["lr"] for m in r.metrics if "loss" in m]
    opt = optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=lr)
    sched = get_hyper_lr_scheduler(opt, scheduler_type=name, total_steps=T, warmup_steps=W, **keys)
    ours = []
    for _ in range(T):
        ours.append(float(f"{opt.param_groups[0]['lr']:.6e}"))
        opt.step()
        sched.step()
    assert ours == theirs, f"{name}: python {ours}, the C trainer {theirs}"


def test_train_log_level_and_quiet(tmp_path, corpus, capfd):
    """train(log_level=..., quiet=...) sets the engine's log sink for the call (before: a TypeError; the default
    config logs ~270 lines) and puts it back after."""
    runs = iter(range(100))

    def logged(**kw):
        capfd.readouterr()
        hypertrain.train(DEFAULT, tiny(tmp_path / f"log{next(runs)}", corpus, steps=1), **kw)
        return capfd.readouterr().err

    loud = logged()
    assert loud.count("[hypertrain info]") > 100, loud[-2000:]
    assert "[hypertrain info]" not in logged(quiet=True)
    assert "[hypertrain info]" not in logged(log_level="error")
    assert "[hypertrain debug]" not in loud
    assert logged().count("[hypertrain info]") > 100, "a quiet call left the engine quiet"
    with pytest.raises(ValueError, match="log_level 'loud'; expected one of debug, info, warning, error"):
        hypertrain.train(DEFAULT, tiny(tmp_path / "log", corpus), log_level="loud")
    with pytest.raises(ValueError, match="quiet=True is log_level='warning'"):
        hypertrain.train(DEFAULT, tiny(tmp_path / "log", corpus), quiet=True, log_level="info")


def test_train_without_a_config_runs_the_packaged_default(tmp_path, corpus, capfd, monkeypatch):
    """train() with no config: the package's configs/default.yaml (the repository's, as data) on the package's
    copy of the default corpus (Debian's fortunes, its regular files), from any directory (before: a TypeError)."""
    assert (hypertrain.CONFIGS / "default.yaml").read_bytes() == DEFAULT.read_bytes()
    system = Path("/usr/share/games/fortunes")
    if system.is_dir():
        want = sorted(p.name for p in system.iterdir() if p.is_file() and not p.is_symlink())
        assert sorted(p.name for p in hypertrain.CORPUS.iterdir()) == want
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    r = hypertrain.train(overrides={"training.steps": 1, "training.eval_batches": 1,
                                    "checkpoint.output_dir": str(tmp_path / "run")})
    err = capfd.readouterr().err
    assert r.final["step"] == 1 and 0 < r.final["loss"] < 6, r.final
    assert f"data: text_bytes {hypertrain.CORPUS}:" in err, err[-3000:]
    r = hypertrain.train(overrides={"training.steps": 1, "training.eval_batches": 1, "data.path": str(corpus),
                                    "checkpoint.output_dir": str(tmp_path / "own")})
    err = capfd.readouterr().err
    assert r.final["step"] == 1 and str(corpus) in err and str(hypertrain.CORPUS) not in err, \
        "data.path given: the packaged corpus must not replace it"
