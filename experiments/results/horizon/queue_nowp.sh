#!/bin/bash
# Issue 61: is weight prediction worth its step? The default without it (pipemare-noWP) at
# 2,400 steps, P = 4 and 8, three seeds, at one device's rate, the same frozen code as the
# default's runs (queue_lib.sh), written to experiments/results/horizon_nowp. Two lists so two
# runs go at once (a, b).
# Started with, once for a and once for b: nohup setsid experiments/results/horizon/queue_nowp.sh a >> experiments/results/horizon_nowp/logs/queue.log 2>&1 < /dev/null &
# Its curves were moved to experiments/results/horizon afterwards: a rerun here trains again.
export HORIZON_OUT=experiments/results/horizon_nowp
source "$(dirname "$0")/queue_lib.sh"
if [ "${1:-a}" = b ]; then SPECS=("pipemare-noWP 8 - 0 2400 -" "pipemare-noWP 8 - 1 2400 -" "pipemare-noWP 4 - 2 2400 -")
else SPECS=("pipemare-noWP 4 - 0 2400 -" "pipemare-noWP 4 - 1 2400 -" "pipemare-noWP 8 - 2 2400 -"); fi
for spec in "${SPECS[@]}"; do run_one $spec; done
