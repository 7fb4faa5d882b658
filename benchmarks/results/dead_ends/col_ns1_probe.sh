#!/usr/bin/env bash
# The one-stage probe (dead_ends/README.md): both configs compiled at once, then timed one after the other.
# From the repo root on the GPU machine, fla wheels in .whl/: timeout 128 bash benchmarks/results/dead_ends/col_ns1_probe.sh
. scripts/device_setup.sh > /tmp/setup.log 2>&1 || { cat /tmp/setup.log; exit 1; }
echo "setup $SECONDS s"
python3 benchmarks/results/dead_ends/col_ns1_probe.py 2 > /tmp/p2.log 2>&1 & P2=$!
python3 benchmarks/results/dead_ends/col_ns1_probe.py 1 > /tmp/p1.log 2>&1 & P1=$!
while ! { grep -q ready /tmp/p2.log && grep -q ready /tmp/p1.log; }; do sleep 1; [ $SECONDS -gt 115 ] && break; done
echo "compiled $SECONDS s"
touch /tmp/go_2; wait $P2; touch /tmp/go_1; wait $P1
tail -n 3 /tmp/p2.log /tmp/p1.log; echo "end $SECONDS s"
