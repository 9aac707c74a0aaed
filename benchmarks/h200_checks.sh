#!/usr/bin/env bash
# The GPU checks of a commit, in one go, for a machine with a CUDA device:
#   bash benchmarks/h200_checks.sh OUT PART...
# PART: tests | tests-517 (the suite on the image's transformers) | tests-transformers | demo-models | bench-model | sanitizer | sanitizer-each | tests+sanitizer (first only: both at once) | tests-precompile | ab-runtime | ab-kernels | probe-step | probe-host |
#       probe-ops | probe-pdl | ab-sampling | ab-host | ab-decode (sweep_decode.py's SWEEP_ARGS, DECODE_VARIANTS on . and $BASE) | bench-host | bench-capture | bench-runtime | bench-step | bench-sampling | probe-sampling (PROBE_ARGS, e.g. "--batches 64,256 --settings filtered,top_k --tiles default,256x4 --paths short,radix") | bench-speculative (SPEC_ARGS, e.g. "--batches 1,8 --drafts 3 --sampled") | probe-model-step | probe-linear-fusions (with --sweep) |
#       bench-kernels | sweep-fp8 | sweep-prefill | probe-prefill-tma | sweep-splits | sweep-decode | ncu-decode | ncu-merge | ncu-model-step (NCU_COUNT kernels, default 140). ab-runtime, ab-kernels (ROUNDS, default 1), ab-sampling, ab-host (ROUNDS, default 2) and probe-step compare with the tree in $BASE
#       (a `git archive` of an older commit; default .base; PROBE_ARGS: probe_step_gpu.py options (probe-step), or probe_model_step.py's (probe-model-step, e.g. "--model llama-8b --batches 1,32 --compiled-only"); SWEEP_ARGS: sweep_prefill.py options, e.g. "--new-kv --sizes 4096 16384", or sweep_decode.py's, e.g. "--heads 32,8,64 --shapes 1:512,8:512", with DECODE_VARIANTS its variants, e.g. "map rope;map x8 n64 rope launch"); JOBS: pytest workers for tests (default 10); SHARD=K/N: the K-th of N parts of the suite (tests, tests-517: a cold machine needs about 600 s for the whole suite at 16 workers, more than one call); HF_SITE: a folder of carried
#       packages put first on PYTHONPATH for the transformers parts (a newer transformers than the image's); MODEL_ARGS:
#       graphrt.bench.model options, e.g. "--models llama-1b --prompts 512 --static-batches 1". Each part runs under its own
#       `timeout` ($LIMIT seconds, default 300) and writes one log (or JSON) under OUT; a
#       failing part does not stop the others. GRAPHRT_COMMIT labels the JSONs.
set -u
out=$1; shift
mkdir -p "$out"
base=${BASE:-.base}
limit=${LIMIT:-300}
c=${GRAPHRT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export GRAPHRT_COMMIT=$c PYTHONUNBUFFERED=1
site() {   # an importable copy of a tree: graphrt/ with kernels/ and capture/ inside
  local d=/tmp/graphrt_site_$1; rm -rf "$d"; mkdir -p "$d"
  cp -r "$2/graphrt" "$d/"; cp -r "$2/kernels" "$2/capture" "$d/graphrt/"; cp -r graphrt/bench/. "$d/graphrt/bench/"
  echo "$d"
}
if [ "${1:-}" = "tests+sanitizer" ]; then   # both at once (CPU-bound compiles beside the sanitizer: ~4-5 min)
  shift
  bash "$0" "$out" tests & pid=$!
  bash "$0" "$out" sanitizer
  wait $pid
fi
# the suite's options: -v names each failure as it happens (a run cut by $LIMIT has no summary);
# SHARD=K/N runs every N-th test from the K-th on (tests/conftest.py), a suite longer than one call
# as N calls; digest keeps the log short (the passed tests' lines dropped, counted at the end)
suite="-v -rfE --durations=25 -p no:cacheprovider -n ${JOBS:-10}${SHARD:+ --shard $SHARD}"
digest() { awk '/ PASSED /{p++; next} /^tests\/[^ ]+ $/ || /PytestBenchmarkWarning|warner\(/{next} {print}
                END{print "== lines of passed tests: " p+0}'; }
for part in "$@"; do
  shard=; case $part in tests*) shard=${SHARD:+_shard${SHARD%/*}of${SHARD#*/}} ;; esac
  log="$out/${part}${shard}_$c.log"
  case $part in
    tests) timeout "$limit" python3 -m pytest $suite tests --ignore=tests/test_sanitizer.py | digest
           (exit "${PIPESTATUS[0]}") ;;
    tests-517) s517=/tmp/site517; rm -rf "$s517"; python3 -m pip install -q --no-index --no-deps --target "$s517" \
                 .whl/nvtx*.whl   # the same suite on the image's own transformers: nvtx alone carried
               PYTHONPATH=$s517 python3 -c "import transformers; print('transformers', transformers.__version__)"
               PYTHONPATH=$s517 timeout "$limit" python3 -m pytest $suite tests --ignore=tests/test_sanitizer.py | digest
           (exit "${PIPESTATUS[0]}") ;;
    sanitizer) timeout "$limit" python3 -m pytest -q -rP -p no:cacheprovider -n 3 tests/test_sanitizer.py ;;
    sanitizer-each) s=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)   # one at a time,
                # each report kept: the descriptor path alone first, then the test file's three runs
                # (each run's exit status is printed: 124 is a run cut by $LIMIT, which reports nothing)
                PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$limit" "$s" --tool memcheck python3 tests/_sanitize_workload.py read-new
                echo "== memcheck read-new: rc=$?"
                timeout "$limit" "$s" --tool racecheck python3 tests/_sanitize_workload.py read-new
                echo "== racecheck read-new: rc=$?"
                # the kernels compiled once outside the sanitizer first (Triton's disk cache), so that
                # the sanitized runs load them instead of compiling under instrumentation
                # (8 processes side by side, each an eighth of the launches: a cold H100 took over 190 s alone)
                pids=; for i in 0 1 2 3 4 5 6 7; do
                  timeout "$limit" python3 tests/_sanitize_workload.py kernels --part $i/8 > /dev/null & pids="$pids $!"; done
                rc=0; for p in $pids; do wait $p || rc=$?; done; echo "== warm-up: rc=$rc"
                for k in memcheck-kernels memcheck-runtime racecheck-kernels-small; do
                  timeout "$limit" python3 -m pytest -q -rA -p no:cacheprovider \
                    "tests/test_sanitizer.py::test_sanitizer_reports_no_errors[$k]"; echo "== $k: rc=$?"; done
                # the runtime once more without the precompile workers (child processes)
                GRAPHRT_PRECOMPILE=0 timeout "$limit" "$s" --tool memcheck python3 tests/_sanitize_workload.py runtime
                echo "== memcheck runtime, no precompile workers: rc=$?" ;;
    ab-runtime) for t in . "$base"; do (cd "$t" && python3 setup.py -q build_ext --inplace); done   # both with the C helper
                timeout "$limit" python3 benchmarks/ab.py --a . --b "$base" --labels "$c,base" --which runtime \
                  --rounds 2 --harness a --out /tmp/ab_runtime && cp /tmp/ab_runtime/ab_runtime.json "$out/" ;;
    ab-kernels) timeout "$limit" python3 benchmarks/ab.py --a . --b "$base" --labels "$c,base" --which kernels \
                  --rounds "${ROUNDS:-1}" --harness a --out /tmp/ab_kernels && cp /tmp/ab_kernels/ab_kernels.json "$out/" ;;
    ab-sampling|ab-host) w=${part#ab-}   # both trees with their own C helper (ab.py refuses a tree importing another's)
                for t in . "$base"; do (cd "$t" && python3 setup.py -q build_ext --inplace); done
                timeout "$limit" python3 benchmarks/ab.py --a . --b "$base" --labels "$c,base" --which "$w" \
                  --rounds "${ROUNDS:-2}" --harness a --out "/tmp/ab_$w" && cp "/tmp/ab_$w/ab_$w.json" "$out/" ;;
    probe-step) new=$(site new .); old=$(site old "$base")
                timeout "$limit" bash -c "for r in 1 2; do for s in $new $old; do PYTHONPATH=\$s:\${PYTHONPATH:-} \
                  python3 benchmarks/probes/probe_step_gpu.py ${PROBE_ARGS:-} --label \$s | tail -n 1; done; done" ;;
    ab-decode) rm -rf /tmp/ab_decode; new=$(site new .); old=$(site old "$base")   # sweep_decode.py on both trees, A B A B
                timeout "$limit" bash -c "for r in 1 2; do for s in $new $old; do PYTHONPATH=\$s:\${PYTHONPATH:-} \
                  python3 benchmarks/probes/sweep_decode.py --out /tmp/ab_decode/\${s##*_}_\$r ${SWEEP_ARGS:-} \
                  ${DECODE_VARIANTS:+--variants \"$DECODE_VARIANTS\"} | grep -v '^wrote'; done; done" && \
                python3 benchmarks/probes/sweep_decode.py --merge /tmp/ab_decode --labels "$c,base" --out "$out" ;;
    probe-host) timeout "$limit" python3 benchmarks/probes/probe_step_host.py --out "$out" ;;
    probe-ops) timeout "$limit" python3 benchmarks/probes/probe_host_ops.py --out "$out" ;;
    bench-host) timeout "$limit" python3 -m graphrt bench host --out "$out" ;;
    bench-capture) timeout "$limit" python3 -m graphrt bench capture --out "$out" ;;
    bench-runtime) timeout "$limit" python3 -m graphrt bench runtime --out "$out" ;;
    bench-sampling) timeout "$limit" python3 -m graphrt bench sampling --out "$out" ;;
    probe-sampling) timeout "$limit" python3 benchmarks/probes/probe_sampling.py --out "$out" ${PROBE_ARGS:-} ;;
    bench-speculative) PYTHONPATH=${HF_SITE:-}:${PYTHONPATH:-} timeout "$limit" python3 -m graphrt.bench.speculative \
                  --out "$out" ${SPEC_ARGS:-} ;;
    probe-model-step) timeout "$limit" python3 benchmarks/probes/probe_model_step.py --out "$out" ${PROBE_ARGS:-} ;;
    probe-linear-fusions) timeout "$limit" python3 benchmarks/probes/probe_linear_fusions.py --sweep --out "$out" ;;
    probe-pdl) timeout "$limit" python3 benchmarks/probes/probe_pdl.py --out "$out" ;;
    bench-step) timeout "$limit" python3 -m graphrt bench step --out "$out" ;;
    tests-transformers) PYTHONPATH=${HF_SITE:-}:${PYTHONPATH:-} timeout "$limit" python3 -m pytest -q -rA -p no:cacheprovider \
                  -n "${JOBS:-10}" -m gpu tests/test_transformers.py tests/test_positions.py ;;
    demo-models) for m in ${DEMO_MODELS:-gemma3 paligemma qwen2-vl granite}; do
                   PYTHONPATH=${HF_SITE:-}:${PYTHONPATH:-} timeout "$limit" python3 -m graphrt demo --model "$m"; done ;;
    bench-model) PYTHONPATH=${HF_SITE:-}:${PYTHONPATH:-} timeout "$limit" python3 -m graphrt.bench.model --out "$out" \
                   ${MODEL_ARGS:-} ;;
    tests-precompile) timeout "$limit" python3 -m pytest -q -p no:cacheprovider tests/test_precompile.py ;;
    bench-kernels) timeout "$limit" python3 -m graphrt bench kernels --out "$out" ;;
    sweep-fp8) timeout "$limit" python3 benchmarks/probes/sweep_fp8_decode.py --out "$out" \
                 && timeout "$limit" python3 benchmarks/probes/sweep_fp8_decode.py --out "$out" --new-kv ;;
    sweep-prefill) timeout "$limit" python3 benchmarks/probes/sweep_prefill.py --out "$out" ${SWEEP_ARGS:-} ;;
    probe-prefill-tma) timeout "$limit" python3 benchmarks/probes/probe_prefill_tma.py --out "$out" ;;
    sweep-splits) timeout "$limit" python3 benchmarks/probes/sweep_splits.py --out "$out" ;;
    sweep-decode) timeout "$limit" python3 benchmarks/probes/sweep_decode.py --out "$out" ${SWEEP_ARGS:-} \
                    ${DECODE_VARIANTS:+--variants "$DECODE_VARIANTS"} ;;
    ncu-decode) for shape in "--batch 8 --context 1024" "--batch 1 --context 8192" "--batch 64 --context 8192" \
                              "--batch 64 --context 8192 --fp8"; do
                  timeout "$limit" ncu --clock-control none --kernel-name regex:_attn_kernel --launch-skip 1 \
                    --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
                    --section LaunchStats --section WarpStateStats --section SchedulerStats \
                    python3 benchmarks/probes/probe_decode_ncu.py $shape; done ;;
    ncu-model-step) # one compiled decode step of the bench's llama-1b at batch 1 (fusions on), each kernel under
                # Nsight Compute, L2 flushed between kernels (ncu's default): time, DRAM bytes and rate, occupancy
                timeout "$limit" ncu --nvtx --nvtx-include "regex:graphrt@replay bucket=decode.*/" --clock-control none \
                  --launch-count "${NCU_COUNT:-140}" --csv --page raw --metrics gpu__time_duration.sum,dram__bytes_read.sum,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,\
launch__block_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active \
                  python3 benchmarks/probes/probe_model_step.py --batches 1 --compiled-only --ncu ${PROBE_ARGS:-} ;;
    ncu-merge) for merge in fused launch; do   # batch 1, 8k, 32 splits: the merge in place against a second launch
                 timeout "$limit" ncu --clock-control none --kernel-name regex:"_attn_kernel|_merge_kernel" \
                   --launch-skip 2 --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis \
                   --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
                   python3 benchmarks/probes/probe_decode_ncu.py --batch 1 --context 8192 --splits 32 --merge $merge; done ;;
    *) echo "unknown part $part" ;;
  esac > "$log" 2>&1
  echo "rc=$?" >> "$log"
  echo "== $part: $(tail -n 3 "$log" | tr '\n' ' ')"
done
