#!/usr/bin/env bash
# `make demo`: generate data, train, publish to the embedded file store, serve, score requests.
set -euo pipefail
BIN=${BIN:-.venv/bin}
DEMO=${DEMO:-build/demo}
PORT=${PORT:-8765}

"$BIN/dlrm" data synth --train-rows 200000 --test-rows 20000 --seed 0 --out "$DEMO/data" > /dev/null
rm -rf "$DEMO/run" "$DEMO/store"
"$BIN/dlrm" train --config configs/tiny.toml --train "$DEMO/data/train.txt" --test "$DEMO/data/test.txt" \
    --out "$DEMO/run" --no-progress
"$BIN/dlrm" publish --checkpoint "$DEMO/run" --store "file://$DEMO/store"

"$BIN/dlrm" serve --store "file://$DEMO/store" --port "$PORT" --log-level warning &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do  # at most 60 s
    curl -sf "http://127.0.0.1:$PORT/readyz" > /dev/null && break
    kill -0 $SERVER 2>/dev/null || { echo "demo: the server exited" >&2; exit 1; }
    sleep 0.5
done
curl -sf "http://127.0.0.1:$PORT/readyz" > /dev/null || { echo "demo: the server did not become ready in 60 s" >&2; exit 1; }

echo
echo "== POST /v1/models/dlrm:predict (one positional and one named instance)"
curl -s -X POST "http://127.0.0.1:$PORT/v1/models/dlrm:predict" -H 'content-type: application/json' -d '{
  "instances": [
    {"dense": [1, 1, 5, 0, 1382, 4, 15, 2, 181, 1, 2, null, 2],
     "sparse": ["68fd1e64", "80e26c9b", "fb936136", "7b4723c4", "25c83c98", "7e0ccccf", "de7995b8",
                "1f89b562", "a73ee510", "a8cd5504", "b2cb9c98", "37c9c164", "2824a5f6", "1adce6ef",
                "8ba8b39a", "891b62e7", "e5ba7672", "f54016b9", "21ddcdc9", "b1252a9d", "07b5194c",
                null, "3a171ecb", "c5c50484", "e8b83407", "9727dd16"]},
    {"I1": 3, "I5": 120, "C1": "68fd1e64", "C2": 2158574747, "C3": ["fb936136", "7b4723c4"]}
  ]}'
echo
echo "== POST /v1/models/dlrm:predict_tsv (three lines of the test file)"
head -n 3 "$DEMO/data/test.txt" | curl -s -X POST "http://127.0.0.1:$PORT/v1/models/dlrm:predict_tsv" \
    -H 'content-type: text/plain' --data-binary @-
echo
echo "== a bad request gets a 4xx naming the field"
curl -s -X POST "http://127.0.0.1:$PORT/v1/models/dlrm:predict" -H 'content-type: application/json' \
    -d '{"instances": [{"dense": [1, 2], "sparse": []}]}'
echo
echo
echo "demo: trained model in $DEMO/run (metrics.json, curves.png), served from file://$DEMO/store"
