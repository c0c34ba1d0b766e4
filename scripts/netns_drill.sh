#!/usr/bin/env bash
# Two "hosts" on one machine, unshaped: scripts/cluster_drill.sh with --hosts 2 (kept for the
# commands that name it). Needs root and iproute2.
#
#   sudo bash scripts/netns_drill.sh [--devices-per-process 4] -- --config configs/digits.py \
#       --workdir runs/netns --config.algorithm=ddp
set -euo pipefail
PER_PROCESS=4
if [ "${1:-}" = "--devices-per-process" ]; then PER_PROCESS=$2; shift 2; fi
[ "${1:-}" = "--" ] && shift
exec bash "$(dirname "$0")/cluster_drill.sh" --hosts 2 --devices-per-host "$PER_PROCESS" -- "$@"
