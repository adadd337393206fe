#!/usr/bin/env python3
"""Write src/data/unicode_tables.h: the code point ranges of Unicode's
letters (general category L*) and numbers (N*), which the byte-level BPE
pre-tokenizers' \\p{L} and \\p{N} match (src/data/tokenizer.c), from
Python's unicodedata (its Unicode version is written into the file).
Rerunning with the same Python writes the same bytes."""
import os
import sys
import unicodedata


def ranges(prefix):
    out, start = [], None
    for cp in range(0x110000):
        inside = unicodedata.category(chr(cp)).startswith(prefix)
        if inside and start is None:
            start = cp
        if not inside and start is not None:
            out.append((start, cp - 1))
            start = None
    if start is not None:
        out.append((start, 0x10FFFF))
    return out


def table(name, rs):
    lines = [f"static const uint32_t {name}[][2] = {{"]
    for i in range(0, len(rs), 4):
        lines.append("    " + " ".join(f"{{0x{a:X}, 0x{b:X}}}," for a, b in rs[i : i + 4]))
    lines.append("};")
    return "\n".join(lines)


def main():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "data", "unicode_tables.h")
    body = [
        f"/* Unicode {unicodedata.unidata_version}'s letters (L*) and numbers (N*) as sorted, inclusive code point",
        " * ranges, for the pre-tokenizers of src/data/tokenizer.c. Written by tools/make_unicode_tables.py: do",
        " * not edit. */",
        "#ifndef HT_DATA_UNICODE_TABLES_H",
        "#define HT_DATA_UNICODE_TABLES_H",
        "",
        "#include <stdint.h>",
        "",
        "// clang-format off",
        table("UNICODE_LETTERS", ranges("L")),
        table("UNICODE_NUMBERS", ranges("N")),
        "// clang-format on",
        "",
        "#endif",
        "",
    ]
    with open(path, "w") as f:
        f.write("\n".join(body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
