#!/usr/bin/env bash
# A host that vanishes mid-run, without closing its connections (power, a cable): LayUp on the
# digits across 3 "hosts" x 2 CPU devices (scripts/cluster_drill.sh, links shaped at RATE). At
# FRACTION of the steps host 2's own link is first slowed to SLOW for 4 s, so that transfers
# from it are in flight, then taken down and its process SIGKILLed: its FIN/RST never reach
# the others, as when a host loses power. Passes when the two survivors end with status 0
# (the drill's status is then host 2's, 137), process 0 names the lost process once, and the
# run's summary exists; prints what happened and where.
#
#   sudo PYTHON=.venv/bin/python bash scripts/vanish_drill.sh [--steps 1500] [--at 0.4] [--rate 20mbit] [--slow 200kbit]
#                                     [--workdir runs/vanish] [-- <more train arguments>]
set -uo pipefail
cd "$(dirname "$0")/.."
STEPS=1500 AT=0.4 RATE=20mbit SLOW=200kbit WORK=runs/vanish
while [ $# -gt 0 ]; do
  case $1 in
    --steps) STEPS=$2; shift 2 ;;
    --at) AT=$2; shift 2 ;;
    --rate) RATE=$2; shift 2 ;;
    --slow) SLOW=$2; shift 2 ;;
    --workdir) WORK=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "error: unknown option $1 (see the script's header)" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" = 0 ] || { echo "error: run as root: the drill creates network namespaces" >&2; exit 2; }
rm -rf "$WORK"
log=$(mktemp)
started=$(date +%s.%N)
elapsed() { awk "BEGIN { printf \"%.1f\", $(date +%s.%N) - $started }"; }
bash scripts/cluster_drill.sh --hosts 3 --devices-per-host 2 --rate "$RATE" -- \
    --config configs/digits.py --workdir "$WORK" --config.num_devices=6 \
    --config.num_steps="$STEPS" --config.eval_every=60 --config.progress_bar=False \
    --config.distributed.heartbeat_timeout_s=5 --config.distributed.remote_peer_probability=0.3 \
    "$@" > "$log" 2>&1 &
drill=$!
at=$(awk "BEGIN { print int($STEPS * $AT) }")
until python3 - "$WORK/metrics.jsonl" "$at" 2> /dev/null << 'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
sys.exit(0 if any(r["split"] == "test" and r["step"] >= int(sys.argv[2]) for r in rows) else 1)
EOF
do
  kill -0 "$drill" 2> /dev/null || { echo "error: the run ended before step $at"; cat "$log"; exit 1; }
  sleep 0.3
done
echo "$(elapsed) s: step >= $at; host 2's link slowed to $SLOW for 4 s"
ip netns exec layup_host2 tc qdisc change dev layup_h2 root tbf rate "$SLOW" burst 16kb latency 20s
sleep 4
echo "$(elapsed) s: host 2's link down, its process SIGKILLed"
ip link set layup_b2 down
ip netns pids layup_host2 | xargs -r kill -9
wait "$drill"; status=$?
echo "$(elapsed) s: the drill ended with status $status (host 2's: 137 when the survivors ended with 0)"
grep -v "Extension modules" "$log" | grep -E "lost at step|in flight|layup on|error|did not stop|Traceback" | cut -c1-200
lost=$(grep -c "process 2 lost at step" "$log")
rm -f "$log"
[ "$status" = 137 ] && [ "$lost" = 1 ] && [ -f "$WORK/summary.json" ] \
  && { echo "vanish drill: the survivors trained to the end"; exit 0; }
echo "vanish drill: FAILED (status $status, $lost lost lines)"; exit 1
