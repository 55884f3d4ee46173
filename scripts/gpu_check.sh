#!/usr/bin/env bash
# One call on the lent GPU: GPU tests, then the benchmark sweep, results under $OUT.
# Usage (from the repository root): OUT=/some/dir bash scripts/gpu_check.sh [quick|full|sanitize]
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/out}"
mode="${1:-full}"
mkdir -p "$OUT/json"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/device.txt" 2>&1
python -m cupyops.cli info | tee -a "$OUT/device.txt"

if [ "$mode" = "sanitize" ]; then
  for tool in memcheck racecheck; do
    compute-sanitizer --tool "$tool" --error-exitcode 9 \
      python -m pytest -q -x tests/test_softmax_gpu.py -k "${SANITIZE_FILTER:-boundary}" \
      2>&1 | tail -n 30 | tee "$OUT/sanitize_$tool.txt"
  done
  exit 0
fi

python -m pytest -q -rs tests 2>&1 | tee "$OUT/pytest.txt" | tail -n 40

python scripts/call_overhead.py 2>&1 | tee "$OUT/call_overhead.txt"

cols="32,64,128,256,512,1000,1024,1536,2048,3000,4096,8192,12345,16384,32768"
[ "$mode" = "quick" ] && cols="128,1024,4096,32768"
for op in softmax log_softmax; do
  for dtype in float16 bfloat16 float32; do
    python -m cupyops.cli bench "$op" --dtype "$dtype" --rows 49152 --cols "$cols" \
      --json "$OUT/json/bench_${op}_${dtype}.json" 2>/dev/null | tee -a "$OUT/bench.txt"
  done
done
tar -C "$OUT" -czf "$OUT/bench_json.tgz" json && rm -r "$OUT/json"
