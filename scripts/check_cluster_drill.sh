#!/usr/bin/env bash
# Checks that scripts/cluster_drill.sh leaves nothing behind: after a normal exit, after SIGINT
# and SIGTERM mid-run, after a failing process, after a host whose link went down, and after
# scripts/bench_cluster.py is interrupted mid-run, no layup_host* namespace, layup_* link or
# /etc/netns entry remains; it also checks the refusals. The training command is replaced by a
# stand-in (PYTHON=...) so that the check takes seconds. Needs root.
#
#   sudo bash scripts/check_cluster_drill.sh
set -uo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "error: run as root: the drill creates network namespaces" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
printf '#!/bin/bash\nexit 0\n' > "$work/ok"
printf '#!/bin/bash\nexit 3\n' > "$work/fails"
printf '#!/bin/bash\nsleep 30\n' > "$work/sleeps"
chmod +x "$work/ok" "$work/fails" "$work/sleeps"
failures=0

left_over() {  # prints what the drill left behind, if anything
  ip netns list | grep -o 'layup_host[0-9]*' || true
  ip -o link show | grep -o 'layup_[a-z0-9]*' || true
  ls /etc/netns 2> /dev/null | grep layup_ || true
}
check() {  # check NAME EXPECTED_STATUS ACTUAL_STATUS
  local remains
  remains=$(left_over | tr '\n' ' ')
  if [ "$2" != "$3" ] || [ -n "$remains" ]; then
    echo "FAIL $1: status $3 (expected $2), left behind: ${remains:-nothing}"
    failures=$((failures + 1))
  else
    echo "ok   $1: status $3, nothing left behind"
  fi
}
drill() { bash scripts/cluster_drill.sh --hosts 3 --devices-per-host 1 --rate 20mbit -- x; }

PYTHON="$work/ok" drill > /dev/null 2>&1; check "normal exit" 0 $?
PYTHON="$work/fails" drill > /dev/null 2>&1; check "a failing process" 3 $?
for signal in INT TERM; do
  # In its own process group with SIGINT at its default (a script's background job ignores it).
  PYTHON="$work/sleeps" python3 -c 'import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
os.setsid()
os.execvp("bash", ["bash", "scripts/cluster_drill.sh", "--hosts", "3", "--devices-per-host", "1",
                   "--rate", "20mbit", "--", "x"])' > /dev/null 2>&1 &
  pid=$!
  for _ in $(seq 50); do ip netns pids layup_host2 2> /dev/null | grep -q . && break; sleep 0.1; done
  kill -"$signal" -- -"$pid"  # the whole process group, as a terminal's Ctrl-C does
  wait "$pid"; status=$?
  check "SIG$signal mid-run" $([ "$signal" = INT ] && echo 130 || echo 143) "$status"
done
# A host whose link goes down, then its process killed (a vanished host): its socket towards
# host 0, still closing, holds its namespace (and veth pair) for minutes after `ip netns del`.
cat > "$work/vanishes" << 'EOF_STANDIN'
#!/bin/bash
case "${@: -1}" in
  *process_id=0) exec python3 -c 'import socket, time
server = socket.create_server(("10.231.1.1", 12399)); server.settimeout(10)
peer = server.accept()[0]; time.sleep(4)' ;;
  *process_id=2) exec python3 -c 'import pathlib, socket, sys, time
time.sleep(0.5); peer = socket.create_connection(("10.231.1.1", 12399))
peer.sendall(b"x" * 65536); pathlib.Path(sys.argv[1]).touch(); time.sleep(30)' "$LAYUP_CONNECTED" ;;
  *) sleep 4 ;;
esac
EOF_STANDIN
chmod +x "$work/vanishes"
PYTHON="$work/vanishes" LAYUP_CONNECTED="$work/connected" drill > /dev/null 2>&1 &
pid=$!
for _ in $(seq 100); do [ -e "$work/connected" ] && break; sleep 0.1; done
ip link set layup_b2 down
ip netns pids layup_host2 2> /dev/null | xargs -r kill -9
wait "$pid"; status=$?; [ -e "$work/connected" ] || echo "the stand-in of host 2 never connected"
check "a host whose link went down, then killed" 137 "$status"

# scripts/bench_cluster.py interrupted mid-run: by a terminal's Ctrl-C (SIGINT to the whole
# process group, the drill included) and by SIGINT to bench_cluster.py alone. Either way it must
# let the drill clean up (subprocess.run would SIGKILL the drill 0.25 s after the interrupt,
# which, interrupted alone, never starts its cleanup) and write the table of what finished.
bench_python=python3; [ -x .venv/bin/python ] && bench_python=.venv/bin/python
for target in group process; do
  rm -f "$work/bench.json"
  PYTHON="$work/sleeps" "$bench_python" -c 'import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
os.setsid()
os.execvp(sys.argv[1], sys.argv[1:])' "$bench_python" scripts/bench_cluster.py --layouts 3x1 \
    --rates 20mbit --algorithms layup --repeats 1 --out "$work/bench.json" > /dev/null 2>&1 &
  pid=$!
  for _ in $(seq 100); do ip netns pids layup_host2 2> /dev/null | grep -q . && break; sleep 0.1; done
  [ "$target" = group ] && kill -INT -- -"$pid" || kill -INT "$pid"
  wait "$pid"; status=$?
  grep -q '"stopped": true' "$work/bench.json" 2> /dev/null || {
    echo "FAIL bench_cluster.py interrupted ($target): no table marked stopped"
    failures=$((failures + 1))
  }
  check "bench_cluster.py interrupted mid-run ($target)" 130 "$status"
done

ip netns add layup_host1
bash scripts/cluster_drill.sh --hosts 2 --devices-per-host 1 -- x 2> "$work/err"; status=$?
ip netns del layup_host1
grep -q "namespace layup_host1 exists" "$work/err" && check "refused: namespace exists" 2 $status \
  || { echo "FAIL refused: namespace exists: $(cat "$work/err")"; failures=$((failures + 1)); }
ip link add layup_h1 type veth peer name layup_x1  # a veth end a killed drill left behind
bash scripts/cluster_drill.sh --hosts 2 --devices-per-host 1 -- x 2> "$work/err"; status=$?
ip link del layup_h1 2> /dev/null
grep -q "link layup_h1 exists" "$work/err" && check "refused: a veth end exists" 2 $status \
  || { echo "FAIL refused: a veth end exists: $(cat "$work/err")"; failures=$((failures + 1)); }
ip link show layup_br > /dev/null 2>&1 && { echo "FAIL refused drill left its bridge"; failures=$((failures + 1)); }
bash scripts/cluster_drill.sh --hosts 1 --devices-per-host 1 -- x 2> /dev/null; check "refused: one host" 2 $?
bash scripts/cluster_drill.sh --hosts 2 --devices-per-host 1 --cpus-per-host 100000 -- x 2> "$work/err"
status=$?
grep -q "needs 200000 CPUs" "$work/err" && check "refused: more CPUs than there are" 2 $status \
  || { echo "FAIL refused: more CPUs than there are: $(cat "$work/err")"; failures=$((failures + 1)); }
# --cpus-per-host: each host's process may run on CPUs of its own, none shared.
if [ "$(nproc)" -ge 2 ]; then
  printf '#!/bin/bash\ngrep Cpus_allowed_list /proc/self/status | cut -f2 > "$LAYUP_CPUS.${@: -1}"\n' \
      > "$work/cpus"
  chmod +x "$work/cpus"
  PYTHON="$work/cpus" LAYUP_CPUS="$work/cpus_of" bash scripts/cluster_drill.sh --hosts 2 \
      --devices-per-host 1 --cpus-per-host 1 -- x > /dev/null 2>&1; status=$?
  first=$(cat "$work/cpus_of.--config.distributed.process_id=0" 2> /dev/null)
  second=$(cat "$work/cpus_of.--config.distributed.process_id=1" 2> /dev/null)
  if [[ "$first" =~ ^[0-9]+$ && "$second" =~ ^[0-9]+$ && "$first" != "$second" ]]; then
    check "a CPU of its own per host ($first and $second)" 0 $status
  else
    echo "FAIL a CPU of its own per host: '$first' and '$second'"; failures=$((failures + 1))
  fi
fi
[ "$failures" = 0 ] && echo "cluster_drill.sh: every check passed" || echo "cluster_drill.sh: $failures failed"
exit $((failures > 0))
