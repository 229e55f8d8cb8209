#!/usr/bin/env bash
# Everything that needs the GPU, in one call (the device machine is lent by the minute).
# Run from the repository root on the GPU machine; logs and JSON go to $OUT (default /tmp/minisgl-out).
#
#   benchmark/gpu_suite.sh PART...      (benchmark/gpu_suite.sh hash: the `code` line it logs)
#   PART: kernels extend-orders decode-heads sweep-attention sweep-one-request gemv gemv-a3b host latency latency-8b bench bench-hf profile profile-shapes shapes
#         prefill prefill-0.6b prefill-8b prefill-profile latency-profile cprofile
#         ablations pdl baseline tests tests-engine tests-tp tp2 serving serving-8b
#         moe (= moe-tests moe-kernel moe-latency moe-bench: more than one 600 s call in all;
#         also moe-kernel-few (the GEMV path's token counts), moe-sweep (its tiles at one token),
#         moe-profile and moe-profile-pdl)
#
# Serving packages missing on that machine travel as wheels in .whl/ (../shared/device/fetch-wheels.sh
# jsonschema hypothesis; xgrammar and apache-tvm-ffi by `pip download --no-deps`: its torch must not come).
set -uo pipefail
tree_hash() {  # the code that runs: the device's copy of .git can be stale, the files are not
  find minisgl benchmark tests -name '*.py' | LC_ALL=C sort | xargs cat | sha1sum | cut -c1-12
}
if [ "${1:-}" = hash ]; then  # here, to match a summary.log's `code` line with a commit
  tree_hash
  exit
fi
OUT=${OUT:-/tmp/minisgl-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/.site:${PYTHONPATH:-}" PATH="$PWD/.site/bin:$PATH"
if [ -d .whl ] && [ ! -d .site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target .site .whl/*.whl
fi
# the console script, for the test that runs it (no network: nothing else is fetched)
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee -a "$OUT/summary.log"
echo "code $(tree_hash)" | tee -a "$OUT/summary.log"

step() {  # step NAME TIMEOUT CMD...: run, keep the log, put the table's tail in summary.log
  local name=$1 limit=$2
  shift 2
  echo "=== $name: $*" | tee -a "$OUT/summary.log"
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log" >>"$OUT/summary.log"
  echo "=== $name: rc=$rc in $((SECONDS - start)) s" | tee -a "$OUT/summary.log"
}

without_pdl() {  # programmatic dependent launch off, against the bench and latency parts
  step no_pdl 240 env MINISGL_PDL=0 python3 benchmark/offline/bench.py --skip-hf \
    --json "$OUT/no_pdl.json"
  step latency_no_pdl 240 env MINISGL_PDL=0 python3 benchmark/offline/latency.py \
    --json "$OUT/latency_no_pdl.json"
}

serving() {  # serving NAME MODEL [SERVER ARGS...]: bench_serving.py at each of $RATES (default: max
  # concurrency), then the same requests offline; every server process sampled by py-spy for its
  # whole life
  local name=$1 model=$2
  shift 2
  for proc in scheduler-0 tokenizer api-server; do
    (for _ in $(seq 840); do pid=$(pgrep -x "$proc") && break; sleep 0.5; done  # the step's 420 s
     [ -n "$pid" ] && py-spy record --nonblocking --format raw -r 100 \
       -o "$OUT/pyspy-$name-$proc.txt" -p "$pid" >/dev/null 2>&1) &
  done
  step "$name" 420 python3 benchmark/online/bench_serving.py --launch --offline --no-progress \
    --model "$model" --request-rate ${RATES:-inf} --result-json "$OUT/$name.json" \
    --plot "$OUT/$name.png" \
    --server-log "$OUT/$name-server.log" -- --dummy-weights "$@"
  wait
}

prefill_small() {  # MFU at 8k tokens in one request, Qwen3-0.6B shape (prefill's first row)
  step prefill_qwen3-0.6b 180 python3 benchmark/offline/prefill.py --json "$OUT/prefill_qwen3-0.6b.json"
}

prefill_8b() {  # the same on the Llama-3.1-8B shape (prefill's second row)
  step prefill_llama-3.1-8b 180 python3 benchmark/offline/prefill.py \
    --model benchmark/presets/llama-3.1-8b --json "$OUT/prefill_llama-3.1-8b.json"
}

moe() {  # moe PART...: the MoE tests on CUDA, bench_moe.py, and latency.py and bench.py in
  # Qwen3-30B-A3B's shape (dummy weights), each against the floor of the experts its steps select
  local preset=benchmark/presets/qwen3-30b-a3b
  for moe_part in "$@"; do
    case $moe_part in
      tests) MINISGL_TEST_DEVICE=cuda step moe_tests 420 python3 -m pytest -q -rf -p no:cacheprovider \
        --durations=10 -k moe tests/test_fused_moe.py tests/test_moe.py tests/test_models.py tests/test_gpu.py ;;
      kernel) step moe_kernel 240 python3 benchmark/kernel/bench_moe.py --json "$OUT/moe_kernel.json" ;;
      kernel-few) step moe_kernel_few 120 python3 benchmark/kernel/bench_moe.py --tokens 1 2 4 8 \
        --json "$OUT/moe_kernel_few.json" ;;
      sweep) step moe_sweep 300 python3 benchmark/kernel/bench_moe.py --sweep --tokens 1 2 4 \
        --json "$OUT/moe_sweep.json" ;;
      profile)  # one request's steps kernel by kernel, PDL off so that kernel times do not overlap
        step moe_profile 300 env MINISGL_PDL=0 python3 benchmark/offline/bench.py --skip-hf --profile \
          --num-requests 1 --min-len 256 --max-len 512 --model $preset --json "$OUT/moe_profile.json" ;;
      profile-pdl)  # the same with PDL on: the critical-path table charges each kernel its share
        step moe_profile_pdl 300 python3 benchmark/offline/bench.py --skip-hf --profile \
          --num-requests 1 --min-len 256 --max-len 512 --model $preset --json "$OUT/moe_profile_pdl.json" ;;
      latency) step moe_latency 300 python3 benchmark/offline/latency.py --model $preset \
        --json "$OUT/moe_latency.json" ;;
      bench) step moe_bench 540 python3 benchmark/offline/bench.py --skip-hf --model $preset \
        --json "$OUT/moe_bench.json" ;;
      *) echo "unknown part moe-$moe_part" ;;
    esac
  done
}

for part in "$@"; do
  case $part in
    kernels) step kernels 240 python3 benchmark/kernel/bench_attention.py ;;
    extend-orders)  # extend attention's q blocks most keys first against request order
      step extend_orders 180 python3 benchmark/kernel/bench_attention.py --extend-orders ;;
    sweep-attention) step sweep_attention 300 python3 benchmark/kernel/sweep_decode_attention.py ;;
    sweep-one-request)  # one request's decode attention at 8:1 (Qwen3-30B-A3B) and 2:1 groups
      step sweep_one_request 300 python3 benchmark/kernel/sweep_decode_attention.py \
        --one-request 32,4 16,8 --contexts 768 2048 --top 10 ;;
    decode-heads)  # decode attention's default launch at the presets' head counts, batches 1-16
      step decode_heads 180 python3 benchmark/kernel/bench_decode_heads.py ;;
    gemv) step gemv 240 python3 benchmark/kernel/bench_gemv.py --json "$OUT/gemv.json" ;;
    gemv-a3b)  # Qwen3-30B-A3B's QKV, o_proj and LM head GEMVs at one row, the tile sweep
      step gemv_a3b 300 python3 benchmark/kernel/bench_gemv.py --sweep \
        --shapes ${GEMV_SHAPES:-a3b_qkv_proj a3b_o_proj a3b_lm_head} --json "$OUT/gemv_a3b.json" ;;
    host) step host 120 python3 benchmark/host/bench_decode_step.py --device cuda ;;
    latency) step latency 240 python3 benchmark/offline/latency.py --json "$OUT/latency.json" ;;
    latency-8b) step latency_8b 240 python3 benchmark/offline/latency.py \
      --model benchmark/presets/llama-3.1-8b --json "$OUT/latency_8b.json" ;;
    bench) step bench 300 python3 benchmark/offline/bench.py --skip-hf --repeats "${REPEATS:-1}" \
      --json "$OUT/bench.json" ;;
    bench-hf) step bench_hf 300 python3 benchmark/offline/bench.py --json "$OUT/bench_hf.json" ;;
    profile) step profile 300 python3 benchmark/offline/bench.py --skip-hf --profile \
      --json "$OUT/profile.json" ;;
    cprofile) step cprofile 300 python3 -m cProfile -o "$OUT/bench.prof" benchmark/offline/bench.py --skip-hf ;;
    profile-shapes)  # where the large shapes leave the floor (issue 27)
      for preset in ${PRESETS:-llama-3.1-8b qwen2.5-7b}; do
        step "profile_$preset" 300 python3 benchmark/offline/bench.py --skip-hf --profile \
          --model "benchmark/presets/$preset" --json "$OUT/profile_$preset.json"
      done ;;
    shapes)  # each large shape against its bandwidth floor and its roofline (issue 27)
      for preset in ${PRESETS:-llama-3.1-8b qwen3-8b qwen2.5-7b}; do
        step "bench_$preset" 300 python3 benchmark/offline/bench.py --skip-hf --repeats "${REPEATS:-1}" \
          --model "benchmark/presets/$preset" --json "$OUT/bench_$preset.json"
      done ;;
    prefill)  # MFU at 8k tokens in one request, then the long-context row (issue 27)
      prefill_small
      prefill_8b
      step prefill_long 300 python3 benchmark/offline/prefill.py --model benchmark/presets/llama-3.1-8b \
        --num-requests 16 --min-len 16384 --max-len 32768 --repeats 3 --json "$OUT/prefill_long.json" ;;
    prefill-0.6b)  # the first of prefill's rows alone
      prefill_small ;;
    prefill-8b)  # the second alone
      prefill_8b ;;
    prefill-profile)  # the 8k-token Qwen3-0.6B prompt kernel by kernel
      step prefill_profile 180 python3 benchmark/offline/prefill.py --profile \
        --json "$OUT/prefill_profile.json" ;;
    latency-profile)
      step latency_profile 240 python3 benchmark/offline/bench.py --skip-hf --profile --num-requests 1 \
        --min-len 256 --max-len 512 ;;
    ablations)
      step no_graph 240 python3 benchmark/offline/bench.py --skip-hf --no-cuda-graph
      step no_overlap 240 python3 benchmark/offline/bench.py --skip-hf --no-overlap
      without_pdl ;;
    pdl) without_pdl ;;
    baseline)  # BASELINE_PARTS (default: bench latency) of another tree, for an A/B in one call,
      # logged under $OUT/baseline: carry .baseline, made with
      # `git archive REV minisgl benchmark | tar -x -C .baseline`
      (ln -sfn ../tests .baseline/tests && cd .baseline && PYTHONPATH="$OLDPWD/.site" \
        OUT="$OUT/baseline" bash benchmark/gpu_suite.sh ${BASELINE_PARTS:-bench latency}) ;;
    tests)  # four workers (the image has pytest-xdist), a module per worker; -v names each failure
      # as it happens, so a run cut off by its limit still says which failed; TESTS picks files
      MINISGL_TEST_DEVICE=cuda step tests "${TESTS_LIMIT:-420}" python3 -m pytest -v -rf -n 4 --dist loadfile \
        --timeout 300 --durations=10 -p no:cacheprovider ${TESTS:-tests} ;;
    tests-engine)  # everything but the server processes (--dp's router is no wheel there); ~10 min
      # in all, so split over calls with TESTS, e.g. TESTS='tests/test_[a-l]*.py', then [m-z]
      MINISGL_TEST_DEVICE=cuda step tests_engine "${TESTS_LIMIT:-540}" python3 -m pytest -q -rf \
        -p no:cacheprovider ${TESTS:-tests} \
        --ignore-glob='tests/test_server*' --ignore=tests/test_shell.py --ignore=tests/stress \
        --ignore=tests/test_bench_serving.py --ignore=tests/test_data_parallel.py ;;
    tests-tp)  # TP 2 on two GPUs (NCCL, the all-reduces inside CUDA graphs); on one, the CPU's
      MINISGL_TEST_DEVICE=cuda step tests_tp 420 python3 -m pytest -q -rf -p no:cacheprovider \
        tests/test_tp.py tests/test_tp_cuda.py tests/test_server_tp.py ;;
    tp2)  # issue 29 on two GPUs: the 8B shapes at TP 2 and TP 1 (floors with the all-reduces),
      # one request at TP 2, and the server at --tp 2 at max concurrency
      for preset in qwen3-8b llama-3.1-8b; do
        for tp in 2 1; do
          step "bench_${preset}_tp$tp" 300 python3 benchmark/offline/bench.py --skip-hf --tp $tp \
            --model "benchmark/presets/$preset" --json "$OUT/bench_${preset}_tp$tp.json"
        done
      done
      step latency_tp2 240 python3 benchmark/offline/latency.py --tp 2 --model benchmark/presets/qwen3-8b \
        --json "$OUT/latency_tp2.json"
      serving serving_tp2 benchmark/presets/qwen3-8b --tp 2 ;;
    serving) serving serving tests/assets/qwen3-tokenizer ;;
    serving-8b) serving serving_8b benchmark/presets/llama-3.1-8b ;;
    moe) moe tests kernel latency bench ;;
    moe-*) moe "${part#moe-}" ;;
    *) echo "unknown part $part" ;;
  esac
done
