#!/usr/bin/env bash
# Two "hosts" on one machine: network namespaces joined by a veth pair, MPI
# between them over TCP only (no shared memory), started by mpirun through a
# launch agent that enters the other namespace. A sharded float32 run of a
# tiny model on the two hosts must report one rank per node and match the
# one-process run step for step. Needs root (ip netns) and a built
# build/release/hypertrain; cleans up on every exit path.
#   scripts/two-hosts.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$PWD/build/release/hypertrain
[ -x "$bin" ] || { echo "two-hosts: build first (make build)" >&2; exit 1; }
command -v ip >/dev/null || { echo "two-hosts: needs iproute2 (ip)" >&2; exit 1; }

tag=ht$$ # unique names: two runs at once do not collide
a=${tag}a b=${tag}b net=10.77.$(($$ % 250)).
work=$(mktemp -d)
cleanup() {
  ip netns del "$a" 2>/dev/null || true
  ip netns del "$b" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

ip netns add "$a"
ip netns add "$b"
ip link add "${tag}x" type veth peer name "${tag}y"
ip link set "${tag}x" netns "$a"
ip link set "${tag}y" netns "$b"
ip -n "$a" addr add "${net}1/24" dev "${tag}x"
ip -n "$b" addr add "${net}2/24" dev "${tag}y"
for ns in "$a" "$b"; do
  ip -n "$ns" link set lo up
done
ip -n "$a" link set "${tag}x" up
ip -n "$b" link set "${tag}y" up

# mpirun's rsh launcher calls: agent [options] HOST COMMAND...; the agent runs
# COMMAND inside HOST's namespace instead of over ssh.
cat > "$work/agent.sh" <<AGENT
#!/bin/sh
while [ \$# -gt 0 ]; do case "\$1" in -*) shift;; *) break;; esac; done
host=\$1; shift
case "\$host" in ${net}1) ns=$a;; ${net}2) ns=$b;; *) echo "agent: unknown host \$host" >&2; exit 1;; esac
exec ip netns exec "\$ns" /bin/sh -c "\$*"
AGENT
chmod +x "$work/agent.sh"
printf '%s1 slots=1\n%s2 slots=1\n' "$net" "$net" > "$work/hosts"
for _ in $(seq 400); do echo 'Two hosts, one model: the ranks talk over TCP between network namespaces.'; done > "$work/corpus.txt"
cat > "$work/run.yaml" <<YAML
model: {name: llama, vocab_size: 256, hidden_size: 32, intermediate_size: 48, num_hidden_layers: 2,
        num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 32, attention_bias: false}
model_init_dtype: float32
data: {path: $work/corpus.txt, seq_len: 16, valid_fraction: 0.1}
training: {steps: 6, local_batch_size: 2, global_batch_size: 4, eval_interval: 0, log_interval: 1}
fsdp_config: {mix_precision: {param_dtype: float32}}
checkpoint: {save_interval: 0}
YAML

losses() { grep -oE '\| loss [0-9.]+' "$1" | awk '{print $3}'; }
"$bin" train "$work/run.yaml" --set checkpoint.output_dir="$work/one" > "$work/one.log" 2>&1 ||
  { tail -20 "$work/one.log"; echo "two-hosts: FAIL (one process)"; exit 1; }
if ! timeout 300 ip netns exec "$a" mpirun --allow-run-as-root --hostfile "$work/hosts" -np 2 \
    --mca plm_rsh_agent "$work/agent.sh" --mca btl tcp,self \
    --mca btl_tcp_if_include "${net}0/24" --mca oob_tcp_if_include "${net}0/24" \
    "$bin" train "$work/run.yaml" --set checkpoint.output_dir="$work/two" > "$work/two.log" 2>&1; then
  tail -30 "$work/two.log"
  echo "two-hosts: FAIL (mpirun across the namespaces)"
  exit 1
fi
grep -q 'Processes: 2 rank(s) (MPI), 1 on this node' "$work/two.log" ||
  { grep Processes "$work/two.log"; echo "two-hosts: FAIL (the ranks did not run on two nodes)"; exit 1; }
grep -q 'fully sharded' "$work/two.log" || { echo "two-hosts: FAIL (not sharded)"; exit 1; }
paste <(losses "$work/one.log") <(losses "$work/two.log") > "$work/losses"
[ "$(wc -l < "$work/losses")" -eq 6 ] || { cat "$work/losses"; echo "two-hosts: FAIL (expected 6 steps)"; exit 1; }
awk '{ d = $1 - $2; if (d < 0) d = -d; if (d > 2e-4 * $1 + 1e-4) bad = 1 } END { exit bad }' "$work/losses" ||
  { cat "$work/losses"; echo "two-hosts: FAIL (losses differ from one process)"; exit 1; }
echo "two-hosts: PASS (2 ranks on 2 network namespaces over TCP, sharded; 6 losses match one process)"
