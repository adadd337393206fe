#!/usr/bin/env python3
"""Write the byte-level BPE tokenizers and the encodings hypertrain's
tokenizer tests compare against (tests/fixtures/tokenizer/).

Three small tokenizers are trained with the tokenizers package (BpeTrainer,
vocab_size 1000, GPT-2's byte alphabet as the initial alphabet) on the first
200,000 bytes of the fortunes corpus (/usr/share/games/fortunes, the default
corpus) plus MIXED below, each with the pipeline of a released model:

  qwen2.json   NFC normalizer; Split(Qwen2's pattern, Isolated) then
               ByteLevel(use_regex=False); added <|endoftext|>, <|im_start|>,
               <|im_end|>; no post-processor
  llama3.json  no normalizer; Split(Llama 3's pattern: digits in runs of up
               to 3) then ByteLevel(use_regex=False); BPE ignore_merges;
               added <|begin_of_text|>, <|end_of_text|>; TemplateProcessing
               "<|begin_of_text|> $A" (encode adds it first)
  gpt2.json    ByteLevel(add_prefix_space=False) with GPT-2's own pattern;
               added <|endoftext|>

cases.json: {"texts": [...], "<name>": [[ids of text 0], ...]} for each
tokenizer: Tokenizer.encode(text).ids (add_special_tokens=True), over
CASES: contractions in both cases, runs of spaces, tabs, \\r\\n, newlines
after punctuation, digits, letters of other scripts, emoji, added tokens
inside text. Each encoding is checked to decode back to its text.
Rerunning writes identical bytes.
"""
import json
import os
import sys

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "..", "tests", "fixtures", "tokenizer")

QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

MIXED = [
    "Größe und Maß: naïve café, Ærøskøbing. Привет, мир! Γειά σου Κόσμε.",
    "中文分词测试：你好，世界！日本語のテキスト。한국어 텍스트입니다.",
    "العربية نص قصير. עברית טקסט. हिन्दी पाठ। ไทยข้อความ",
    "Numbers: 1234567890, 3.14159, ٣٤٥, ½ ⅔ Ⅻ, 12,345.67 and 2026-12-06.",
    "Emoji 😀🎉👍🏽 and symbols → ⇒ ∑ ∞ © ® ™ — “quotes” ‘single’ …",
]

CASES = [
    "Hello, world!",
    "I'm sure they'll say it's fine, but we'd've known. DON'T SHOUT, I'M HERE. You'RE right.",
    "  leading spaces and trailing spaces   ",
    "tabs\tand\t\ttabs, then\nnew lines\n\n\nand\r\nwindows\r\n line ends",
    "punctuation!!! ... ??? (nested [brackets] {braces}) <tags/> #hash @at $5 %20 ^_^ ~/path/to/file.txt",
    "line one.\n  indented line two:\n\tthree;\n",
    "digits 1 12 123 1234 12345 123456 and 3.14159265 and 1,000,000",
    "Größe, naïve café — Привет мир, 中文分词测试，日本語。😀🎉 ½ ⅔ ٣٤٥",
    "<|endoftext|>a document<|endoftext|> <|im_start|>user\nhi<|im_end|>",
    "<|begin_of_text|>text after a special token<|end_of_text|>",
    "x",
    " ",
    "\n",
    "   \n   ",
    "trailing newline and spaces \n \n",
    "a  b   c    d\u00a0e\u2003f",
    "'s 'S 'Ll 'lL ''s end'",
    "Q: What do you call a fish with no eyes?\nA: A fsh.",
]


def corpus():
    text = ""
    root = "/usr/share/games/fortunes"
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if os.path.isfile(path) and not name.endswith(".dat") and not name.endswith(".u8"):
            with open(path, "rb") as f:
                text += f.read().decode("utf-8", "replace")
        if len(text) > 200_000:
            break
    return [text[:200_000]] + MIXED * 20


def train(pre, special, normalizer=None, ignore_merges=False):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if normalizer:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=special, show_progress=False
    )
    tok.train_from_iterator(corpus(), trainer)
    return tok


def split(pattern):
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def main():
    os.makedirs(OUT, exist_ok=True)
    toks = {
        "qwen2": train(split(QWEN2), ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], normalizers.NFC()),
        "llama3": train(split(LLAMA3), ["<|begin_of_text|>", "<|end_of_text|>"], ignore_merges=True),
        "gpt2": train(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), ["<|endoftext|>"]),
    }
    llama = toks["llama3"]
    bos = llama.token_to_id("<|begin_of_text|>")
    llama.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
    )
    out = {"texts": CASES}
    for name, tok in toks.items():
        tok.save(os.path.join(OUT, name + ".json"))
        encoded = []
        for text in CASES:
            ids = tok.encode(text).ids
            back = tok.decode(ids, skip_special_tokens=False)
            if name == "llama3":
                back = back[len("<|begin_of_text|>") :]
            assert back == text, (name, text, back)
            encoded.append(ids)
        out[name] = encoded
        print(name, tok.get_vocab_size(), "tokens;", sum(map(len, encoded)), "ids over", len(CASES), "texts")
    with open(os.path.join(OUT, "cases.json"), "w") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
