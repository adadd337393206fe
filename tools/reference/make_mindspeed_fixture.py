#!/usr/bin/env python3
"""The data of configs/seeds/mindspeed_mm_fsdp2.yaml: a word-level tokenizer
(tokenizer.json, Hugging Face's format) of the 99 commonest words of a short
text plus [UNK], and that text tokenized with it into one token_bin shard
(version 1, its vocabulary in header word 3), for the 100-token Qwen2 fixture
model. Pure Python: run it from the repository root to rewrite
tests/fixtures/data/mindspeed/."""
import collections
import json
import os
import re
import struct

TEXT = """
The training engine keeps an FP32 copy of every low-precision weight, accumulates
gradients in FP32, runs Muon on the weight matrices and AdamW on the rest, and
writes the result back to the model's dtype. It shards parameters, gradients and
optimizer state across processes, saves sharded checkpoints keyed by parameter
name that resume exactly and load on a different process count, and is driven
by one file. A small update is not lost when the weights are stored in a low
precision, because the update is made to the copy and the copy is kept.
""" * 40

OUT = "tests/fixtures/data/mindspeed"


def words(text):
    return re.findall(r"[A-Za-z0-9']+|[^\sA-Za-z0-9']", text)


def main():
    toks = words(TEXT)
    common = [w for w, _ in collections.Counter(toks).most_common(99)]
    vocab = {"[UNK]": 0}
    for w in sorted(common):
        vocab[w] = len(vocab)
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": 0, "content": "[UNK]", "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
    }
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "tokenizer.json"), "w") as f:
        json.dump(tokenizer, f, indent=1)
    ids = [vocab.get(w, 0) for w in toks]
    header = [0] * 256
    header[0], header[1], header[2], header[3] = 20240520, 1, len(ids), len(vocab)
    with open(os.path.join(OUT, "train_000000.bin"), "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(struct.pack("<%dH" % len(ids), *ids))
    print("%d tokens, vocabulary %d" % (len(ids), len(vocab)))


if __name__ == "__main__":
    main()
