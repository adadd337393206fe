"""training.tensorboard: the event files a run writes, read back by TensorBoard's own reader (its
EventAccumulator, and its record reader's CRC checks), hold metrics.jsonl's values under their tags; a
resumed run's file makes the reader drop what the earlier file holds past the checkpoint; a directory given
takes the files. Skipped where the tensorboard package is not importable."""

import glob
import json
import struct
from pathlib import Path

import pytest

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c  # noqa: E402

import hypertrain  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "configs" / "default.yaml"

# metrics.jsonl's key -> the tag, and how far apart the two may be: the line's digits (a last digit rounded
# either way), the event's float.
TAGS = {"loss": ("train/loss", 2e-6), "grad_norm": ("train/grad_norm", 2e-6), "lr": ("lr/adamw", 0),
        "muon_lr": ("lr/muon", 0), "tokens_per_s": ("perf/tokens_per_s", 0.1), "mfu": ("perf/mfu", 1e-4),
        "qk_max_logit": ("qk_clip/max_logit", 1e-4), "qk_clipped_heads": ("qk_clip/clipped_heads", 0),
        "expert_load_max": ("moe/expert_load_max", 1e-4), "expert_load_min": ("moe/expert_load_min", 1e-4),
        "val_loss": ("val/loss", 2e-6)}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("the optimizer keeps an fp32 copy of every weight and muon orthogonalizes matrices " * 150)
    return path


def tiny(out, corpus, steps=4, **more):
    o = {"model.hidden_size": 64, "model.intermediate_size": 128, "model.num_hidden_layers": 2,
         "model.num_attention_heads": 4, "data.path": str(corpus), "data.seq_len": 32,
         "training.steps": steps, "training.local_batch_size": 2, "training.global_batch_size": 4,
         "training.log_interval": 2, "training.eval_interval": 2, "training.eval_batches": 2,
         "training.tensorboard": True, "checkpoint.output_dir": str(out), "checkpoint.save_interval": 2}
    o.update(more)
    return o


def records(path):
    """Every record of a TFRecord file, each length and payload checked against its masked CRC-32C."""
    data, at, out = Path(path).read_bytes(), 0, []
    while at < len(data):
        (n,) = struct.unpack_from("<Q", data, at)
        assert struct.unpack_from("<I", data, at + 8)[0] == masked_crc32c(data[at:at + 8])
        payload = data[at + 12:at + 12 + n]
        assert struct.unpack_from("<I", data, at + 12 + n)[0] == masked_crc32c(payload)
        out.append(payload)
        at += 16 + n
    return out


def scalars(logdir):
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def check_against_metrics(metrics, got):
    for key, (tag, tol) in TAGS.items():
        want = [(m["step"], m[key]) for m in metrics if m.get(key) is not None]
        if key == "qk_clipped_heads":
            want = [w for w in want if any(m["step"] == w[0] and "qk_max_logit" in m for m in metrics)]
        assert [s for s, _ in got.get(tag, [])] == [s for s, _ in want], tag
        for (_, a), (_, b) in zip(got.get(tag, []), want):
            assert a == pytest.approx(b, rel=1e-6, abs=tol), (tag, a, b)


def test_events_hold_the_metrics(tmp_path, corpus):
    r = hypertrain.train(DEFAULT, tiny(tmp_path / "run", corpus))
    files = glob.glob(str(tmp_path / "run" / "tensorboard" / "events.out.tfevents.*"))
    assert len(files) == 1
    assert len(records(files[0])) == 1 + 3 + 4  # file_version, 3 evaluations, 4 steps
    got = scalars(tmp_path / "run" / "tensorboard")
    assert {"train/loss", "train/grad_norm", "lr/adamw", "lr/muon", "perf/tokens_per_s", "val/loss",
            "memory/peak_rss_mib"} <= set(got)
    check_against_metrics(r.metrics, got)
    # the largest peak RSS of the ranks at each logged step (1, 2, 4): a process with the model in it
    assert [s for s, _ in got["memory/peak_rss_mib"]] == [1, 2, 4]
    assert all(10 < v < 1e5 for _, v in got["memory/peak_rss_mib"])


def test_moe_and_qk_clip_scalars(tmp_path, corpus):
    moe = {"model.name": "qwen2_moe", "model.num_experts": 4, "model.num_experts_per_tok": 2,
           "model.moe_intermediate_size": 32, "model.shared_expert_intermediate_size": 64,
           "optimizer.muon_config.qk_clip_enabled": True, "optimizer.muon_config.qk_clip_threshold": 1.0}
    r = hypertrain.train(DEFAULT, tiny(tmp_path / "run", corpus, steps=2, **moe))
    got = scalars(tmp_path / "run" / "tensorboard")
    assert {"qk_clip/max_logit", "qk_clip/clipped_heads", "moe/expert_load_max", "moe/expert_load_min"} <= set(got)
    check_against_metrics(r.metrics, got)
    for m in (m for m in r.metrics if "loss" in m):  # every expert's share of its layer, over the mean
        assert m["expert_load_min"] <= 1.0 <= m["expert_load_max"] <= 4.0


def test_a_resumed_run_replaces_the_steps_after_its_checkpoint(tmp_path, corpus):
    """4 steps, then the run again from its step-2 checkpoint: a second file, whose SessionLog START makes
    the reader drop the first file's steps 3 and 4; each step once, the resumed run's values."""
    out = tmp_path / "run"
    hypertrain.train(DEFAULT, tiny(out, corpus, **{"lr_scheduler.type": "constant"}))
    again = hypertrain.train(DEFAULT, tiny(out, corpus, **{"lr_scheduler.type": "constant",
                                                            "checkpoint.restore_from": str(out / "step_00000002")}))
    assert len(glob.glob(str(out / "tensorboard" / "events.out.tfevents.*"))) == 2
    got = scalars(out / "tensorboard")
    assert [s for s, _ in got["train/loss"]] == [1, 2, 3, 4]
    with open(out / "metrics.jsonl") as f:
        metrics = [json.loads(line) for line in f]
    assert metrics == again.metrics
    losses = {m["step"]: m["loss"] for m in metrics if "loss" in m}
    assert all(v == pytest.approx(losses[s], abs=1e-6) for s, v in got["train/loss"])


def test_a_directory_given_takes_the_files(tmp_path, corpus):
    hypertrain.train(DEFAULT, tiny(tmp_path / "run", corpus, steps=1, **{"training.tensorboard": str(tmp_path / "tb")}))
    assert len(glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))) == 1
    assert not (tmp_path / "run" / "tensorboard").exists()
