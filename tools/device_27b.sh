#!/bin/bash
# The H200 evidence runs at the 27B shape, one part per device call (each fits its 10 minutes).
#   bash tools/device_27b.sh PART     PART: server | routes | starts | rounds | e2e | tune | tune-shapes | compare | launch-cost | profile | ncu | parity | kernels | graphs
# Runs in the repository root on the GPU machine, after ../shared/device's staging (mlx-cuda,
# mlx-vlm and the server's wheels; fastapi there also needs opentelemetry-api; the kernels part
# needs pytest's wheels: EXTRA_WHEELS="pytest==9.0.3 pluggy==1.6.0 iniconfig==2.3.0
# packaging==26.2 pygments==2.20.0"). Records go to
# $OUT (the device tool brings them back); copy them into evidence/ here. Scratch lives in
# /tmp, which a warm machine keeps between calls: the pack that server and routes build once,
# and the round-phase record that e2e adds to (carried back in as .gpu/b27/ if the machine
# went cold in between).
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
started=$(date +%s)
left() {  # seconds left of this call's limit (585 unless given); none left: stop
  local t=$(( ${1:-585} - ($(date +%s) - started) ))
  (( t > 0 )) || { echo "no time left in this call" >&2; exit 124; }
  echo "$t"
}

build_pack() {  # the 27B-shape pack with a 4-bit random drafter (zero acceptance), once
  [ -f /tmp/pack27/serve_dflash2.py ] && return
  python3 tools/make_synthetic_pack.py --size 27b --seed 0 --out /tmp/src27 --drafter-form 4bit > /tmp/make.log 2>&1 \
    && python3 tools/build_pack.py --base /tmp/src27/target --drafter /tmp/src27/drafter --out /tmp/pack27 > /tmp/build.log 2>&1 \
    || { tail -20 /tmp/make.log /tmp/build.log; exit 5; }
  rm -rf /tmp/src27
  echo "pack built in $(( $(date +%s) - started )) s"
}

BENCH=(python3 tools/bench.py --size 27b --out /tmp/b27 --tokens 40 --repeats 5 --fixed-blocks 2,4,8
       --drafter-forms 4bit --no-all-decode-arms --no-first-request-arms)
mkdir -p "$OUT" /tmp/b27
case "${1:-}" in
  server) build_pack; t=$(left) || exit 124; timeout "$t" python3 tools/bench_server.py --pack /tmp/pack27 --max-tokens 32 --repeats 5 --out "$OUT" ;;
  routes) build_pack; t=$(left) || exit 124; timeout "$t" python3 tools/bench_routes.py --pack /tmp/pack27 --max-tokens 32 --repeats 5 --out "$OUT" ;;
  # starts: a first and a second start of serve_dflash2.py sharing one HOME (the verdict cache);
  # a first start takes about 5 minutes at the 27B shape: build the pack in an earlier call (server)
  starts) build_pack; t=$(left) || exit 124; timeout "$t" python3 tools/bench_starts.py --pack /tmp/pack27 --out "$OUT" ;;
  # rounds: 9 repeats, not 5 (sessions 24 and 25 discarded five-repeat runs whose decode
  # steps spread several-fold; the repeats add about a minute to a call of about five)
  rounds) t=$(left) || exit 124; timeout "$t" "${BENCH[@]}" --repeats 9 --part rounds; rc=$?; cp /tmp/b27/* "$OUT"/; exit $rc ;;
  # e2e: the greedy arms, and for sampled requests at temperatures $SAMPLED (default 0.6 and 1.0;
  # SAMPLED= leaves them out) plain seeded sampling and the policy per profile: 10 arms on top
  # of the greedy-only run's 18 (about 275 s), about 90 s more
  e2e) [ -f /tmp/b27/bench-cuda-27b.json ] || cp .gpu/b27/bench-cuda-27b.json /tmp/b27/ || exit 7
       t=$(left 590) || exit 124; timeout "$t" "${BENCH[@]}" --sampled-temperatures "${SAMPLED-0.6,1.0}" \
         --deadline-s 570 --part e2e; rc=$?; cp /tmp/b27/* "$OUT"/; exit $rc ;;
  tune) t=$(left) || exit 124; timeout "$t" python3 tools/kernel_parity.py --shapes 27b --seed 0 --bench --tune --out "$OUT" ;;
  # tune-shapes: the fastest launch per 27B shape and row count, then a fresh check against the table's
  tune-shapes) t=$(left) || exit 124; timeout "$t" python3 tools/tune_qmv_shapes.py --out "$OUT" ;;
  # compare: the code's launch table against PREVIOUS (default: the last tune's 8-row pick),
  # interleaved; issue 13 item 3 holds the 8-row kernel to 1.2x MLX's single row. With
  # PREVIOUS_KERNELS (another revision's dflash2_kernels.py, carried in) the previous arm runs
  # that kernel, under its own table where PREVIOUS (then default '{}') names no launch.
  # 15 repeats: a run takes about 35 s on the H200, and 7 repeats put 8 rows at 1.34x where
  # 15, in the same session, put them at 1.24x; then 5 passes under CUPTI: the GPU time alone
  compare) [ -n "${PREVIOUS:-}" ] || PREVIOUS=${PREVIOUS_KERNELS:+'{}'}
           [ -n "$PREVIOUS" ] || PREVIOUS='{"8": [3, 2, 1, 2, 264]}'
           t=$(left) || exit 124; timeout "$t" python3 tools/compare_qmv_launch.py --previous "$PREVIOUS" \
             ${PREVIOUS_KERNELS:+--previous-kernels "$PREVIOUS_KERNELS"} --repeats 15 --cupti-repeats 5 --out "$OUT" ;;
  launch-cost) t=$(left) || exit 124; timeout "$t" python3 tools/launch_cost.py --out "$OUT" ;;
  profile) t=$(left) || exit 124; timeout "$t" python3 tools/profile_verify.py --out "$OUT" ;;
  graphs) t=$(left) || exit 124; timeout "$t" python3 tools/graph_misses.py --out "$OUT" ;;
  # parity: about 430 s greedy-only; the sampled runs (3 settings x blocks 2..8, 16 tokens) and the
  # block sampling self-test add well under a minute
  parity) t=$(left) || exit 124; timeout "$t" python3 tools/parity.py --size 27b --out "$OUT" --max-tokens 16 ;;
  ncu)  # Nsight Compute on MLX's single-row qmv and the exact kernel at 1 and 8 rows, one
        # launch each at (17408, 5120): where the 8-row kernel stalls (issue 13 item 3)
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    [ -x "$ncu" ] || { echo "no ncu on this machine" >&2; exit 6; }
    t=$(left) || exit 124
    timeout "$t" "$ncu" --clock-control none -k regex:qmv --launch-count 3 --print-details all \
      --export "$OUT/ncu-qmv" --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
      --section MemoryWorkloadAnalysis_Tables --section InstructionStats --section SourceCounters python3 -c '
import mlx.core as mx, dflash2_kernels as dk
w = dk.make_weights(17408, 5120, mx.random.key(0)); x = dk.make_inputs("normal", 8, 5120, mx.random.key(1))
mx.eval(w, x)
for rows, call in ((1, dk.stock_rows), (1, dk.cuda_matmul), (8, dk.cuda_matmul)):
    mx.eval(call(x[:rows], *w))
' 2>&1 | tail -3
    # an exported run prints no results: read them back from the report
    "$ncu" --import "$OUT/ncu-qmv.ncu-rep" --page details --print-details all > "$OUT/ncu-qmv.txt" 2>&1
    "$ncu" --import "$OUT/ncu-qmv.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu-sass.csv" 2>&1
    python3 tools/ncu_summary.py "$OUT/ncu-qmv.txt" "$OUT/ncu-sass.csv" --out "$OUT" ;;
  kernels)  # the kernel tests, their CUDA-only ones included (CPU CI skips those)
    t=$(left) || exit 124; timeout "$t" python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernel_*.py 2>&1 | tee "$OUT/kernels.txt" | tail -30 ;;
  *) echo "usage: bash tools/device_27b.sh server|routes|rounds|e2e|tune|tune-shapes|compare|launch-cost|profile|ncu|parity|kernels|graphs" >&2; exit 2 ;;
esac
