#!/usr/bin/env bash
# Several "hosts" on one machine: N network namespaces on one bridge, one training process in
# each, every byte between processes crossing a network interface. With --rate, each host's link
# is shaped with the kernel's token bucket (tbf) in both directions (what it sends: the
# namespace's end of its veth; what it receives: the bridge's end), as a NIC of that rate would
# be. Host k is 10.231.1.(k+1); the coordinator is host 0; gloo's collectives find a process's
# address through its hostname, which the namespace's own /etc/netns/<ns>/hosts maps to it.
#
#   sudo bash scripts/cluster_drill.sh --hosts 2 --devices-per-host 4 --rate 20mbit -- \
#       --config configs/digits.py --workdir runs/cluster --config.algorithm=layup
#
# With --host-rate K=RATE (repeatable), host k's link runs at RATE instead of --rate: uneven links
# (host 1 at 5mbit, the others at 100mbit: --rate 100mbit --host-rate 1=5mbit).
#
# With --cpus-per-host C, host k's process may run only on the k-th C of the CPUs this script may
# use (taskset), as a host's own cores would be, so that no two hosts share a core; without it
# every process may run on any of them.
#
# Two unshaped hosts (what scripts/netns_drill.sh ran) are `--hosts 2` without --rate.
#
# Each process gets the caller's XLA_FLAGS (any, or none) with its own
# --xla_force_host_platform_device_count=D in place of one given there. The training command is
# `$PYTHON -m layup_jax.train` (PYTHON default: python).
#
# Process 0's output is shown, the others' prefixed [pK]. At the end one line per host gives the
# bytes it sent and received over its link (the interface's counters: everything, collectives,
# gossip and the coordination service); --stats FILE writes them as JSON. Everything it creates
# (namespaces, veth pairs, the bridge, /etc/netns/<ns>) is removed on exit, also on Ctrl-C or a
# failure; it refuses to start, in one line on stderr, if it is not root or one of its
# namespaces exists. Exits with the first failing process's status, naming it on stderr; any
# other early exit says why in one line on stderr (a refusal, an interrupt, or the command that
# failed and its line).
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then  # the comment above is the usage
  sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"
  exit 0
fi
set -Eeuo pipefail
me=cluster_drill.sh
# A command that fails where nothing expects it ends the script (set -e): the line says which.
# Only this shell's: a subshell's failure (a command substitution, a host's pipeline) comes back
# here as its own.
trap 'failed_with=$?; [ "$BASHPID" != "$$" ] || echo "error: $me: line $LINENO: \"$BASH_COMMAND\" failed with status $failed_with" >&2' ERR
cd "$(dirname "$0")/.."
usage="usage: cluster_drill.sh --hosts N --devices-per-host D [--rate RATE] [--host-rate K=RATE ...] [--cpus-per-host C] [--stats FILE] -- <train arguments>"
HOSTS="" PER_HOST="" RATE="" STATS="" CPUS_PER_HOST=""
declare -A HOST_RATE=()
while [ $# -gt 0 ]; do
  case $1 in
    --hosts|--devices-per-host|--rate|--host-rate|--cpus-per-host|--stats)
      [ $# -ge 2 ] || { echo "error: $1 takes a value; $usage" >&2; exit 2; } ;;
  esac
  case $1 in
    --hosts) HOSTS=$2; shift 2 ;;
    --devices-per-host) PER_HOST=$2; shift 2 ;;
    --rate) RATE=$2; shift 2 ;;
    --host-rate)
      [[ "$2" =~ ^[0-9]+=[0-9]+(\.[0-9]+)?(bit|kbit|mbit|gbit)$ ]] \
        || { echo "error: --host-rate takes K=RATE such as 1=5mbit, not $2" >&2; exit 2; }
      HOST_RATE[${2%%=*}]=${2#*=}; shift 2 ;;
    --cpus-per-host) CPUS_PER_HOST=$2; shift 2 ;;
    --stats) STATS=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "error: unknown option $1; $usage" >&2; exit 2 ;;
  esac
done
[[ "$HOSTS" =~ ^[0-9]+$ && "$HOSTS" -ge 2 && "$HOSTS" -le 32 ]] \
  || { echo "error: --hosts takes 2 to 32; $usage" >&2; exit 2; }
[[ "$PER_HOST" =~ ^[0-9]+$ && "$PER_HOST" -ge 1 ]] \
  || { echo "error: --devices-per-host takes a positive number; $usage" >&2; exit 2; }
[[ -z "$RATE" || "$RATE" =~ ^[0-9]+(\.[0-9]+)?(bit|kbit|mbit|gbit)$ ]] \
  || { echo "error: --rate takes a tc rate such as 20mbit or 1gbit, not $RATE" >&2; exit 2; }
[ $# -gt 0 ] || { echo "error: give the train arguments after --; $usage" >&2; exit 2; }
CPUS=()  # host k's CPU list for taskset, with --cpus-per-host
if [ -n "$CPUS_PER_HOST" ]; then
  [[ "$CPUS_PER_HOST" =~ ^[0-9]+$ && "$CPUS_PER_HOST" -ge 1 ]] \
    || { echo "error: --cpus-per-host takes a positive number; $usage" >&2; exit 2; }
  command -v taskset > /dev/null || { echo "error: --cpus-per-host needs taskset (apt-get install util-linux)" >&2; exit 2; }
  mapfile -t allowed < <(python3 -c 'import os; print(*sorted(os.sched_getaffinity(0)), sep="\n")')
  [ $((HOSTS * CPUS_PER_HOST)) -le ${#allowed[@]} ] || {
    echo "error: --hosts $HOSTS x --cpus-per-host $CPUS_PER_HOST needs $((HOSTS * CPUS_PER_HOST)) CPUs; this script may use ${#allowed[@]}" >&2; exit 2; }
  for ((k = 0; k < HOSTS; k++)); do
    CPUS+=("$(IFS=,; echo "${allowed[*]:$((k * CPUS_PER_HOST)):$CPUS_PER_HOST}")")
  done
fi
[ "$(id -u)" = 0 ] || { echo "error: run as root: the drill creates network namespaces" >&2; exit 2; }
command -v ip > /dev/null || { echo "error: needs iproute2 (apt-get install iproute2)" >&2; exit 2; }
for k in "${!HOST_RATE[@]}"; do
  [ "$k" -lt "$HOSTS" ] || { echo "error: --host-rate $k=${HOST_RATE[$k]}: there are hosts 0 to $((HOSTS - 1))" >&2; exit 2; }
done
if [ -n "$RATE" ] || [ ${#HOST_RATE[@]} -gt 0 ]; then
  command -v tc > /dev/null || { echo "error: --rate needs tc (apt-get install iproute2)" >&2; exit 2; }
fi

BRIDGE=layup_br
PORT=${LAYUP_DRILL_PORT:-12355}
NS=() ADDR=()
for ((k = 0; k < HOSTS; k++)); do NS+=("layup_host$k"); ADDR+=("10.231.1.$((k + 1))"); done
for ns in "${NS[@]}"; do
  if ip netns list | grep -qw "$ns"; then
    echo "error: namespace $ns exists (a drill still running, or left over: ip netns del $ns)" >&2
    exit 2
  fi
done
if ip link show "$BRIDGE" > /dev/null 2>&1; then
  echo "error: bridge $BRIDGE exists (a drill still running, or left over: ip link del $BRIDGE)" >&2
  exit 2
fi
# A veth end can outlive its drill by a moment: the kernel tears a deleted namespace's devices
# down asynchronously (a drill started a minute after one was killed met "RTNETLINK answers:
# File exists" here, 2026-11-27).
for ((k = 0; k < HOSTS; k++)); do
  for link in "layup_h$k" "layup_b$k"; do
    if ip link show "$link" > /dev/null 2>&1; then
      echo "error: link $link exists (a drill still running, or left over: ip link del $link)" >&2
      exit 2
    fi
  done
done

[ -d /etc/netns ] && made_etc_netns=0 || made_etc_netns=1
cleanup() {
  # A second Ctrl-C (a terminal sends one to every process of the group, and a caller may pass
  # one on) must not cut the cleanup short.
  trap '' INT TERM
  for ((k = 0; k < HOSTS; k++)); do
    ns=${NS[$k]}
    ip netns pids "$ns" 2> /dev/null | xargs -r kill -9 2> /dev/null || true
    ip netns del "$ns" 2> /dev/null || true
    # The namespace's veth pair goes with it only once nothing holds the namespace: a socket
    # still closing towards an unreachable host (a host whose link went down) keeps it for
    # minutes, and its pair with it. Deleting the bridge's end deletes the pair now.
    ip link del "layup_b$k" 2> /dev/null || true
    rm -rf "/etc/netns/$ns"
  done
  ip link del "$BRIDGE" 2> /dev/null || true
  [ -n "${STATUSES:-}" ] && rm -rf "$STATUSES"
  if [ "$made_etc_netns" = 1 ]; then rmdir /etc/netns 2> /dev/null || true; fi
}
trap cleanup EXIT
trap 'echo "error: $me: interrupted (SIGINT)" >&2; exit 130' INT
trap 'echo "error: $me: terminated (SIGTERM)" >&2; exit 143' TERM

rate_of() { echo "${HOST_RATE[$1]:-$RATE}"; }  # host k's link rate (none: unshaped)
shape() {  # shape K [ip netns exec NS] DEVICE: tbf at host K's rate on DEVICE's egress
  local rate; rate=$(rate_of "$1"); shift
  [ -z "$rate" ] && return
  "$@" root tbf rate "$rate" burst 256kb latency 200ms
}
ip link add "$BRIDGE" type bridge
ip link set "$BRIDGE" up
for ((k = 0; k < HOSTS; k++)); do
  ns=${NS[$k]}
  ip netns add "$ns"
  mkdir -p "/etc/netns/$ns"
  printf '127.0.0.1 localhost\n%s %s\n' "${ADDR[$k]}" "$(hostname)" > "/etc/netns/$ns/hosts"
  ip link add "layup_h$k" type veth peer name "layup_b$k"
  ip link set "layup_h$k" netns "$ns"
  ip link set "layup_b$k" master "$BRIDGE" up
  ip -n "$ns" addr add "${ADDR[$k]}/24" dev "layup_h$k"
  ip -n "$ns" link set "layup_h$k" up
  ip -n "$ns" link set lo up
  shape "$k" ip netns exec "$ns" tc qdisc add dev "layup_h$k"  # what host k sends
  shape "$k" tc qdisc add dev "layup_b$k"  # what host k receives
done

# The caller's XLA flags but its device count, which each process gets its own of (none given,
# only the count, or others beside it: a pipeline through `grep -v` ended the script, without a
# word, on the second).
read -r -a given <<< "${XLA_FLAGS:-}"
FLAGS=""
for flag in "${given[@]}"; do
  [[ "$flag" == *xla_force_host_platform_device_count* ]] || FLAGS+="$flag "
done
started=$(date +%s.%N)
# Each process's exit status goes to a file: `wait` on a background pipeline that ended while
# the script waited for another returns its last command's status (sed's), not the process's.
# The process's own output goes through sed; the subshell's (bash's "Killed" with the whole
# command line, for a process killed by a signal) is dropped: the status names it.
STATUSES=$(mktemp -d)
# The run's secret (layup_jax/multiprocess/signed.py): every host's process gets the same one.
export LAYUP_JAX_RUN_SECRET=${LAYUP_JAX_RUN_SECRET:-$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')}
pids=()
for ((k = 0; k < HOSTS; k++)); do
  prefix=""; [ "$k" -gt 0 ] && prefix="[p$k] "
  pin=(); [ -n "$CPUS_PER_HOST" ] && pin=(taskset -c "${CPUS[$k]}")
  { ip netns exec "${NS[$k]}" "${pin[@]}" env XLA_FLAGS="$FLAGS--xla_force_host_platform_device_count=$PER_HOST" \
      PYTHONUNBUFFERED=1 "${PYTHON:-python}" -m layup_jax.train "$@" \
      "--config.distributed.coordinator_address=${ADDR[0]}:$PORT" \
      "--config.distributed.num_processes=$HOSTS" "--config.distributed.process_id=$k" 2>&1 \
      && echo 0 > "$STATUSES/$k" || echo $? > "$STATUSES/$k"; } 2> /dev/null | sed -u "s/^/$prefix/" &
  pids+=($!)
done
wait "${pids[@]}" || true
status=0 failed=""
for ((k = 0; k < HOSTS; k++)); do
  code=$(cat "$STATUSES/$k" 2> /dev/null || echo 1)
  if [ "$status" = 0 ] && [ "$code" != 0 ]; then status=$code failed=$k; fi
done
elapsed=$(awk "BEGIN { print $(date +%s.%N) - $started }")

counter() { ip netns exec "${NS[$1]}" cat "/sys/class/net/layup_h$1/statistics/$2"; }
entries=()
for ((k = 0; k < HOSTS; k++)); do
  sent=$(counter "$k" tx_bytes) received=$(counter "$k" rx_bytes)
  rate=$(rate_of "$k")
  echo "host $k (${ADDR[$k]}) sent $((sent / 1000)) kB, received $((received / 1000)) kB over its link${rate:+ ($rate)}"
  entries+=("{\"host\": $k, \"address\": \"${ADDR[$k]}\", \"rate\": \"${rate:-unshaped}\", \"tx_bytes\": $sent, \"rx_bytes\": $received}")
done
if [ -n "$STATS" ]; then
  joined=$(IFS=,; echo "${entries[*]}")
  printf '{"hosts": %d, "devices_per_host": %d, "rate": "%s", "cpus_per_host": %s, "wall_s": %s, "status": %d, "links": [%s]}\n' \
      "$HOSTS" "$PER_HOST" "${RATE:-unshaped}" "${CPUS_PER_HOST:-null}" "$elapsed" "$status" "$joined" > "$STATS"
fi
if [ "$status" != 0 ]; then
  echo "error: $me: process $failed (host $failed) ended with status $status" >&2
fi
exit "$status"
