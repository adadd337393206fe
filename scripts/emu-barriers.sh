#!/usr/bin/env bash
# Whether the emulated device (tests/emu/) sees a missing barrier: each
# __syncthreads of the CUDA backend (src/kernels/cuda/) removed in turn, in a
# copy of the tree, test_kernels_emu rebuilt and run on the backend's entries
# in each of the scheduler's thread orders (HT_EMU_ORDER). A line a barrier:
#   flash.cu:161 forward:missed reverse:missed warps:CAUGHT
# "missed" everywhere means the tests never see that barrier's absence: it
# guards nothing they run, or nothing at all. Some 20 minutes on two cores.
#   scripts/emu-barriers.sh [ORDERS...]     (default: forward reverse warps)
set -uo pipefail
cd "$(dirname "$0")/.."
orders=("${@:-forward reverse warps}")
read -r -a orders <<<"${orders[*]}"
work=$(mktemp -d /tmp/emu-barriers.XXXXXX)
trap 'rm -rf "$work"' EXIT
git ls-files -z | xargs -0 cp --parents -t "$work"
cmake -S "$work" -B "$work/build" -DCMAKE_BUILD_TYPE=Release >/dev/null || exit 1
cmake --build "$work/build" -j"$(nproc)" --target test_kernels_emu >/dev/null 2>&1 || {
    echo "emu-barriers: the unchanged tree does not build" >&2
    exit 1
}
grep -n "__syncthreads();" "$work"/src/kernels/cuda/*.cu "$work"/src/kernels/cuda/*.cuh |
    while IFS=: read -r file line _; do
        cp -p "$file" "$file.orig"
        sed -i "${line}s/__syncthreads();/(void)0;/" "$file"
        result=""
        if cmake --build "$work/build" -j"$(nproc)" --target test_kernels_emu >"$work/build.log" 2>&1; then
            for o in "${orders[@]}"; do
                if HT_TEST_FILTER="test_backend_*" HT_EMU_ORDER=$o OMP_NUM_THREADS=2 timeout 600 \
                    "$work/build/test_kernels_emu" >"$work/run.log" 2>&1; then
                    result+=" $o:missed"
                else
                    result+=" $o:CAUGHT"
                fi
            done
        else
            result=" (did not build)"
        fi
        echo "$(basename "$file"):$line$result"
        mv "$file.orig" "$file"
        touch "$file" # newer than the objects of the changed copy: rebuilt next time
    done
