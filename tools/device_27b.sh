#!/bin/bash
# The H200 evidence runs at the 27B shape, one part per device call (each fits its 10 minutes).
#   bash tools/device_27b.sh PART     PART: pack | kernel-cache | server | routes | starts-first | starts | memory | parity | parity-contexts | parity-tokens | rounds | e2e | e2e-long | prefix-4k | fp32-kernels | tune | compare | profile | decode-probe | ncu | kernels
#   bash tools/device_27b.sh all      prints the device calls (and the local steps after them) that
#                                     regenerate every GPU record README quotes, at HEAD: eleven calls,
#                                     one part each (no two of them fit one call's 585 s)
# Records name the commit they measured (tools/records.py git_state). The device's copy of the
# tree has no git history: pass RECORD_GIT_COMMIT (the full hash of the commit sent, `git
# rev-parse HEAD` here) and RECORD_GIT_CLEAN (1: no uncommitted change to tracked files; 0: some)
# in the device call's command, as `all` prints them. The parts whose records README quotes
# (parity, rounds, e2e, e2e-long, prefix-4k, starts-first, starts) refuse to run without them where there is no git.
# Runs in the repository root on the GPU machine, after ../shared/device's staging (mlx-cuda,
# mlx-vlm and the server's wheels; fastapi there also needs opentelemetry-api; the kernels part
# needs pytest's wheels: EXTRA_WHEELS="pytest==9.0.3 pluggy==1.6.0 iniconfig==2.3.0
# packaging==26.2 pygments==2.20.0"). Records go to
# $OUT (the device tool brings them back); copy them into evidence/ here. Scratch lives in
# /tmp, which a warm machine keeps between calls: the pack that server and routes build once,
# and the records that a later part adds to: the round phase's for e2e, parity's earlier parts'
# for its contexts and token runs (carried back in as .gpu/b27/ or .gpu/parity/ if the machine went cold
# in between).
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

# DENSE_DTYPE=float32: the target's unpacked tensors fp32, as the real 27B file holds them (its
# activations fp32; the exact kernels take fp16 rows): bench and parity records named -fp32
DENSE=${DENSE_DTYPE:-float16}
SUFFIX=$([ "$DENSE" = float32 ] && echo -fp32)
# --verdict-cache: the rounds part's start-up checks (about 210 s of self-tests in fp32 on the H100
# at 3b80a8a) serve the e2e parts after it on the same warm machine, as a server's second start
BENCH=(python3 tools/bench.py --size 27b --out /tmp/b27 --tokens 40 --repeats 5 --fixed-blocks 2,4,8
       --drafter-forms 4bit --no-all-decode-arms --no-first-request-arms --dense-dtype "$DENSE" --verdict-cache)
mkdir -p "$OUT" /tmp/b27

need_commit() {  # a record README quotes must name its commit (tests/test_evidence_tools.py checks it)
  [ -n "${RECORD_GIT_COMMIT:-}" ] || git rev-parse HEAD > /dev/null 2>&1 || {
    echo "no git history here: run as RECORD_GIT_COMMIT=<full hash> RECORD_GIT_CLEAN=<1|0> bash tools/device_27b.sh $1" >&2
    exit 3; }
}

plan() {  # the device calls that regenerate README's GPU records at this commit, then the local steps
  local commit clean
  commit=$(git rev-parse HEAD 2>/dev/null) || commit=${RECORD_GIT_COMMIT:-'<full hash of the commit sent>'}
  if git rev-parse HEAD > /dev/null 2>&1; then
    [ -z "$(git status --porcelain --untracked-files=no)" ] && clean=1 || clean=0
  else clean=${RECORD_GIT_CLEAN:-'<1|0>'}; fi
  cat <<PLAN
Regenerating every GPU record README quotes (parity-cuda, bench-cuda-27b, bench-cuda-27b-fp32, prefix-cache-cuda-27b-4k, starts-cuda)
at $commit: eleven device calls of one H200 (nvidia-h200), in this order, each under 585 s
(about 75 minutes of device time in all, start-up not counted: more than one session's 30;
a session that runs out leaves the rest to the next, at the commit it then has):
  1. RECORD_GIT_COMMIT=$commit RECORD_GIT_CLEAN=$clean bash tools/device_27b.sh parity           # controls, verify, rollback, kernels
  2. RECORD_GIT_COMMIT=$commit RECORD_GIT_CLEAN=$clean bash tools/device_27b.sh parity-contexts  # the same at 7 contexts, prefill routes
  3. RECORD_GIT_COMMIT=$commit RECORD_GIT_CLEAN=$clean bash tools/device_27b.sh parity-tokens    # ~400 s: greedy and sampled token runs
  4. RECORD_GIT_COMMIT=$commit RECORD_GIT_CLEAN=$clean bash tools/device_27b.sh rounds           # ~310 s: bench round phase
  5. RECORD_GIT_COMMIT=$commit RECORD_GIT_CLEAN=$clean bash tools/device_27b.sh e2e              # ~450 s: 40 tokens, greedy + sampled
  6. RECORD_GIT_COMMIT=$commit RECORD_GIT_CLEAN=$clean bash tools/device_27b.sh e2e-long         # ~510 s: 256 tokens, greedy, the peer
  7. RECORD_GIT_COMMIT=$commit RECORD_GIT_CLEAN=$clean bash tools/device_27b.sh prefix-4k        # ~420 s
  8. RECORD_GIT_COMMIT=$commit RECORD_GIT_CLEAN=$clean DENSE_DTYPE=float32 bash tools/device_27b.sh rounds  # ~480 s (H100): fp32 activations
  9. RECORD_GIT_COMMIT=$commit RECORD_GIT_CLEAN=$clean bash tools/device_27b.sh pack           # ~120 s (H100): the 27B-shape pack
 10. RECORD_GIT_COMMIT=$commit RECORD_GIT_CLEAN=$clean bash tools/device_27b.sh starts-first   # ~575 s (H100): a first start
 11. RECORD_GIT_COMMIT=$commit RECORD_GIT_CLEAN=$clean bash tools/device_27b.sh starts         # ~80 s: second, after a reboot
Calls 2 and 3 add to the record call 1 left in /tmp/parity, calls 5 and 6 to call 4's in /tmp/b27, 10
and 11 read call 9's pack and 11 call 10's first start (one warm machine); if
the machine went cold in between, carry the latest parity-cuda.json or bench-cuda-27b.json back
in as .gpu/parity/ or .gpu/b27/ (carry: [".gpu"]). Copy each call's \$OUT records into
evidence/ as they come back (call 7's from \$OUT/p4k/). Then, here:
  python tools/records.py --readme
  python -m pytest -q tests/test_evidence_tools.py
PLAN
}

case "${1:-}" in
  all|plan) plan ;;
  server) build_pack; t=$(left) || exit 124; timeout "$t" python3 tools/bench_server.py --pack /tmp/pack27 --max-tokens 32 --repeats 5 --out "$OUT" ;;
  routes) build_pack; t=$(left) || exit 124; timeout "$t" python3 tools/bench_routes.py --pack /tmp/pack27 --max-tokens 32 --repeats 5 --out "$OUT" ;;
  # pack: only the pack the server parts read (/tmp/pack27), in a call of its own or after
  # another part in the same call, so that starts or memory later has its whole call
  pack) build_pack ;;
  # starts-first, then starts: a first start of serve_dflash2.py, then a second and one after a
  # reboot (its temp folder emptied), sharing one HOME (the verdicts and kernels cached) kept in
  # /tmp/starts on the warm machine. On the H100 at 23e968f a first start took 504 s (the call
  # 575 s of its 585) and a second 29 s: one call for the first, one for the others, the pack
  # built in an earlier call (pack).
  # starts runs all three where no first start is kept.
  starts-first) need_commit starts-first; build_pack; t=$(left) || exit 124
    timeout "$t" python3 tools/bench_starts.py --pack /tmp/pack27 --scratch /tmp/starts --starts first --out "$OUT" ;;
  starts) need_commit starts; build_pack; t=$(left) || exit 124
    [ -f /tmp/starts/starts.json ] && later="second,after a reboot" || later="first,second,after a reboot"
    timeout "$t" python3 tools/bench_starts.py --pack /tmp/pack27 --scratch /tmp/starts --starts "$later" --out "$OUT" ;;
  # memory: speculation's extra peak over serve.py's over HTTP at 0.1k, 4k and 16k tokens (issue 49
  # item 6), serve_dflash2.py in rounds at a fixed block of 4; the in-process figures are prefix-4k's
  memory) build_pack; t=$(left) || exit 124; timeout "$t" python3 tools/bench_memory.py --pack /tmp/pack27 --contexts 100 4096 16384 --out "$OUT" ;;
  # rounds: 9 repeats, not 5 (sessions 24 and 25 discarded five-repeat runs whose decode
  # steps spread several-fold; the repeats add about a minute to a call of about five)
  rounds) need_commit rounds; t=$(left) || exit 124; timeout "$t" "${BENCH[@]}" --repeats 9 --part rounds; rc=$?; cp /tmp/b27/* "$OUT"/; exit $rc ;;
  # e2e: the greedy arms, and for sampled requests at temperatures $SAMPLED (default 0.6 and 1.0;
  # SAMPLED= leaves them out) plain seeded sampling and the policy per profile: 10 arms on top
  # of the greedy-only run's 18 (about 275 s), about 90 s more
  # PROFILES: the acceptance profiles measured end to end (default all; with DENSE_DTYPE=float32
  # code and median: there the start-up took 185 s and a pass of all 18 greedy arms 80 s, past
  # the call, session 44; at 3b80a8a the fp32 start-up's checks took 275 s, which the rounds
  # part's cached verdicts now spare an e2e part run after it on the same machine)
  e2e) need_commit e2e; [ -f /tmp/b27/bench-cuda-27b$SUFFIX.json ] || cp .gpu/b27/bench-cuda-27b$SUFFIX.json /tmp/b27/ || exit 7
       PROFILES=${PROFILES-$([ "$DENSE" = float32 ] && echo code,median)}
       t=$(left 590) || exit 124; timeout "$t" "${BENCH[@]}" --sampled-temperatures "${SAMPLED-0.6,1.0}" \
         ${PROFILES:+--profiles "$PROFILES"} --deadline-s 570 --part e2e; rc=$?; cp /tmp/b27/* "$OUT"/; exit $rc ;;
  # e2e-long: the greedy arms at 256 tokens a request (issue 49 item 2): plain (stock and the
  # installed path), and per profile the policy and block 8 (where profiles are named; the
  # stochastic model's tokens per round at every block are in acceptance_model), 3 repeats.
  # About 75 s a pass at today's speed, 4 passes with the warm-up, after about 130 s of start-up.
  # Its figures go on top of the record (the longest count's); e2e's 40 stay under e2e_by_tokens.
  # With the peer (issue 49 item 7): mlx-vlm's own speculative decoding at block 8 for chat, median
  # and code (zero's would verify 8 rows for each of 256 tokens, about 18 s a pass), an estimated
  # 20 s more a pass (not measured yet; the deadline refuses a call that would overrun).
  e2e-long) need_commit e2e-long; [ -f /tmp/b27/bench-cuda-27b$SUFFIX.json ] || cp .gpu/b27/bench-cuda-27b$SUFFIX.json /tmp/b27/ || exit 7
       t=$(left 590) || exit 124; timeout "$t" "${BENCH[@]}" --tokens 256 --repeats 3 --fixed-blocks 8 \
         --sampled-temperatures "" --peer-arms chat,median,code --deadline-s 570 --part e2e; rc=$?; cp /tmp/b27/* "$OUT"/; exit $rc ;;
  # prefix-4k: the prefix-cache record README quotes (next turn's first token at 4k, speculation's
  # extra memory at 0.1k, 1k, 4k and 16k); about 420 s
  prefix-4k) need_commit prefix-4k; t=$(left) || exit 124; timeout "$t" python3 tools/bench_prefix.py --size 27b \
       --out "$OUT/p4k" --speculative --contexts 4096 --step-sizes 256 --memory-contexts 100 1024 4096 16384 --repeats 5 ;;
  # fp32-kernels: the fp32 rows' kernels (packed matmul, gate rows, the convolution's block call, rotation)
  # self-tested at the 27B shapes and timed against the calls they replace (issue 49: the real
  # file's fp32 activations)
  fp32-kernels) t=$(left) || exit 124; timeout "$t" python3 tools/lab/kernel_parity.py --kernels qmv32,dense,conv32,rotate32 \
         --shapes 27b --bench --out "$OUT" ;;
  # decode-probe: the round phase's plain decode step against the start-up's, by condition
  # (tools/lab/decode_probe.py; about a minute after the start-up, which the rounds part's cached
  # verdicts spare on the same machine)
  decode-probe) t=$(left) || exit 124; timeout "$t" python3 tools/lab/decode_probe.py --size 27b --dense-dtype "$DENSE" \
         --verdict-cache --out "$OUT" ;;
  tune) t=$(left) || exit 124; timeout "$t" python3 tools/lab/kernel_parity.py --shapes 27b --seed 0 --bench --tune --out "$OUT" ;;
  # compare: the code's launch table against PREVIOUS (default: the last tune's 8-row pick),
  # interleaved; issue 13 item 3 holds the 8-row kernel to 1.2x MLX's single row. With
  # PREVIOUS_KERNELS (another revision's dflash2_kernels.py, carried in) the previous arm runs
  # that kernel, under its own table where PREVIOUS (then default '{}') names no launch.
  # 15 repeats: a run takes about 35 s on the H200, and 7 repeats put 8 rows at 1.34x where
  # 15, in the same session, put them at 1.24x; then 5 passes under CUPTI: the GPU time alone
  compare) [ -n "${PREVIOUS:-}" ] || PREVIOUS=${PREVIOUS_KERNELS:+'{}'}
           [ -n "$PREVIOUS" ] || PREVIOUS='{"8": [3, 2, 1, 2, 264]}'
           t=$(left) || exit 124; timeout "$t" python3 tools/lab/compare_qmv_launch.py --previous "$PREVIOUS" \
             ${PREVIOUS_KERNELS:+--previous-kernels "$PREVIOUS_KERNELS"} --repeats 15 --cupti-repeats 5 --out "$OUT" ;;
  profile) t=$(left) || exit 124; timeout "$t" python3 tools/lab/profile_verify.py --out "$OUT" ;;
  # parity in three calls: one process ran past 585 s on a fresh H200 (session 39: the token runs
  # had begun at 478 s), and the fp32 layout's verify part with the contexts in it did too (session
  # 44: model 95 s, controls and install to 503 s). Each part builds the model and installs the
  # runtime; parity-contexts adds the prefilled contexts' cases, parity-tokens the greedy and
  # sampled runs (3 settings x blocks 2..8, 16 tokens), each to the record the parts before left.
  parity) need_commit parity; mkdir -p /tmp/parity; t=$(left) || exit 124
       timeout "$t" python3 tools/parity.py --size 27b --out /tmp/parity --max-tokens 16 --part verify --dense-dtype "$DENSE"; rc=$?
       cp /tmp/parity/* "$OUT"/; exit $rc ;;
  parity-contexts|parity-tokens) need_commit "$1"; mkdir -p /tmp/parity
       [ -f /tmp/parity/parity-cuda$SUFFIX.json ] || cp .gpu/parity/parity-cuda$SUFFIX.json /tmp/parity/ || exit 7
       t=$(left) || exit 124
       timeout "$t" python3 tools/parity.py --size 27b --out /tmp/parity --max-tokens 16 --part "${1#parity-}" --dense-dtype "$DENSE"; rc=$?
       cp /tmp/parity/* "$OUT"/; exit $rc ;;
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
    python3 tools/lab/ncu_summary.py "$OUT/ncu-qmv.txt" "$OUT/ncu-sass.csv" --out "$OUT" ;;
  kernels)  # the kernel tests, their CUDA-only ones included (CPU CI skips those)
    t=$(left) || exit 124; timeout "$t" python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernel_*.py 2>&1 | tee "$OUT/kernels.txt" | tail -30 ;;
  # kernel-cache: dflash2_kernel_cache's tests (its CUDA ones: MLX runs a binary planted under a
  # module's name), then the pack, so that starts-first has its whole call
  kernel-cache)
    t=$(left) || exit 124; timeout "$t" python3 -m pytest -q -p no:cacheprovider tests/test_kernel_cache.py \
      tests/test_kernel_base.py 2>&1 | tee "$OUT/kernel-cache.txt" | tail -30
    build_pack ;;
  *) echo "usage: bash tools/device_27b.sh all|pack|server|routes|starts-first|starts|memory|parity|parity-contexts|parity-tokens|rounds|e2e|e2e-long|prefix-4k|fp32-kernels|tune|compare|profile|ncu|kernels|kernel-cache" >&2; exit 2 ;;
esac
