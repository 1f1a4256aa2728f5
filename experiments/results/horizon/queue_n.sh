#!/bin/bash
# Issue 61, part 2: pipemare at N = 2P (no microbatch more than one update stale) at the 10x
# horizon (2,400 steps), the task's rate (1e-3), three seeds per P. Seed 0 at every P first, so a
# stop part-way leaves whole seeds. Two lists so two runs go at once (a, b); the frozen code and
# each run: queue_lib.sh.
# Started with: nohup setsid experiments/results/horizon/queue_n.sh a >> experiments/results/horizon/logs/queue-n.log 2>&1 < /dev/null &
source "$(dirname "$0")/queue_lib.sh"
if [ "${1:-a}" = b ]; then SPECS=("pipemare 8 16 0 2400 -" "pipemare 4 8 1 2400 -" "pipemare 2 4 2 2400 -" "pipemare 8 16 2 2400 -")
else SPECS=("pipemare 4 8 0 2400 -" "pipemare 2 4 0 2400 -" "pipemare 8 16 1 2400 -" "pipemare 2 4 1 2400 -" "pipemare 4 8 2 2400 -"); fi
for spec in "${SPECS[@]}"; do run_one $spec; done
