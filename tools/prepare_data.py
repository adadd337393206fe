#!/usr/bin/env python3
"""Tokenizes text into hypertrain's token_bin shards (src/data/token_bin.c).

Each input is a text file (one document), a folder (its regular files in name
order, not recursive, symlinks and files with a NUL byte skipped, as
text_bytes reads one) or, with --jsonl-field, a JSONL file (one document per
line, the text in that field). The tokenizer is a Hugging Face tokenizer.json
or a model folder holding one, read with the `tokenizers` package (pip install
tokenizers); it runs offline. Each document is encoded as the tokenizer's
post-processor says (Llama's adds its BOS, Qwen2.5's adds nothing), and the
EOS token follows it when the tokenizer has one.

A shard is 256 int32 little-endian header words ([0] magic 20240520, [1]
version, [2] token count, [3] the tokenizer's vocabulary size, the rest 0)
then the tokens: uint16 (version 1) when every id fits, uint32 (version 2)
otherwise. Shards are OUT_000000.bin, OUT_000001.bin, ... of --shard-tokens
tokens each (the last one shorter). hypertrain reads them in name order as one
stream; data.valid_fraction holds out the stream's tail, so the last
documents are the validation text.

usage: python3 tools/prepare_data.py --tokenizer PATH --out PREFIX [options] INPUT...
"""
import argparse
import json
import os
import struct
import sys
import time
from array import array

MAGIC = 20240520
HEADER_WORDS = 256
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")


def fail(msg):
    sys.exit(f"prepare_data: {msg}")


def load_tokenizer(path):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        fail("needs the tokenizers package: pip install tokenizers")
    folder = path if os.path.isdir(path) else None
    file = os.path.join(path, "tokenizer.json") if folder else path
    if not os.path.isfile(file):
        fail(f"{file}: no such file (--tokenizer takes a tokenizer.json or a folder with one; a folder with only "
             "a sentencepiece tokenizer.model needs converting to tokenizer.json with transformers first)")
    try:
        tok = Tokenizer.from_file(file)
    except Exception as e:  # the library's own message says what is wrong with the file
        fail(f"{file}: not a tokenizer.json the tokenizers package reads: {e}")
    # A tokenizer.json made for inference may truncate or pad: a document must stay whole.
    tok.no_truncation()
    tok.no_padding()
    return tok, folder, file


def find_eos(tok, folder, override):
    """The EOS token's (text, id), or None: --eos, else the folder's tokenizer_config.json, else a known name."""
    names = [override] if override else []
    if not override and folder:
        try:
            with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
                eos = json.load(f).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str):
                names.append(eos)
        except (OSError, ValueError):
            pass
    if not override:
        names += EOS_NAMES
    for name in names:
        i = tok.token_to_id(name)
        if i is not None:
            return name, i
    if override:
        fail(f"--eos {override}: the tokenizer has no such token")
    return None


def is_text(path):
    with open(path, "rb") as f:
        return b"\0" not in f.read()


def input_files(paths):
    for p in paths:
        if os.path.isdir(p):
            for name in sorted(os.listdir(p)):
                q = os.path.join(p, name)
                if not os.path.islink(q) and os.path.isfile(q) and is_text(q):
                    yield q
        elif os.path.isfile(p):
            yield p
        else:
            fail(f"{p}: no such file or folder")


def documents(paths, jsonl_field):
    for path in input_files(paths):
        if jsonl_field is None:
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f.read()
            continue
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)[jsonl_field]
                except (ValueError, KeyError, TypeError) as e:
                    fail(f"{path}:{n}: no string field '{jsonl_field}' ({type(e).__name__}: {e})")
                if not isinstance(text, str):
                    fail(f"{path}:{n}: field '{jsonl_field}' is {type(text).__name__}, not a string")
                yield text


class ShardWriter:
    def __init__(self, prefix, vocab_size, shard_tokens):
        self.prefix, self.vocab_size, self.shard_tokens = prefix, vocab_size, shard_tokens
        self.version = 1 if vocab_size <= 1 << 16 else 2
        self.buf = array("H" if self.version == 1 else "I")
        assert self.buf.itemsize == 2 * self.version
        self.paths, self.total = [], 0

    def add(self, ids):
        self.total += len(ids)
        while ids:
            room = self.shard_tokens - len(self.buf)
            self.buf.extend(ids[:room])
            ids = ids[room:]
            if len(self.buf) == self.shard_tokens:
                self.flush()

    def flush(self):
        if not self.buf:
            return
        header = [0] * HEADER_WORDS
        header[0], header[1], header[2], header[3] = MAGIC, self.version, len(self.buf), self.vocab_size
        if sys.byteorder == "big":
            self.buf.byteswap()
        path = f"{self.prefix}_{len(self.paths):06d}.bin"
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(struct.pack(f"<{HEADER_WORDS}i", *header))
            f.write(self.buf.tobytes())
        os.replace(tmp, path)  # a shard under its name is always whole
        self.paths.append(path)
        self.buf = array(self.buf.typecode)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", metavar="INPUT", help="text files, folders of them, or JSONL files")
    ap.add_argument("--tokenizer", required=True, help="a tokenizer.json, or a Hugging Face folder with one")
    ap.add_argument("--out", required=True, help="shard prefix: writes PREFIX_000000.bin, ...")
    ap.add_argument("--jsonl-field", metavar="FIELD", help="the inputs are JSONL; each line's FIELD is a document")
    ap.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (default 100,000,000)")
    ap.add_argument("--eos", metavar="TOKEN", help="the token after each document (default: the tokenizer's EOS)")
    ap.add_argument("--no-eos", action="store_true", help="nothing after each document")
    ap.add_argument("--batch", type=int, default=256, help="documents encoded at once (default 256)")
    args = ap.parse_args()
    if not 1 <= args.shard_tokens <= 2**31 - 1:
        fail(f"--shard-tokens must be in [1, 2147483647] (the header's int32 count), got {args.shard_tokens}")

    tok, folder, file = load_tokenizer(args.tokenizer)
    vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    eos = None if args.no_eos else find_eos(tok, folder, args.eos)
    if os.path.dirname(args.out):
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
    w = ShardWriter(args.out, vocab_size, args.shard_tokens)
    print(f"prepare_data: {file}: vocabulary {vocab_size} (token_bin version {w.version}, "
          f"{'uint16' if w.version == 1 else 'uint32'} tokens); "
          + (f"EOS {eos[0]} = {eos[1]} after each document" if eos else "no EOS token: documents follow each other"),
          file=sys.stderr)

    start = last = time.monotonic()
    n_docs, n_chars = 0, 0
    tty = sys.stderr.isatty()
    cr = "\r" if tty else ""

    def encode(batch):
        nonlocal n_docs, n_chars, last
        for enc in tok.encode_batch(batch):
            ids = enc.ids
            if eos and (not ids or ids[-1] != eos[1]):
                ids.append(eos[1])
            w.add(ids)
        n_docs += len(batch)
        n_chars += sum(len(d) for d in batch)
        now = time.monotonic()
        if now - last >= (1 if tty else 10):  # a log file gets a line every 10 s, a terminal one redrawn line
            last = now
            print(f"{cr}prepare_data: {n_docs:,} documents, {n_chars / 1e6:.1f}M characters -> "
                  f"{w.total:,} tokens, {len(w.paths)} shards written, {now - start:.0f} s", end="" if tty else "\n",
                  file=sys.stderr, flush=True)

    batch = []
    for doc in documents(args.inputs, args.jsonl_field):
        batch.append(doc)
        if len(batch) == args.batch:
            encode(batch)
            batch = []
    if batch:
        encode(batch)
    w.flush()
    if not w.paths:
        fail("no tokens: the inputs hold no documents")
    if tty and last != start:  # end the redrawn line
        print(file=sys.stderr)
    shards = f"{len(w.paths)} shard{'s' if len(w.paths) > 1 else ''}"
    print(f"prepare_data: {n_docs:,} documents -> {w.total:,} tokens in {shards} "
          f"({w.paths[0]} ...), {time.monotonic() - start:.1f} s", file=sys.stderr)
    print(f"  data.dataset_type: token_bin\n  data.path: {args.out}_*.bin")


if __name__ == "__main__":
    main()
