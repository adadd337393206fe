#!/usr/bin/env python3
"""Checks tools/prepare_data.py end to end, offline, with tokenizers built here
(pip install tokenizers; nothing is downloaded):

- a 70,000-word WordLevel tokenizer (ids beyond uint16) on JSONL: version 2
  shards, the header's vocabulary word, EOS after each document, the split
  into --shard-tokens shards, the exact ids;
- a byte-level BPE trained here on text files and a folder, as a model folder
  with tokenizer_config.json naming its EOS and a tokenizer.json that would
  truncate to 8 tokens: version 1 shards, no document cut short.

With --write-fixtures it also writes the version-2 shards that tests/test_data.c
reads (tests/fixtures/data/prepared_v2_*.bin).

usage: python3 tools/test_prepare_data.py [--write-fixtures]
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "prepare_data.py")


def read_shard(path):
    with open(path, "rb") as f:
        data = f.read()
    header = struct.unpack("<256i", data[:1024])
    assert header[0] == 20240520 and header[1] in (1, 2) and not any(header[4:]), (path, header[:8])
    width = 2 * header[1]
    assert len(data) == 1024 + width * header[2], (path, len(data), header[2])
    ids = list(struct.unpack(f"<{header[2]}{'H' if width == 2 else 'I'}", data[1024:]))
    return header[1], header[3], ids


def run(*args):
    r = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout + r.stderr


def check_wide(tmp):
    vocab = {f"w{i}": i for i in range(69999)}
    vocab["<|endoftext|>"] = 69999
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = os.path.join(tmp, "wide.json")
    tok.save(path)
    docs = os.path.join(tmp, "docs.jsonl")
    with open(docs, "w") as f:
        for text in ("w1 w65536 w69998", "w7", "", "w65535 w2"):
            f.write(json.dumps({"id": 3, "text": text}) + "\n")
    out = run("--tokenizer", path, "--out", os.path.join(tmp, "wide", "prepared_v2"), "--jsonl-field", "text",
              "--shard-tokens", "4", docs)
    assert "version 2" in out and "<|endoftext|> = 69999" in out, out
    shards = sorted(os.listdir(os.path.join(tmp, "wide")))
    assert shards == ["prepared_v2_000000.bin", "prepared_v2_000001.bin", "prepared_v2_000002.bin"], shards
    stream = []
    for name in shards:
        version, vocab_size, ids = read_shard(os.path.join(tmp, "wide", name))
        assert (version, vocab_size) == (2, 70000)
        stream += ids
    E = 69999
    assert stream == [1, 65536, 69998, E, 7, E, E, 65535, 2, E], stream
    return [os.path.join(tmp, "wide", s) for s in shards]


def check_narrow(tmp):
    text = [f"Document {i}: " + "the quick brown fox jumps over the lazy dog. " * (i + 1) for i in range(6)]
    folder = os.path.join(tmp, "texts")
    os.makedirs(folder)
    for i, t in enumerate(text[1:]):
        with open(os.path.join(folder, f"{i:02d}.txt"), "w") as f:
            f.write(t)
    with open(os.path.join(folder, "zz.bin"), "wb") as f:
        f.write(b"\0binary")  # skipped, as text_bytes skips it
    os.symlink("00.txt", os.path.join(folder, "link.txt"))  # skipped too
    single = os.path.join(tmp, "first.txt")
    with open(single, "w") as f:
        f.write(text[0])

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer)
    tok.enable_truncation(8)  # an inference setting prepare_data must undo
    model = os.path.join(tmp, "model")
    os.makedirs(model)
    tok.save(os.path.join(model, "tokenizer.json"))
    with open(os.path.join(model, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": {"content": "</s>"}}, f)
    out = run("--tokenizer", model, "--out", os.path.join(tmp, "narrow", "s"), single, folder)
    assert "version 1" in out and "</s> = 1" in out and "6 documents" in out, out
    version, vocab_size, ids = read_shard(os.path.join(tmp, "narrow", "s_000000.bin"))
    tok.no_truncation()
    want = []
    for t in text:
        want += tok.encode(t).ids + [1]
    assert (version, vocab_size) == (1, tok.get_vocab_size()), (version, vocab_size)
    assert ids == want, (len(ids), len(want))


def main():
    tmp = tempfile.mkdtemp(prefix="prepare_data_")
    try:
        wide = check_wide(tmp)
        check_narrow(tmp)
        if "--write-fixtures" in sys.argv[1:]:
            dst = os.path.join(ROOT, "tests", "fixtures", "data")
            os.makedirs(dst, exist_ok=True)
            for p in wide:
                shutil.copy(p, dst)
            print(f"wrote {len(wide)} shards to {dst}")
    finally:
        shutil.rmtree(tmp)
    print("test_prepare_data: 2 passed, 0 failed")


if __name__ == "__main__":
    main()
