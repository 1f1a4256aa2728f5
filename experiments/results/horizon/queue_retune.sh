#!/bin/bash
# the re-tune's follow-up (issue 61): twice 1e-3 won at 2,400 steps, so try 4e-3, then the
# default pipemare and async at P = 4, 8 at the re-tuned rate (the frozen code and each run:
# queue_lib.sh)
source "$(dirname "$0")/queue_lib.sh"
# two lists, so two runs go at once: a (one device and async) and b (pipemare);
# variant stages N seed steps lr, as queue_lib.sh's run_one takes them
if [ "${1:-a}" = b ]; then SPECS=(
  "pipemare 4 - 0 2400 0.002" "pipemare 4 - 0 2400 0.004" "pipemare 8 - 0 2400 0.004"
  "pipemare 8 - 0 2400 0.002" "pipemare 2 - 0 2400 0.002" "pipemare 8 - 1 2400 0.002")
else SPECS=(
  "gpipe 2 - 0 2400 0.004" "gpipe 2 - 0 2400 0.008" "gpipe 2 - 1 2400 0.004"
  "async 4 - 0 2400 0.004" "pipemare 4 - 1 2400 0.002" "gpipe 2 - 1 2400 0.002"); fi
# (b then adds P = 2 at 2e-3 and the P = 8 second seed)
# (one device's optimum is flat between 2e-3 and 4e-3 and the default is not: the 2e-3 cell's
# second seeds, the default's and one device's, come next)
# (4e-3 beat 2e-3 too, 1.768 against 1.784: 8e-3 brackets the best rate, and the default
# pipemare goes to 4e-3 next, since a higher rate is where staleness costs most)
for spec in "${SPECS[@]}"; do run_one $spec; done
