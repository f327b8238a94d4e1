#!/bin/bash
# On a machine with an NVIDIA GPU: kvgate's NVML path against the real
# driver, and the simulator's step-time model against a timed forward pass.
#   bench/gpucheck/run.sh KVGATE_BINARY OUTDIR
# KVGATE_BINARY must be built with cgo (make build). Needs python3 with
# PyTorch and about 75 GB of free GPU memory; takes about a minute on an H200.
set -u
BIN=$(realpath "$1"); OUT=$(realpath "$2"); HERE=$(dirname "$(realpath "$0")")
exec > >(tee "$OUT/run.log") 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit --format=csv
"$BIN" version
echo "== kvgate gpus, idle"; "$BIN" gpus --log-level info
# A serving kvgate's GPU gauges, with the simulator on the H200 profile.
DATA=$(mktemp -d)
(cd "$DATA" && exec "$BIN" serve --dev --addr 127.0.0.1:18080 --sim-profile h200-llama-3.1-8b) > "$OUT/serve.log" 2>&1 &
SERVE=$!
metrics() { python3 -c "import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:18080/metrics').read().decode())" | grep '^kvgate_gpu_'; }
sleep 5; echo "== metrics, idle"; metrics
{ python3 "$HERE/decode.py" > "$OUT/decode.jsonl" && python3 "$HERE/prefill.py" > "$OUT/prefill.jsonl"; } 2> "$OUT/python.err" &
PY=$!
while kill -0 $PY 2>/dev/null; do
  echo "$(date +%T) $("$BIN" gpus 2>/dev/null | sed -n 3p)" >> "$OUT/gpus_load.txt"
  { echo "-- $(date +%T)"; metrics; } >> "$OUT/metrics_load.txt"
  sleep 3
done
wait $PY; echo "python rc=$?"; tail -3 "$OUT/python.err"
cat "$OUT/decode.jsonl" "$OUT/prefill.jsonl" "$OUT/gpus_load.txt"
kill -INT $SERVE; wait $SERVE; grep -i 'nvml\|xid' "$OUT/serve.log"
rm -rf "$DATA"
