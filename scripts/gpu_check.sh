#!/usr/bin/env bash
# One call on the lent GPU: GPU tests, compute-sanitizer over every path, and
# the benchmarks, results under $OUT (at most 8 files).
# Usage (repository root): OUT=/some/dir bash scripts/gpu_check.sh MODE, where MODE is
#   close          tests, then targets: the GPU tests and the issues' figures in one call (~7 min)
#   tests | sanitize | targets | odd-rows (rows at mixed phases against torch) |
#   bench-forward | bench-rest (the full sweeps over cols) | all
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/out}"
mode="${1:-all}"
mkdir -p "$OUT/json"
run() { [ "$mode" = all ] || [ "$mode" = "$1" ] || { [ "$mode" = close ] && [[ "$1" =~ ^(tests|targets)$ ]]; }; }

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
    tail -n 30 "$OUT/sanitize_$tool.log" | grep -v "^=========     " > "$OUT/sanitize_${tool}_tail.txt"; rm -f "$OUT/sanitize_$tool.log"
  done
fi

LONG_ROWS=(--shape 16384,65536 --shape 8192,131072 --shape 4096,262144 --shape 8,1048576)
bench() {   # op dtype label [bench options]: one table into bench.txt, its JSON kept
  local op="$1" dtype="$2" label="$3"; shift 3
  python -m cupyops.cli bench "$op" --dtype "$dtype" "$@" \
    --json "$OUT/json/bench_${op}_${dtype}_${label}.json" 2>/dev/null | tee -a "$OUT/bench.txt"
}
if run targets; then   # the shapes and cols the issues set targets for
  for dtype in float16 bfloat16 float32; do
    bench softmax "$dtype" rows --cols 256,1024,2048,4096,32768 --baseline torch,copy
    bench softmax "$dtype" long "${LONG_ROWS[@]}" --baseline torch,copy
    for op in softmax log_softmax softmax_backward; do
      bench "$op" "$dtype" axis --shape 64,4096,256 --axis 1 --baseline torch,oneflow,copy
    done
    bench softmax_backward "$dtype" rows --cols 1024,2048,32768 --baseline torch,copy
    for op in layer_norm rms_norm; do
      bench "$op" "$dtype" rows --cols 32,128,256,512,1024,2048,4096,16384,32768 --baseline torch,copy
      bench "${op}_backward" "$dtype" rows --cols 1024,16384 --baseline torch,copy
    done
  done
fi
if run odd-rows; then   # odd cols: every row at its own phase, peeled
  for dtype in float16 bfloat16 float32; do
    for op in softmax log_softmax softmax_backward log_softmax_backward; do
      bench "$op" "$dtype" odd --shape 49152,20001 --shape 16384,30001 --shape 459,18246 --shape 287,116863 \
        --shape 75,110997 --shape 8,1048583 --baseline torch,copy
    done
  done
fi
if run bench-forward; then
  python scripts/call_overhead.py 2>&1 | tee "$OUT/call_overhead.txt"
  for op in softmax log_softmax; do
    for dtype in float16 bfloat16 float32; do bench "$op" "$dtype" sweep --rows 49152; done
  done
fi
if run bench-rest; then
  for op in softmax_backward log_softmax_backward layer_norm rms_norm layer_norm_backward rms_norm_backward; do
    for dtype in float16 bfloat16 float32; do
      bench "$op" "$dtype" sweep --rows 49152 --cols 32,128,256,1024,2048,4096,8192,12345,16384,32768
    done
  done
  for dtype in float16 bfloat16 float32; do
    for op in softmax log_softmax softmax_backward; do
      bench "$op" "$dtype" long "${LONG_ROWS[@]}" --baseline torch,oneflow,copy
      bench "$op" "$dtype" axis --shape 64,4096,256 --axis 1 --baseline torch,oneflow,copy
    done
  done
fi
tar -C "$OUT" -czf "$OUT/bench_json_$mode.tgz" json && rm -r "$OUT/json"
