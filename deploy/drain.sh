#!/usr/bin/env bash
# Drain the router before Ray stops: SIGTERM to the `pdserve serve` whose pid the head's start
# command wrote to PIDFILE, then wait until it exits, at most WAIT_S seconds. The router turns
# its health NOT_SERVING, refuses new requests with a retry hint and lets running ones finish
# within its grace period (30 s by default) before it exits; WAIT_S leaves a margin over that.
# Run by the head's start commands before `ray stop` (`ray up` on a running cluster) and by the
# `ray` of deploy/ray-shell.sh before `ray stop` (what `ray down` runs on the head over SSH).
#
# Usage: deploy/drain.sh [PIDFILE] [WAIT_S]   (defaults ~/pdserve.pid, $PDSERVE_DRAIN_S or 45)
#   exit 0: nothing to drain, or drained; 1: still running after WAIT_S (Ray stops it anyway).
set -uo pipefail
pidfile=${1:-$HOME/pdserve.pid}
wait_s=${2:-${PDSERVE_DRAIN_S:-45}}
[[ -f "$pidfile" ]] || exit 0
pid=$(cat "$pidfile")
# only the recorded process, and only while it is a `pdserve serve` (a pid may be reused)
is_serve() { [[ "$pid" =~ ^[0-9]+$ ]] && tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -q 'pdserve serve'; }
if ! is_serve; then rm -f "$pidfile"; exit 0; fi
echo "drain: SIGTERM to pdserve serve (pid $pid); waiting up to ${wait_s}s for its requests"
kill -TERM "$pid" 2>/dev/null
for ((i = 0; i < wait_s * 10; i++)); do
  if ! is_serve; then rm -f "$pidfile"; echo "drain: pdserve serve exited"; exit 0; fi
  sleep 0.1
done
echo "drain: pdserve serve still running after ${wait_s}s; stopping Ray anyway" >&2
exit 1
