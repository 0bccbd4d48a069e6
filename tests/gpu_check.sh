#!/usr/bin/env bash
# The whole GPU check in one command, on an sm_90 machine (the H200 of the device tool):
#   bash tests/gpu_check.sh [pytest args]      (with the nvidia-cutlass wheel carried in .whl/ if
#                                               the machine cannot pip install it)
# 1. environment report, 2. every kernel of the GPU suite built in parallel (one ninja run),
# 3. GPU tests, 4. a smoke benchmark. Logs and JSON go to $OUT (default /tmp/coda_out).
# A machine whose disk does not persist can start from an earlier run's kernels and pass its own on:
#   CODA_KERNELS="k.part1.tar.gz k.part2.tar.gz": imported first (coda-dsl cache import; made by an earlier
#   run, or without a GPU by tests/prebuild_without_gpu.py);
#   CODA_EXPORT=$OUT/k.tar.gz: every built kernel exported at the end, in parts of 50 MB of kernel files
#   (about 13 MB gzipped: the whole suite's kernels in 3 parts, for callers that take few files back).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/coda_out}; mkdir -p "$OUT"; export OUT
export PYTHONUNBUFFERED=1 CODA_DSL_CACHE=${CODA_DSL_CACHE:-/tmp/coda_cache}
if ! python3 -c "import cutlass_library" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m coda_dsl doctor 2>&1 | tee "$OUT/doctor.log"
[ -n "${CODA_KERNELS:-}" ] && python3 -m coda_dsl cache import $CODA_KERNELS
rc=0
s=$(date +%s)
python3 -m pytest tests/test_gpu.py tests/test_gpu_nn.py -q -rs "$@" 2>&1 | tee "$OUT/gpu_tests.log" || rc=1
echo "gpu tests: $(( $(date +%s) - s )) s (builds included)"
python3 -m coda_dsl demo 2>&1 | tee "$OUT/demo.log" || rc=1
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 -m bench.host_overhead 2>&1 | tee "$OUT/host_overhead.md" || rc=1
  # BENCH_ARGS="" runs every shape; the default is a quick smoke run
  python3 -m bench ${BENCH_ARGS---shapes 4096x4096x4096 --ce-shape 4096x4096x32000 --iters 20} 2>"$OUT/bench_progress.log" \
    | tee "$OUT/bench.md" || rc=1
  if [ "${TUNE:-0}" = 1 ]; then  # tune in one process, reuse the record in a second one
    python3 -m bench.tuning 2>&1 | tee "$OUT/tuning.log" || rc=1
    python3 -m bench.tuning --reuse 2>&1 | tee -a "$OUT/tuning.log" || rc=1
  fi
fi
# keep the logs of failed builds (first 60 kB each) for the caller
for d in "$CODA_DSL_CACHE"/failed/*/; do
  [ -f "$d/build.log" ] && { echo "=== $d"; head -c 60000 "$d/build.log"; } >> "$OUT/failed_builds.log"
done
[ -n "${CODA_EXPORT:-}" ] && { python3 -m coda_dsl cache export "$CODA_EXPORT" --part-mb 50 || rc=1; }
exit $rc
