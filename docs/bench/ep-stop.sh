#!/bin/bash
# How long `moeserve serve --ray --expert-parallel 2` takes to exit when a signal reaches its whole process group
# (a supervisor's SIGTERM, Ctrl-C in a terminal) while 32 clients stream (docs/bench/log.md, "The serving stack's
# ceiling on two cores, and a stop under load"). The random `small` checkpoint of ep-serve.py; port 8123.
#
#     PYTHONPATH=. bash docs/bench/ep-stop.sh [TERM|INT]
set -u
SIG=${1:-TERM}
CKPT=/tmp/moeserve-ep-serve/small
[ -f $CKPT/config.json ] ||
    python -c "import sys; sys.path.insert(0, 'docs/bench'); __import__('ep-serve').checkpoint()"
setsid moeserve serve $CKPT --ray --expert-parallel 2 --dtype float32 --port 8123 > /tmp/ep-stop-server.log 2>&1 &
PID=$!
for i in $(seq 1 180); do curl -sf localhost:8123/readyz > /dev/null && break; sleep 1; done
echo "ready after $i s"
timeout 60 moeserve bench serve --url http://127.0.0.1:8123 --concurrency 32 --duration 20 --input-len 32 \
    --output-len 32 --ignore-eos on > /tmp/ep-stop-bench.log 2>&1 &
sleep 8
T0=$(date +%s.%N)
kill -$SIG -- -$PID
while kill -0 $PID 2> /dev/null; do sleep 0.2; done
wait $PID
echo "SIG$SIG to the process group under load: exit status $?, after $(echo "$(date +%s.%N) - $T0" | bc) s"
wait
