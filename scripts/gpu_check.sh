#!/usr/bin/env bash
# One call on the lent GPU: GPU tests, compute-sanitizer over every path, and
# the benchmarks, results under $OUT (at most 8 files).
# Usage (repository root): OUT=/some/dir bash scripts/gpu_check.sh MODE, where MODE is
#   close          tests, then targets: the GPU tests and the issues' figures in one call (~7 min)
#   tests | sanitize | targets | odd-rows (rows at mixed phases against torch) | small-rows (auto
#   against oneflow at short rows) | fused-tune (scripts/tune_fused_softmax.py) |
#   bench-forward | bench-rest (the full sweeps over cols) | elementwise | families | all
#   host           scripts/call_overhead.py (every public op and cupyops.torch function) and the torch example
#   fused          issue 39's sweep of fused_softmax (S 128 to 16384; FUSED_DTYPES, FUSED_PARTS narrow it)
#   planners       scripts/compare_planners.py: the default row-wise sweep under BASELINE_DIR's
#                  planner and this one, alternately (PLANNER_ARGS narrows it, e.g. "--ops softmax")
#   tune-table     cupyops tune fused_softmax at issue 39's shapes (TUNE_SHAPES, TUNE_DTYPES), the tuning
#                  table copied to $OUT for `cupyops tune ship`
#   dask           cupyops.dask on the GPUs there (two for the issue's figures): its GPU tests, the example,
#                  bench dask over chains of DASK_CHAINS ops (default "1 8 16")
#   conv           the int8 convolution alone: its GPU tests, compute-sanitizer over every
#                  kernel configuration (wgmma's on sm_90), the measured int8 peaks and its bench
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
    for script in sanitize_paths sanitize_fused_softmax sanitize_elementwise sanitize_conv sanitize_torch; do
      compute-sanitizer --tool "$tool" --error-exitcode 9 python "scripts/$script.py"
    done > "$OUT/sanitize_$tool.log" 2>&1
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
ATTENTION=(--shape 64,128,128,128 --shape 8,16,1024,1024 --shape 1,8,4096,4096)
if run host; then   # the host cost of every public op and cupyops.torch function, the torch example
  python scripts/call_overhead.py 2>&1 | tee "$OUT/call_overhead.txt"
  python examples/transformer_block.py 2>&1 | tail -n 3 | tee "$OUT/transformer_block.txt"
fi
if run families; then   # fused softmax, int8 convolution, host cost, the torch example
  python scripts/call_overhead.py 2>&1 | tee "$OUT/call_overhead.txt"
  python examples/transformer_block.py 2>&1 | tail -n 3 | tee "$OUT/transformer_block.txt"
  for dtype in float16 bfloat16; do
    bench fused_softmax "$dtype" causal "${ATTENTION[@]}" --causal
    bench fused_softmax "$dtype" dropout "${ATTENTION[@]}" --dropout 0.1
    bench fused_softmax_backward "$dtype" causal "${ATTENTION[@]}" --causal
  done
  python -m cupyops.cli bench conv2d_int8 --layers all --json "$OUT/json/bench_conv2d_int8.json" | tee -a "$OUT/bench.txt"
fi
# issue 39's sweep: S 128 to 16384, x of at least 256 MB; FUSED_DTYPES / FUSED_PARTS narrow it
ATTENTION_SWEEP=(64,128,128,128 16,32,512,512 8,16,1024,1024 2,16,2048,2048 1,8,4096,4096 1,1,16384,16384)
if run fused; then
  for dtype in ${FUSED_DTYPES:-float16 bfloat16}; do
    shapes=(); for s in "${ATTENTION_SWEEP[@]}"; do shapes+=(--shape "$s"); done
    if [[ "${FUSED_PARTS:-forward backward}" == *forward* ]]; then
      bench fused_softmax "$dtype" sweep_causal "${shapes[@]}" --causal
      bench fused_softmax "$dtype" sweep_dropout "${shapes[@]}" --dropout 0.1
      bench fused_softmax "$dtype" sweep_causal_dropout "${shapes[@]}" --causal --dropout 0.1
      for s in "${ATTENTION_SWEEP[@]}"; do   # a padding mask (B,1,1,S) and a position bias (H,S,S) of each shape
        IFS=, read -r b h q k <<< "$s"
        bench fused_softmax "$dtype" "sweep_mask_$k" --shape "$s" --mask-shape "$b,1,1,$k"
        bench fused_softmax "$dtype" "sweep_bias_$k" --shape "$s" --bias-shape "$h,$q,$k"
      done
    fi
    if [[ "${FUSED_PARTS:-forward backward}" == *backward* ]]; then
      bench fused_softmax_backward "$dtype" sweep_causal "${shapes[@]}" --causal
      bench fused_softmax_backward "$dtype" sweep_dropout "${shapes[@]}" --dropout 0.1
      bench fused_softmax_backward "$dtype" sweep_causal_dropout "${shapes[@]}" --causal --dropout 0.1
    fi
  done
fi
if run small-rows; then   # auto against the oneflow policy at short rows, every row-wise op and type
  for op in softmax log_softmax softmax_backward log_softmax_backward layer_norm rms_norm layer_norm_backward \
      rms_norm_backward; do
    for dtype in float16 bfloat16 float32; do
      bench "$op" "$dtype" small --rows 49152 --cols 32,64,128,256,512,1024 --baseline oneflow,copy
    done
  done
fi
if [ "$mode" = tune-table ]; then   # not part of "all": cupyops tune at issue 39's shapes, the table back in $OUT
  # TUNE_SHAPES (default: S 1024, 4096, 16384 of ATTENTION_SWEEP) x TUNE_FUSIONS (default: causal,
  # dropout, causal with dropout, mask, bias; ';'-separated) x forward, backward, in TUNE_DTYPES; then
  # `cupyops tune ship --profile P --table tuning_table.json` here
  export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-$HOME/.cupy/kernel_cache}"
  for dtype in ${TUNE_DTYPES:-float16}; do
    for s in ${TUNE_SHAPES:-8,16,1024,1024 1,8,4096,4096 1,1,16384,16384}; do
      IFS=, read -r b h q k <<< "$s"
      IFS=';' read -r -a fusions <<< "${TUNE_FUSIONS:---causal;--dropout 0.1;--causal --dropout 0.1;--mask-shape $b,1,1,$k;--bias-shape $h,$q,$k}"
      for fusion in "${fusions[@]}"; do
        python -m cupyops.cli tune fused_softmax --shape "$s" --dtype "$dtype" $fusion 2>&1 | grep -v "^tuning table"
      done
    done
  done | tee "$OUT/tune_table.txt"
  cp "$CUPY_CACHE_DIR/cupyops_tuning.json" "$OUT/tuning_table.json"
fi
if run fused-tune; then   # the paths the fused softmax can take, timed against each other
  (cd scripts && python tune_fused_softmax.py) > "$OUT/tune_fused_softmax.txt" 2>&1
  tail -n 200 "$OUT/tune_fused_softmax.txt"
fi
EW_SHAPES=(--shape 16384,8192 --shape 4096,4096 --shape 1024,1024)
if run elementwise; then   # fused elementwise: sanitizers, first-call cost, benches (host cost: mode host; tests: mode tests)
  for tool in memcheck racecheck; do
    compute-sanitizer --tool "$tool" --error-exitcode 9 python scripts/sanitize_elementwise.py 2>&1 | tail -n 3 \
      | tee -a "$OUT/sanitize_elementwise.txt"
  done
  python scripts/tune_elementwise.py --first-call-only > "$OUT/tune_elementwise.txt" 2>&1; cat "$OUT/tune_elementwise.txt"
  for dtype in float16 bfloat16 float32; do
    for expr in bias_gelu bias_gelu_tanh bias_silu swiglu geglu bias_dropout_add "sigmoid(a + b)" "relu(a + b) * 0.5"; do
      label=$(echo "$expr" | tr -c 'a-z0-9_\n' '_')
      bench elementwise "$dtype" "$label" --expr "$expr" "${EW_SHAPES[@]}"
    done
  done
fi
if [ "$mode" = planners ]; then   # not part of "all": this planner against BASELINE_DIR's (another commit's files)
  python scripts/compare_planners.py --baseline-dir "${BASELINE_DIR:-baseline}" ${PLANNER_ARGS:-} \
    --json "$OUT/json/compare_planners.json" | tee "$OUT/compare_planners.txt"
fi
if [ "$mode" = conv ]; then   # not part of "all": the families mode benches it there
  python -m pytest -n 8 -q -rs -m gpu -p no:cacheprovider tests/test_conv2d_int8_gpu.py > "$OUT/conv_pytest.txt" 2>&1
  tail -n 3 "$OUT/conv_pytest.txt"; grep -E "^(FAILED|ERROR)" "$OUT/conv_pytest.txt" | head -n 30
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool scripts/sanitize_conv.py" | tee -a "$OUT/conv_sanitize.txt"
    compute-sanitizer --tool "$tool" --error-exitcode 9 python scripts/sanitize_conv.py > "$OUT/conv_$tool.log" 2>&1
    echo "exit $?" | tee -a "$OUT/conv_sanitize.txt"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|all paths ran" "$OUT/conv_$tool.log" | tail -n 3 | tee -a "$OUT/conv_sanitize.txt"
    grep -B2 -A12 -m 3 "^========= [A-Z]" "$OUT/conv_$tool.log" >> "$OUT/conv_sanitize.txt"; rm -f "$OUT/conv_$tool.log"
  done
  python -m cupyops.cli bench conv2d_int8 --layers all --json "$OUT/json/bench_conv2d_int8.json" | tee "$OUT/conv_bench.txt"
fi
if run dask; then   # mode dask (10 min at most): cupyops.dask's GPU tests, examples/dask_multi_gpu.py, bench dask
  { timeout -k 10 90 python -m pytest -q -rfEs -m gpu -p no:cacheprovider tests/test_dask_gpu.py \
      > "$OUT/dask_pytest.txt" 2>&1
    echo "== pytest tests/test_dask_gpu.py: exit $? (124: timed out)"
    grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/dask_pytest.txt" | head -n 30; tail -n 1 "$OUT/dask_pytest.txt"
    echo "== examples/dask_multi_gpu.py"
    timeout -k 10 120 python examples/dask_multi_gpu.py 2>&1 | tail -n 12; echo "exit ${PIPESTATUS[0]}"
    for chain in ${DASK_CHAINS:-1 8 16}; do   # one op a run, then chains of ops (the run's fixed cost paid once)
      echo "== cupyops bench dask --chain $chain (progress, then the table)"
      timeout -k 10 150 python -m cupyops.cli bench dask --reps 5 --chunk-mib 1024,4096 --chain "$chain" \
        --json "$OUT/json/bench_dask_chain$chain.json" 2>&1 | tail -n 16
      echo "exit ${PIPESTATUS[0]}"
    done
  } | tee "$OUT/dask.txt"
fi
tar -C "$OUT" -czf "$OUT/bench_json_$mode.tgz" json && rm -r "$OUT/json"
