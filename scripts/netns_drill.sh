#!/usr/bin/env bash
# Two "hosts" on one machine: two network namespaces joined by a veth pair (10.231.0.1 and
# 10.231.0.2), one training process in each, talking over that link only (the coordinator at
# 10.231.0.1; gloo's collectives find each process's address through its hostname, which the
# namespace's own /etc/netns/<ns>/hosts maps to that address). Everything it creates (the two
# namespaces, the veth pair, /etc/netns/<ns>) is removed on exit. Needs root and iproute2.
#
#   sudo bash scripts/netns_drill.sh [--devices-per-process 4] -- --config configs/digits.py \
#       --workdir runs/netns --config.algorithm=ddp
#
# Process 0's output is shown, process 1's prefixed [p1]; exits with the first failure's status.
set -euo pipefail
cd "$(dirname "$0")/.."
PER_PROCESS=4
if [ "${1:-}" = "--devices-per-process" ]; then PER_PROCESS=$2; shift 2; fi
[ "${1:-}" = "--" ] && shift
[ $# -gt 0 ] || { echo "error: give the train arguments after --" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "error: run as root: the drill creates network namespaces" >&2; exit 2; }
command -v ip > /dev/null || { echo "error: needs iproute2 (apt-get install iproute2)" >&2; exit 2; }

NS=(layup_drill0 layup_drill1)
ADDR=(10.231.0.1 10.231.0.2)
VETH=(layup_veth0 layup_veth1)
PORT=${LAYUP_DRILL_PORT:-12355}
for ns in "${NS[@]}"; do
  if ip netns list | grep -qw "$ns"; then
    echo "error: namespace $ns exists (a drill still running, or left over: ip netns del $ns)" >&2
    exit 2
  fi
done

[ -d /etc/netns ] && made_etc_netns=0 || made_etc_netns=1
cleanup() {
  for ns in "${NS[@]}"; do
    ip netns pids "$ns" 2> /dev/null | xargs -r kill -9 2> /dev/null || true
    ip netns del "$ns" 2> /dev/null || true
    rm -rf "/etc/netns/$ns"
  done
  if [ "$made_etc_netns" = 1 ]; then rmdir /etc/netns 2> /dev/null || true; fi
}
trap cleanup EXIT

ip link add "${VETH[0]}" type veth peer name "${VETH[1]}"
for k in 0 1; do
  ns=${NS[$k]}
  ip netns add "$ns"
  mkdir -p "/etc/netns/$ns"
  printf '127.0.0.1 localhost\n%s %s\n' "${ADDR[$k]}" "$(hostname)" > "/etc/netns/$ns/hosts"
  ip link set "${VETH[$k]}" netns "$ns"
  ip -n "$ns" addr add "${ADDR[$k]}/24" dev "${VETH[$k]}"
  ip -n "$ns" link set "${VETH[$k]}" up
  ip -n "$ns" link set lo up
done

FLAGS="$(echo "${XLA_FLAGS:-}" | tr ' ' '\n' | grep -v xla_force_host_platform_device_count | tr '\n' ' ')"
pids=()
for k in 0 1; do
  prefix=""; [ "$k" = 1 ] && prefix="[p1] "
  ip netns exec "${NS[$k]}" env XLA_FLAGS="$FLAGS --xla_force_host_platform_device_count=$PER_PROCESS" \
      PYTHONUNBUFFERED=1 "${PYTHON:-python}" -m layup_jax.train "$@" \
      "--config.distributed.coordinator_address=${ADDR[0]}:$PORT" \
      --config.distributed.num_processes=2 "--config.distributed.process_id=$k" 2>&1 \
      | sed -u "s/^/$prefix/" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
