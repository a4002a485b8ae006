#!/bin/bash
# One device call that checks and times the GPU path (benchmarks/GPU_SESSION.md says why each
# stage is here). Run from the repository root on the GPU machine:
#
#     bash benchmarks/gpu_session.sh STAGE... [-- LIMIT_S]
#
# stages, in the order given:
#   tests      tests/kernels/test_flash.py and test_trace.py compiled (pytest -v -n 6, or
#              PYTEST_WORKERS, so a killed run still names what it finished; --tb=line, so
#              a failure's message, a random test's seed included, survives), then the
#              failures alone with
#              --tb=long (a test that draws fresh inputs draws new ones there)
#   eden       tests/kernels/test_flash_eden.py the same way (its rotated backward compiles
#              for minutes; EDEN_TESTS names the tests to run instead of the whole file)
#   bwdtests   tests/kernels/test_flash_bwd.py and test_flash_sr.py the same way
#   attntests  tests and bwdtests in one run, with the Gluon forward's and the launch's
#              tests (with PYTEST_WORKERS=12 their compiles share more of the 16 cores)
#   qtests     tests/kernels/test_quantize.py, test_random.py and
#              tests/formats/test_quantize_devices.py the same way (the quantizers)
#   forward    the forward bench (kernel alone and the whole call), warmed in 8 shards first
#              (FWD_RECIPES overrides its recipes)
#   backward   forward plus backward, warmed likewise
#   trace      the traced forward, warmed likewise
#   nohw       the FP8 recipes' forward again with FP4LAB_HW_E4M3=0 (the hardware cast's own
#              gain; the flag is read at import, so its own process), into nohw/
#   gradbias   gradient_bias's 256 samples on the kernels, into gradbias/
#   resources  registers, spills, shared memory of the forward kernels
#   scale      the 131072-token traced forward plus backward (warmed at 4096 tokens first)
#   profile    torch.profiler over the reference's exact forward and the whole fp4lab.attention
#              call, traced and not (benchmarks/profile_gpu.py), into profile/ (PROFILE_CASES
#              overrides its cases)
#   reference  the reference's exact forward on CUDA beside SDPA (issue 9's 20x goal)
#   gluon      the Gluon forward against the Triton one and SDPA (benchmarks/bench_gluon_fwd.py)
#   launch     the NVFP4 forward kernel alone over tiles and compilation variants
#              (benchmarks/bench_fwd_launch.py; LAUNCH_RECIPES, LAUNCH_CONFIGS, LAUNCH_VARIANTS
#              override)
#   quantize   the Triton quantizers against their bandwidth bound and torchao (its wheel
#              carried in .whl/, installed into /tmp/site)
# Everything lands under $OUT/r and is packed into $OUT/r.tgz at the end (at most 8 files come
# back from a device call). LIMIT_S (default 570) bounds the whole call: a stage that starts
# gets what is left, and the packing always runs.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRITON_CACHE_DIR=$PWD/results/triton-cache
STAGES=()
LIMIT=570
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then LIMIT=$2; break; fi
  STAGES+=("$1"); shift
done
T0=$(date +%s)
O=${OUT:-.}/r
mkdir -p "$O"
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
log() { echo "$1 at $(( $(date +%s) - T0 )) s" >> "$O/stages.txt"; }
BENCH="python3 benchmarks/bench_attention_gpu.py"
warm() {  # eight shards of the same arguments compile side by side
  local t=$(( $(left) - 30 ))
  [ $t -lt 10 ] && t=10
  for i in 0 1 2 3 4 5 6 7; do
    timeout $t $BENCH "$@" --warm $i/8 --out /tmp/warm$i > "$O/warm$i.log" 2>&1 &
  done
  wait
}
pytests() {  # $1: log name, then the test files
  local name=$1; shift
  timeout $(( $(left) * 2 / 3 )) python3 -m pytest -v -n ${PYTEST_WORKERS:-6} --tb=line -p no:cacheprovider "$@" \
    > "$O/$name.log" 2>&1
  log "$name rc $?"
  grep -E "FAILED|ERROR" "$O/$name.log" | grep -oE "tests/[^ ]+" | sort -u | head -12 \
    > "$O/$name.failed"
  if [ -s "$O/$name.failed" ]; then
    timeout 120 python3 -m pytest -q --tb=long -p no:cacheprovider $(cat "$O/$name.failed") \
      > "$O/$name.failed.log" 2>&1
  fi
}
nvidia-smi --query-gpu=name,clocks.max.sm,temperature.gpu --format=csv > "$O/gpu.txt" 2>&1
FWD="--recipes ${FWD_RECIPES:-exact flash_bf16 nvfp4 mxfp4 fa4fp4_causal fa3_fp8} --configs 64x64:4:3 128x128:8:3"
# the backward's warm-up of four recipes at four configurations took 459 s (2026-12-02); the
# default launch (64 x 64, 4 warps, 3 stages) of the recipes whose backward was never timed
BWD="--no-kernels --backward --backward-recipes fa4fp4_causal nvfp4 fa3_fp8 attn_qat exact --backward-configs 64x64:4:3"
for stage in "${STAGES[@]}"; do
  [ "$(left)" -lt 40 ] && { log "no time for $stage"; continue; }
  case $stage in
    tests) pytests tests tests/kernels/test_flash.py tests/kernels/test_trace.py ;;
    attntests) pytests attntests tests/kernels/test_flash.py tests/kernels/test_trace.py \
                 tests/kernels/test_flash_bwd.py tests/kernels/test_flash_sr.py \
                 tests/kernels/test_gluon_fwd.py tests/kernels/test_launch.py ;;
    eden) pytests eden ${EDEN_TESTS:-tests/kernels/test_flash_eden.py} ;;
    bwdtests) pytests bwdtests tests/kernels/test_flash_bwd.py tests/kernels/test_flash_sr.py ;;
    qtests) pytests qtests tests/kernels/test_quantize.py tests/kernels/test_random.py \
              tests/formats/test_quantize_devices.py ;;
    forward) warm $FWD; log "forward warm"
             timeout $(left) $BENCH $FWD --out "$O" > "$O/forward.log" 2>&1; log "forward rc $?" ;;
    backward) warm $BWD; log "backward warm"
              timeout $(left) $BENCH $BWD --out "$O" > "$O/backward.log" 2>&1
              log "backward rc $?" ;;
    trace) warm --no-kernels --trace; log "trace warm"
           timeout $(left) $BENCH --no-kernels --trace --out "$O" > "$O/trace.log" 2>&1
           log "trace rc $?" ;;
    nohw) FP4LAB_HW_E4M3=0 timeout $(left) $BENCH --recipes fa4fp4_causal fa3_fp8 \
            --configs 64x64:4:3 128x128:8:3 --out "$O/nohw" > "$O/nohw.log" 2>&1
          log "nohw rc $?" ;;
    gradbias) timeout $(left) $BENCH --no-kernels --gradient-bias --out "$O/gradbias" \
                > "$O/gradbias.log" 2>&1; log "gradbias rc $?" ;;
    resources) timeout $(left) python3 benchmarks/kernel_resources.py --out "$O" \
                 > "$O/resources.log" 2>&1; log "resources rc $?" ;;
    scale) timeout $(( $(left) / 2 )) $BENCH --no-kernels --scale --warm 0/1 --out /tmp/warms \
             > "$O/scale_warm.log" 2>&1; log "scale warm rc $?"
           timeout $(left) $BENCH --no-kernels --scale --out "$O" > "$O/scale.log" 2>&1
           log "scale rc $?" ;;
    profile) timeout $(left) python3 benchmarks/profile_gpu.py --out "$O/profile" \
               --cases ${PROFILE_CASES:-reference reference_causal traced untraced} \
               > "$O/profile.log" 2>&1
             log "profile rc $?" ;;
    reference) timeout $(left) $BENCH --no-kernels --reference --out "$O" > "$O/reference.log" 2>&1
               log "reference rc $?" ;;
    quantize) ls .whl/torchao-*.whl > /dev/null 2>&1 &&  # carried: run(carry=[".whl"])
                pip install -q --no-deps --target /tmp/site .whl/torchao-*.whl > "$O/pip.log" 2>&1
              PYTHONPATH=$PWD:/tmp/site timeout $(left) python3 benchmarks/bench_quantize_gpu.py \
                --out "$O" > "$O/quantize.log" 2>&1; log "quantize rc $?" ;;
    gluon) timeout $(left) python3 benchmarks/bench_gluon_fwd.py --out "$O" > "$O/gluon.log" 2>&1
           log "gluon rc $?" ;;
    launch) timeout $(left) python3 benchmarks/bench_fwd_launch.py --recipes ${LAUNCH_RECIPES:-nvfp4} \
              --configs ${LAUNCH_CONFIGS:-64x64:4:3 64x64:4:2 128x128:8:3 128x64:8:2 64x32:4:3} \
              --variants ${LAUNCH_VARIANTS:-base noacc reg168 reg128} --out "$O" \
              > "$O/launch.log" 2>&1; log "launch rc $?" ;;
    *) log "unknown stage $stage" ;;
  esac
done
tar czf "${OUT:-.}/r.tgz" -C "${OUT:-.}" r && rm -rf "$O"
