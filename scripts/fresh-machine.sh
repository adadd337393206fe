#!/usr/bin/env bash
# Fresh-machine check: proves the README's two commands work on a brand-new
# Debian 12 machine. It builds a minimal bookworm root (minbase + git, make,
# ca-certificates: what a user has once they have cloned), clones the commit
# under test into it, and runs, as root inside it, `make train STEPS=N` and then
# `make test`. Everything the build needs must therefore come from
# scripts/install-deps.sh, not from whatever this host happens to have.
#
#   scripts/fresh-machine.sh [COMMIT]      # default: HEAD of this repository
#
# Only committed work is checked: the root gets a git clone, never this working
# tree. Environment: FRESH_STEPS (training steps, default 20), FRESH_TIMEOUT
# (seconds for the whole check, default 2400: `make test` alone took 769 s
# in November, past 832 s once context parallelism's multi-rank cases joined
# test_dist, 1211 s with tensor parallelism's and the six-run noise floors in
# December, and the Python package's install builds the library once more),
# FRESH_TMPDIR (where the root goes,
# default $TMPDIR or /var/tmp), FRESH_LOGS (a directory that keeps every phase's
# full log; by default they go with the root). Needs root (mmdebstrap, mount, chroot).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
commit=${1:-HEAD}
steps=${FRESH_STEPS:-20}
timeout_total=${FRESH_TIMEOUT:-2400}
tmp_base=${FRESH_TMPDIR:-${TMPDIR:-/var/tmp}}
keep_logs=${FRESH_LOGS:-}
suite=bookworm
min_free_gib=4 # measured: the root peaks near 1.7 GiB (toolchains, three builds)
src=/root/hypertrain # the clone, as seen from inside the root
started=$SECONDS

log() { printf '[fresh-machine %s +%4ds] %s\n' "$(date +%H:%M:%S)" $((SECONDS - started)) "$*"; }
failure=""
die() {
  failure=$*
  log "error: $*"
  exit 1
}

# ---------------------------------------------------------------- cleanup
work=""
root=""
sha=""
phase_pid=""

mounts_under_root() {
  # Field 5 of mountinfo is the mount point; deepest first so children go before parents.
  [ -n "$root" ] || return 0
  awk -v r="$root/" 'index($5, r) == 1 { print $5 }' /proc/self/mountinfo | sort -r
}

# Runs on every exit: tears the root down, then prints the verdict as the last line.
cleanup() {
  local rc=$? t0=$SECONDS
  trap - EXIT INT TERM
  set +e
  if [ -n "$phase_pid" ]; then
    # Phases run in their own session (setsid), so this reaches make and everything it started.
    kill -TERM -- "-$phase_pid" 2>/dev/null && sleep 2
    kill -KILL -- "-$phase_pid" 2>/dev/null
    wait "$phase_pid" 2>/dev/null
  fi
  if [ -n "$root" ] && [ -d "$root" ]; then
    # Anything still running inside the root (an orphaned MPI daemon, say) would keep mounts busy.
    local p
    for p in /proc/[0-9]*; do
      [ "$(readlink "$p/root" 2>/dev/null)" = "$root" ] && kill -KILL "${p#/proc/}" 2>/dev/null
    done
    local m
    for m in $(mounts_under_root); do
      umount "$m" 2>/dev/null || umount -l "$m" || log "warning: could not unmount $m"
    done
  fi
  if [ -n "$work" ] && [ -d "$work" ]; then
    [ -n "$keep_logs" ] && mkdir -p "$keep_logs" && cp "$work"/*.log "$keep_logs"/ 2>/dev/null
    if [ -n "$(mounts_under_root)" ]; then
      # rm -rf through a bind mount of /dev or /sys would wreck the host: leave it to a human.
      log "warning: mounts remain under $root; NOT removing $work"
      rc=1
    else
      # --one-file-system: a second guard against walking into anything still mounted.
      rm -rf --one-file-system "$work" || log "warning: could not remove $work"
    fi
    log "cleaned up in $((SECONDS - t0))s"
  fi
  if [ "$rc" -eq 0 ]; then
    log "PASS: make train and make test work on a fresh Debian $suite (${sha:0:12}, $((SECONDS - started))s)"
  else
    log "FAIL: ${failure:-exit status $rc} ($((SECONDS - started))s)"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'failure=interrupted; exit 130' INT
trap 'failure=terminated; exit 143' TERM

# ---------------------------------------------------------------- phases
deadline=$((started + timeout_total))

# run_phase NAME LOG CMD...: runs CMD with its output in LOG, prints how long it
# took, and on failure prints the end of LOG and fails the check. CMD runs in
# the background so that INT/TERM reach our trap at once instead of after CMD
# ends, and under setsid so the trap can kill its whole process group (a
# background child of a non-interactive shell is no group leader, so setsid
# does not fork and the pid is the group id).
run_phase() {
  local name=$1 logfile=$2 t0=$SECONDS rc=0 left
  shift 2
  left=$((deadline - SECONDS))
  [ "$left" -gt 0 ] || die "out of time (FRESH_TIMEOUT=${timeout_total}s) before $name"
  log "$name ..."
  setsid timeout --kill-after=30 "$left" "$@" >"$logfile" 2>&1 </dev/null &
  phase_pid=$!
  wait "$phase_pid" || rc=$?
  phase_pid=""
  if [ "$rc" -ne 0 ]; then
    local why="exit $rc"
    [ "$rc" -eq 124 ] && why="out of time: FRESH_TIMEOUT=${timeout_total}s"
    # What a failing test said (cmocka's and the tests' own error lines, with context), then the log's end.
    if grep -qE '^\[  ERROR   \]|^ERROR: |runtime error|ERROR: AddressSanitizer' "$logfile"; then
      log "$name: FAILED ($why) after $((SECONDS - t0))s; its errors:"
      grep -E -B3 -A12 '^\[  ERROR   \]|^ERROR: |runtime error|ERROR: AddressSanitizer' "$logfile" | head -n 120 |
        sed 's/^/    | /'
    fi
    log "$name: FAILED ($why) after $((SECONDS - t0))s; last 40 lines of its log:"
    tail -n 40 "$logfile" | sed 's/^/    | /'
    die "$name ($why)"
  fi
  log "$name: ok in $((SECONDS - t0))s"
  timings+=("$name $((SECONDS - t0))s")
}
timings=()

# ---------------------------------------------------------------- the host
[ "$(id -u)" -eq 0 ] || die "must run as root (mmdebstrap, mount and chroot need it)"
case $steps in '' | *[!0-9]*) die "FRESH_STEPS must be a number, not '$steps'" ;; esac
sha=$(git -C "$repo" rev-parse --verify --quiet "${commit}^{commit}") || die "no such commit: $commit"
log "checking $(git -C "$repo" log -1 --format='%h %s' "$sha")"

if ! command -v mmdebstrap >/dev/null; then
  log "installing mmdebstrap on the host"
  if ! apt_out=$(apt-get update -qq 2>&1 &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap 2>&1); then
    printf '%s\n' "$apt_out" | tail -n 20
    die "could not install mmdebstrap"
  fi
fi

# The mirror is whatever this host's apt already uses for Debian itself (so a
# snapshot, a local mirror or a proxy host carry over); third-party repositories
# are left out, a fresh machine has none. apt only knows a source's Origin once
# its Release file has been fetched, hence the one update when nothing matches.
debian_sources() {
  # shellcheck disable=SC2016 # $(...) are apt's format fields, not the shell's
  apt-get indextargets --format '$(TARGET_OF) $(REPO_URI) $(RELEASE) $(COMPONENT)' \
    'Identifier: Packages' 'Origin: Debian' |
    awk -v s="$suite" 'NF == 4 && $1 == "deb" && ($3 == s || index($3, s "-") == 1) {
      key = $1 " " $2 " " $3
      if (!(key in comps)) { order[++n] = key; comps[key] = $4 }
      else if (index(" " comps[key] " ", " " $4 " ") == 0) comps[key] = comps[key] " " $4
    } END { for (i = 1; i <= n; i++) print order[i], comps[order[i]] }'
}
sources=$(debian_sources)
if [ -z "$sources" ]; then
  apt-get update -qq
  sources=$(debian_sources)
fi
[ -n "$sources" ] || die "found no Debian $suite source in this host's apt configuration"

mkdir -p "$tmp_base"
free_kib=$(df -Pk "$tmp_base" | awk 'NR == 2 { print $4 }')
[ "$free_kib" -ge $((min_free_gib * 1024 * 1024)) ] ||
  die "$tmp_base has $((free_kib / 1024 / 1024)) GiB free, the check needs ${min_free_gib} GiB (set FRESH_TMPDIR)"
work=$(mktemp -d "$tmp_base/fresh-machine.XXXXXX")
root=$work/root
printf '%s\n' "$sources" >"$work/sources.list"
log "work dir $work; Debian sources:"
sed 's/^/    /' "$work/sources.list"

# ---------------------------------------------------------------- the check
run_phase "mmdebstrap" "$work/mmdebstrap.log" \
  mmdebstrap --variant=minbase --include=git,make,ca-certificates "$suite" "$root" "$work/sources.list"

# A clone, not a copy: uncommitted and ignored files of this tree stay out.
# shellcheck disable=SC2016 # expanded by the inner bash, from its arguments
run_phase "clone" "$work/clone.log" \
  bash -c 'git clone --no-checkout "$1" "$2" && git -C "$2" checkout --detach "$3"' _ "$repo" "$root$src" "$sha"

# What a booted machine has and a bare root lacks: OpenMP, Open MPI and hwloc look
# at /proc, /sys and /dev/shm, and apt needs name resolution.
for m in proc sys dev dev/pts dev/shm; do
  mkdir -p "$root/$m"
  mount --bind "/$m" "$root/$m"
done
cp -L /etc/resolv.conf "$root/etc/resolv.conf"
# Every installed Debian has /etc/hosts (the installer writes it, no package
# ships it) and a bare root has none: then even localhost is asked of DNS, and
# each MPI_Init of a process started without mpirun waits out the resolver's
# 5 s timeout (measured: test_dist 143 s instead of 14 s).
if [ ! -s "$root/etc/hosts" ]; then
  name=$(cat "$root/etc/hostname" 2>/dev/null || hostname)
  printf '127.0.0.1\tlocalhost\n127.0.1.1\t%s\n::1\tlocalhost ip6-localhost ip6-loopback\n' "$name" >"$root/etc/hosts"
fi
# A clean environment, as after a fresh login: nothing of this host's or CI's leaks in.
in_root=(chroot "$root" /usr/bin/env -i HOME=/root TERM=dumb LANG=C.UTF-8
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin)

run_phase "make train STEPS=$steps" "$work/train.log" "${in_root[@]}" bash -c "cd $src && make train STEPS=$steps"

# The run must have left what the README promises: the final weights, a
# checkpoint at the last step (so STEPS reached the trainer), and the loss plot
# at the path it printed.
final=$(sed -n 's/.*saved the final weights .* to \(.*\)$/\1/p' "$work/train.log" | tail -n 1)
plot=$(sed -n 's/.*loss curve: \(.*\)$/\1/p' "$work/train.log" | tail -n 1)
[ -n "$final" ] || die "make train did not print where the final weights are"
[ -n "$plot" ] || die "make train did not print where the loss curve is"
out=$root$src/$(dirname "$final")
want=$(printf 'step_%08d' "$steps")
for f in "$root$src/$final/config.json" "$root$src/$final/model.safetensors" "$root$src/$plot" \
  "$out/latest" "$out/$want/metadata.json" "$out/metrics.jsonl"; do
  [ -s "$f" ] || die "make train: ${f#"$root"} is missing or empty"
done
[ "$(cat "$out/latest")" = "$want" ] || die "make train: latest is '$(cat "$out/latest")', expected $want"
log "train outputs: $final, $(dirname "$final")/$want, $plot"

# The Python package from the clone, as the README installs it (into a venv; without torch, whose wheels
# are several GB: its tests say they were skipped), its extension module loading and computing.
run_phase "python package" "$work/python.log" "${in_root[@]}" bash -c \
  "cd $src && PYTHON=/usr/bin/python3 scripts/python-install-check.sh /root/hypertrain-venv"
grep 'python package:' "$work/python.log" | sed 's/^/    /' || true

run_phase "make test" "$work/test.log" "${in_root[@]}" bash -c "cd $src && make test"
# The suite's own verdict, for the CI log.
grep -E 'tests passed|tests failed' "$work/test.log" | sed 's/^/    /' || true

log "timings: $(printf '%s; ' "${timings[@]}")total so far $((SECONDS - started))s"
