#!/usr/bin/env bash
# The repository holds the documents its code cites, and they say what it does. Three checks:
#  1. Every *.md file named in the sources, tests, benchmarks, tools, configs
#     and docs exists, as a path from the repository root or from the citing
#     file's folder; where the citation names a section ("docs/NUMERICS.md, AdamW",
#     'docs/DESIGN.md ("Checkpoints")', 'bench/RESULTS.md's "Issue 11"'), a
#     heading of that file contains the name (case aside).
#  2. Every key of the config key table (src/config/keys.c) appears, as
#     `key`, in docs/CONFIG.md.
#  3. docs/DESIGN.md's layer table is the order of the code's includes, in
#     every source of src/ (the kernel backends' folders, src/kernels/cpu/ and
#     src/kernels/cuda/, included); and no file includes another layer's
#     internal headers ("LAYER/x.h"): a layer is reached through its public one.
# Each failure is one line: file:line: what is wrong. Usage: check_doc_citations.sh [ROOT]
set -u
root=${1:-$(cd "$(dirname "$0")/.." && pwd)}
cd "$root" || exit 2

files=$(find src include tests bench tools configs scripts docs .ci -type f \
            \( -name '*.c' -o -name '*.h' -o -name '*.md' -o -name '*.sh' -o -name '*.py' -o -name '*.yaml' \
               -o -name '*.yml' -o -name '*.json' -o -name '*.txt' -o -name 'run' \) \
            -not -path 'tests/fuzz/regressions/*' 2>/dev/null | LC_ALL=C sort)
files="$files README.md CMakeLists.txt Makefile .clang-format"

# file:line:text of every line that names a .md file.
# shellcheck disable=SC2086
hits=$(grep -nHE '[A-Za-z0-9_-]\.md([^A-Za-z0-9_]|$)' $files 2>/dev/null)

# One line per citation: citing file, line, cited path, section ("" if none).
citations=$(printf '%s\n' "$hits" | awk '
    {
        file = $0; sub(/:.*/, "", file)
        rest = substr($0, length(file) + 2)
        line = rest; sub(/:.*/, "", line)
        text = substr(rest, length(line) + 2)
        while (match(text, /[A-Za-z0-9_.\/-]*[A-Za-z0-9_-]\.md/)) {
            path = substr(text, RSTART, RLENGTH)
            before = RSTART > 1 ? substr(text, RSTART - 1, 1) : ""
            after = substr(text, RSTART + RLENGTH)
            text = after
            if (after ~ /^[A-Za-z0-9_]/) continue
            # The section after the file: (FILE, Name)  or  FILE, Name:  or  FILE, "Name"  or
            # FILE ("Name")  or the possessive  FILE(apostrophe)s "Name". Prose after a comma is no section.
            section = ""
            s = after
            quoted = 0
            if (substr(s, 1, 4) == "'\''s \"") { s = substr(s, 5); quoted = 1 }
            else if (substr(s, 1, 3) == " (\"") { s = substr(s, 4); quoted = 1 }
            else if (substr(s, 1, 3) == ", \"") { s = substr(s, 4); quoted = 1 }
            else if (substr(s, 1, 2) == ", ") { s = substr(s, 3) }
            else if (s ~ /^,[ \t]*$/ && before == "(") { s = ""; section = "<next line>" }
            else s = ""
            if (quoted) {
                q = index(s, "\"")
                section = q ? substr(s, 1, q - 1) : s
            } else if (s != "" && before == "(") {
                # (FILE, Name) or (FILE, Name, more) or a name wrapped onto the next line
                if (match(s, /[),:;"]/)) s = substr(s, 1, RSTART - 1)
                section = s
            } else if (s != "" && match(s, /^[^.,;()"]*:/)) {
                # FILE, Name: more
                section = substr(s, 1, RLENGTH - 1)
            }
            gsub(/^[ \t]+|[ \t]+$/, "", section)
            printf "%s\t%s\t%s\t%s\n", file, line, path, section
        }
    }')

failures=0
report() {
    echo "$1"
    failures=$((failures + 1))
}

while IFS="$(printf '\t')" read -r file line path section; do
    [ -n "$file" ] || continue
    target=""
    for candidate in "$path" "$(dirname "$file")/$path"; do
        if [ -f "$candidate" ]; then
            target=$candidate
            break
        fi
    done
    if [ -z "$target" ]; then
        report "$file:$line: cites $path, which is not in the repository"
        continue
    fi
    if [ "$section" = "<next line>" ]; then # "(FILE," at the end of a line: the name opens the next one
        section=$(sed -n "$((line + 1))p" "$file" | sed -E 's/^[[:space:]]*([*#]|\/\/)?[[:space:]]*//; s/[),:;"].*//')
    fi
    [ -n "$section" ] || continue
    if ! grep -E '^#+ ' "$target" | grep -qiF -- "$section"; then
        report "$file:$line: cites $path, section \"$section\": no heading of $target has that name"
    fi
done <<EOF
$citations
EOF

# Check 2: the key table's every key in docs/CONFIG.md.
if [ -f docs/CONFIG.md ]; then
    keys=$(awk '/^const key_desc ht_config_keys\[\] = \{/ { f = 1; next } f && /^\};/ { f = 0 } f' src/config/keys.c |
        sed -nE 's/^ *[A-Z0-9_]+\("([^"]+)".*/\1/p; s/.*\) ([A-Z0-9_]+)\("([^"]+)".*/\2/p')
    # the architecture keys, made from include/hypertrain/model.h's HT_ARCH_FIELDS (X(member, key, ...): model.KEY)
    keys="$keys
$(awk '/^#define HT_ARCH_FIELDS\(X\)/ { f = 1 } f { print } f && !/\\$/ { f = 0 }' include/hypertrain/model.h |
        sed -nE 's/^ *X\([a-z_.]+, ([a-z_]+),.*/model.\1/p')"
    [ -n "$keys" ] || report "src/config/keys.c: no key table found (const key_desc ht_config_keys[])"
    for key in $keys; do
        grep -qF -- "\`$key\`" docs/CONFIG.md || report "docs/CONFIG.md: the key $key (src/config/keys.c) is not documented"
    done
else
    report "docs/CONFIG.md: missing (it documents every key of src/config/keys.c)"
fi

# Check 3: docs/DESIGN.md's layer table is the order of the includes. Each row's folder
# (src/NAME/) and public headers (`x.h`); a file of a layer that includes the header of a
# layer further down the table is reported.
if [ -f docs/DESIGN.md ]; then
    layers=$(awk '/^## Layers/ { f = 1 } f && /^\| [a-z]/ && !/^\| layer/ { print } f && /^## / && !/Layers/ { exit }' \
        docs/DESIGN.md | sed -nE 's/^\| [^|]+ \| `src\/([a-z]+)\/` \|.*\| ([^|]*) \|$/\1 \2/p' | tr -d '`,')
    [ -n "$layers" ] || report "docs/DESIGN.md: no layer table found under ## Layers"
    rank=0
    declare -A layer_of_header layer_rank
    while read -r folder headers; do
        layer_rank[$folder]=$rank
        rank=$((rank + 1))
        for h in $headers; do [ "$h" = "—" ] || layer_of_header[$h]=$folder; done
    done <<LAYERS
$layers
LAYERS
    sources=$(find src include/hypertrain -type f \( -name '*.[ch]' -o -name '*.cu' -o -name '*.cuh' \) | LC_ALL=C sort)
    for f in $sources; do
        if [ "${f#include/}" != "$f" ]; then
            own=${layer_of_header[$(basename "$f")]:-}
        else
            own=$(echo "$f" | cut -d/ -f2)
        fi
        [ -n "$own" ] && [ -n "${layer_rank[$own]:-}" ] || continue
        for h in $(sed -nE 's/^#include "hypertrain\/([a-z_]+\.h)".*/\1/p' "$f"); do
            to=${layer_of_header[$h]:-}
            [ -n "$to" ] || continue
            if [ "${layer_rank[$to]}" -gt "${layer_rank[$own]}" ]; then
                report "$f: includes hypertrain/$h of layer $to, below its own ($own) in docs/DESIGN.md's layer table"
            fi
        done
        # another layer's insides (the CPU's GEMM, kernels/cpu/gemm.h, say) are reached through its public header
        for h in $(sed -nE 's/^#include "([a-z_]+)\/[a-z_/]+\.(h|cuh)".*/\1/p' "$f"); do
            if [ "$h" != hypertrain ] && [ "$h" != "$own" ] && [ -n "${layer_rank[$h]:-}" ]; then
                report "$f: includes an internal header of layer $h (src/$h/): a layer reaches another through its public header"
            fi
        done
    done
fi

if [ "$failures" -gt 0 ]; then
    echo "check_doc_citations: $failures problem(s)"
    exit 1
fi
echo "check_doc_citations: every cited document and section exists; docs/CONFIG.md documents all $(printf '%s\n' "$keys" | wc -l) keys"
