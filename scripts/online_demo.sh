#!/usr/bin/env bash
# `make online-demo`: online training on one machine. A redis-server (the one `make setup`
# installs) holds the streams and the serving store; then the three commands of
# docs/online.md: replay a file into the streams, train from them with live updates, serve.
# Every 5 s it prints the trainer's progress line and a served prediction as it moves; all
# stops once the replay is over and the trainer idle.
set -euo pipefail
BIN=${BIN:-.venv/bin}
DEMO=${DEMO:-build/online-demo}
REDIS_PORT=${REDIS_PORT:-6399}
PORT=${PORT:-8766}
RATE=${RATE:-5000}
ROWS=${ROWS:-150000}
STREAMS="redis://127.0.0.1:$REDIS_PORT/0"
STORE="redis://127.0.0.1:$REDIS_PORT/1"

command -v redis-server > /dev/null || { echo "online-demo: redis-server is missing (make setup installs it as root)" >&2; exit 1; }
rm -rf "$DEMO" && mkdir -p "$DEMO/redis"
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --dir "$DEMO/redis" --appendonly yes --save "" \
    --daemonize no > "$DEMO/redis.log" 2>&1 &
REDIS=$!
PIDS=($REDIS)
trap 'kill ${PIDS[*]} 2>/dev/null; wait 2>/dev/null || true' EXIT
for _ in $(seq 1 50); do redis-cli -p "$REDIS_PORT" ping > /dev/null 2>&1 && break; sleep 0.1; done
"$BIN/dlrm" data synth --train-rows "$ROWS" --test-rows 1000 --seed 0 --out "$DEMO/data" > /dev/null

# 1. a click log: the file's rows as impressions at RATE a second, clicks 1 s after theirs
"$BIN/dlrm" stream replay "$DEMO/data/train.txt" --url "$STREAMS" --rate "$RATE" --click-delay 1 \
    > "$DEMO/replay.log" 2>&1 &
PIDS+=($!)
# 2. train from it, pushing the changed rows to the serving store every second
"$BIN/dlrm" train --stream "$STREAMS" --config configs/tiny.toml --live-store "$STORE" \
    --set stream.join_window_s=5 --set stream.report_every_s=5 --set stream.idle_exit_s=8 \
    --out "$DEMO/run" --no-progress > "$DEMO/train.out" 2> "$DEMO/train.log" &
TRAIN=$!
PIDS+=($TRAIN)
for _ in $(seq 1 240); do grep -q "live updates: published" "$DEMO/train.log" && break; sleep 0.5; done
grep -q "live updates: published" "$DEMO/train.log" || { echo "online-demo: training did not start:" >&2; cat "$DEMO/train.log" >&2; exit 1; }
# 3. serve the live model
"$BIN/dlrm" serve --store "$STORE" --port "$PORT" --log-level warning > "$DEMO/serve.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 120); do curl -sf "http://127.0.0.1:$PORT/readyz" > /dev/null && break; sleep 0.5; done

REQUEST='{"instances": [{"I1": 1, "I5": 1382, "C1": "68fd1e64", "C2": "80e26c9b", "C3": "fb936136"}]}'
while kill -0 $TRAIN 2> /dev/null; do
    sleep 5
    grep "stream:" "$DEMO/train.log" | tail -n 1 | sed 's/^.*stream: /== trainer: /'
    echo "== served: $(curl -s -X POST "http://127.0.0.1:$PORT/v1/models/dlrm:predict" \
        -H 'content-type: application/json' -d "$REQUEST")"
done
wait $TRAIN || { echo "online-demo: training failed:" >&2; tail -n 20 "$DEMO/train.log" >&2; exit 1; }
cat "$DEMO/replay.log" "$DEMO/train.out"
echo "online-demo: metrics in $DEMO/run/metrics.json"
