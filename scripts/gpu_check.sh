#!/usr/bin/env bash
# One call on the lent GPU: GPU tests, compute-sanitizer over every path, and
# the benchmark sweeps, results under $OUT (at most 7 files).
# Usage (repository root): OUT=/some/dir bash scripts/gpu_check.sh [all|tests|sanitize|bench-forward|bench-rest]
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/out}"
mode="${1:-all}"
mkdir -p "$OUT/json"
run() { [ "$mode" = all ] || [ "$mode" = "$1" ]; }

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/device.txt" 2>&1
python -m cupyops.cli info >> "$OUT/device.txt" 2>&1

if run tests; then
  python -m pytest -n 14 -q -rs -m gpu -p no:cacheprovider tests > "$OUT/pytest.txt" 2>&1
  tail -n 3 "$OUT/pytest.txt"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -n 30
fi

if run sanitize; then
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool" | tee -a "$OUT/sanitize.txt"
    compute-sanitizer --tool "$tool" --error-exitcode 9 python scripts/sanitize_paths.py \
      > "$OUT/sanitize_$tool.log" 2>&1
    echo "exit $?" | tee -a "$OUT/sanitize.txt"
    grep -E "ERROR SUMMARY|all paths ran|Error|error" "$OUT/sanitize_$tool.log" | tail -n 5 | tee -a "$OUT/sanitize.txt"
    rm -f "$OUT/sanitize_$tool.log"
  done
fi

sweep() {   # op dtype [cols]
  python -m cupyops.cli bench "$1" --dtype "$2" --rows 49152 ${3:+--cols "$3"} \
    --json "$OUT/json/bench_$1_$2.json" 2>/dev/null | tee -a "$OUT/bench.txt"
}
if run bench-forward; then
  python scripts/call_overhead.py 2>&1 | tee "$OUT/call_overhead.txt"
  for op in softmax log_softmax; do
    for dtype in float16 bfloat16 float32; do sweep "$op" "$dtype"; done
  done
fi
if run bench-rest; then
  for op in softmax_backward log_softmax_backward layer_norm rms_norm layer_norm_backward rms_norm_backward; do
    for dtype in float16 bfloat16 float32; do sweep "$op" "$dtype" "32,128,256,1024,2048,4096,8192,12345,16384,32768"; done
  done
  python scripts/bench_shapes.py --dtypes float16,bfloat16,float32 --ops softmax,softmax_backward \
    --policies auto 2>&1 | tee "$OUT/shapes.txt"
fi
tar -C "$OUT" -czf "$OUT/bench_json_$mode.tgz" json && rm -r "$OUT/json"
