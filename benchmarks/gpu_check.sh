#!/usr/bin/env bash
# One prepared run for a GPU machine (sized for one H200 and 16 cores, < 8 minutes):
#   env        what is there (python, torch, GPU, nvcc, compute-sanitizer, pytest plugins)
#   build      the CUDA extension in place (MAX_JOBS, this GPU's architecture only)
#   tests      every cuda-marked test (tests/test_kernel_cuda.py: all tile configs)
#   memcheck   compute-sanitizer memcheck on one small shape (benchmarks/sanitize_shape.py)
#   racecheck  compute-sanitizer racecheck on the same shape
#   bench      bench_kernel.py: ringseq per tile config vs torch SDPA flash and cuDNN,
#              b=2 h=16 s=4096,8192 d=64,128 bf16, causal and full, fwd and fwd+bwd; and
#              the spans path: a causal sliding window of 1024 at s=8192 d=128, soft-cap
#              off and 50 (against SDPA efficient with the window as a mask)
#   ring       bench_ring.py over NCCL at W=1 (W=2 too with >= 2 GPUs): zigzag causal bf16,
#              spot check against float64 and ring overhead
# The sanitizers run right after the tests so that a slow stage cannot cut them. Each stage
# runs under `timeout` with its own limit (the sum of the limits plus a reserve fits the
# budget, which --dry-run checks), capped by the time left before the overall deadline.
# A compact table is printed last; OUT gets summary.txt, summary.json, results.md (a section
# for benchmarks/RESULTS.md) and raw.tar.gz (every log, junit XML and JSON).
#
#   bash benchmarks/gpu_check.sh                  # all stages
#   bash benchmarks/gpu_check.sh --dry-run        # plan and stage budgets; exit 1 if they do not fit
#   bash benchmarks/gpu_check.sh --stages build,tests
#
# Needs: python with a CUDA build of torch, einops (ringseq imports it) and pytest; nvcc of the
# same CUDA major; no network. Without einops or pytest the check stops after env (and --dry-run
# fails), before the build spends its minutes.
# Optional: ninja (else a serial build), compute-sanitizer, pytest-xdist and pytest-timeout
# (used when present), flash_attn (then also benchmarked).
# Environment: OUT (default gpu_check_out), PYTHON (default: python3 or python, whichever
# imports torch), MAX_JOBS (default 16), GPU_CHECK_BUDGET_S (overall deadline, default 470,
# at most 480), GPU_CHECK_<STAGE>_S (a stage's limit, e.g. GPU_CHECK_BUILD_S), KEEP_RAW=1
# (leave OUT/raw/ unpacked as well).
# Exit: 0 every stage that ran passed, 1 a stage failed or timed out or a required module is
# missing (dry run: that, or the limits do not fit the budget), 2 no CUDA device (nothing run
# that needs one), 64 bad usage.
set -u -o pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$(pwd)
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
RAW="$OUT/raw"
rm -rf "$RAW" "$OUT/raw.tar.gz"
mkdir -p "$RAW" || exit 1
BUDGET=${GPU_CHECK_BUDGET_S:-470}
HARD_CAP=480     # 8 minutes: the whole run, summary included
RESERVE=15       # summary, packing and the kill grace of a stage that hits its limit
KILL_GRACE=5
export MAX_JOBS=${MAX_JOBS:-16}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# Stage order and limits (seconds): the single source for the run and the dry-run check.
# env is generous because a timed-out probe reads as "no GPU" and skips every other stage.
STAGE_NAMES=(env build tests memcheck racecheck bench ring)
declare -A LIMIT=([env]=25 [build]=115 [tests]=95 [memcheck]=40 [racecheck]=55 [bench]=70 [ring]=55)
for s in "${STAGE_NAMES[@]}"; do
  var="GPU_CHECK_${s^^}_S"
  [ -n "${!var:-}" ] && LIMIT[$s]=${!var}
done

DRY=0
STAGES=""
usage() { sed -n '2,30p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --stages) shift; STAGES=$(echo "${1:-}" | tr ',' ' ') ;;
    --stages=*) STAGES=$(echo "${1#*=}" | tr ',' ' ') ;;
    --budget) shift; BUDGET=${1:-$BUDGET} ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check: unknown argument $1" >&2; usage >&2; exit 64 ;;
  esac
  shift
done
if [ -n "$STAGES" ]; then
  for s in $STAGES; do
    [ -n "${LIMIT[$s]:-}" ] || { echo "gpu_check: unknown stage $s (have: ${STAGE_NAMES[*]})" >&2; exit 64; }
  done
  case " $STAGES " in *" env "*) ;; *) STAGES="env $STAGES" ;; esac
else
  STAGES="${STAGE_NAMES[*]}"
fi
wanted() { case " $STAGES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

START=$(date +%s)
FAILED=0
STAGE_RC=0
elapsed() { echo $(( $(date +%s) - START )); }
record() { echo "$1|$2|$3|${LIMIT[$1]:-0}|$4" >>"$RAW/stages.txt"; }
: >"$RAW/stages.txt"

# run_stage NAME NOTE_ON_OK CMD...   (output -> $RAW/NAME.log)
run_stage() {
  local name=$1 okmsg=$2; shift 2
  local left=$(( START + BUDGET - RESERVE - $(date +%s) ))
  STAGE_RC=1
  if [ "$left" -lt 5 ]; then
    record "$name" skipped 0 "overall budget of ${BUDGET}s used up"
    echo "== [$name] skipped: budget used up"
    return 0
  fi
  local limit=${LIMIT[$name]}
  [ "$left" -lt "$limit" ] && limit=$left
  local log="$RAW/$name.log"
  echo "== [$name] start at +$(elapsed)s, limit ${limit}s: $*"
  local t0 t1 rc secs status note summary
  t0=$(date +%s.%N)
  timeout -k "$KILL_GRACE" "$limit" "$@" >"$log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  if [ $rc -eq 0 ]; then
    status=ok; note=$okmsg
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    status=TIMEOUT; note="timed out (limit ${limit}s)"; FAILED=1
  else
    status="FAIL($rc)"; note="see raw/$name.log"; FAILED=1
  fi
  summary=$(grep -E '[0-9]+ (passed|failed|skipped|error)' "$log" | tail -n 1 | sed 's/=//g; s/^ *//; s/ *$//')
  [ -n "$summary" ] && note="$summary"
  STAGE_RC=$rc
  record "$name" "$status" "$secs" "$note"
  echo "== [$name] $status in ${secs}s: $note"
  if [ "$status" != ok ]; then tail -n 30 "$log" | sed "s/^/   [$name] /"; else tail -n 3 "$log" | sed "s/^/   [$name] /"; fi
}

# ---------------------------------------------------------------- env (always)
ENV_JSON="$RAW/env.json"
ENV_T0=$(date +%s)
probe_env() {  # probe_env SECONDS PYTHON
timeout -k 2 "$1" "$2" - "$ENV_JSON" >"$RAW/env.log" 2>&1 <<'EOF'
import glob, json, os, shutil, subprocess, sys
info = {"python": sys.version.split()[0], "executable": sys.executable}
try:
    import torch
    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    info["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = "%d.%d" % torch.cuda.get_device_capability(0)
        info["gpu_count"] = torch.cuda.device_count()
        info["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
except Exception as exc:  # report, never crash the check
    info["torch"] = f"not importable: {exc}"
    info["cuda_available"] = False
home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
nvcc = shutil.which("nvcc") or os.path.join(home, "bin", "nvcc")
try:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=10).stdout
    rel = [l for l in out.splitlines() if "release" in l]
    info["nvcc"] = rel[0].split("release", 1)[1].strip() if rel else "no version line"
except Exception as exc:
    info["nvcc"] = f"not found ({exc.__class__.__name__})"
try:
    import ninja  # noqa: F401
    info["ninja"] = "python package"
except Exception:
    info["ninja"] = shutil.which("ninja") or "MISSING: torch builds the extension serially (slower)"
cands = [shutil.which("compute-sanitizer"), os.path.join(home, "bin", "compute-sanitizer")]
cands += sorted(glob.glob("/usr/local/cuda*/bin/compute-sanitizer"))
cands += sorted(glob.glob("/opt/nvidia/*/compute-sanitizer")) + sorted(glob.glob("/opt/nvidia/*/*/compute-sanitizer"))
info["compute_sanitizer"] = next((c for c in cands if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)
for mod in ("flash_attn", "triton", "einops", "pytest", "xdist", "pytest_timeout"):
    try:
        m = __import__(mod)
        info[mod] = getattr(m, "__version__", "present")
    except Exception:
        info[mod] = None
info["cpus"] = os.cpu_count()
# import ringseq needs einops, the tests pytest: without them every stage after env fails
info["missing"] = ",".join(m for m in ("einops", "pytest") if info[m] is None)
json.dump(info, open(sys.argv[1], "w"), indent=1)
for k, v in info.items():
    print(f"{k:18} {v}")
if info["missing"]:
    print(f"MISSING: {info['missing']} (pip install {info['missing'].replace(',', ' ')})")
# (3: no torch here, try the next python; 4: torch imports, a module it needs is missing)
sys.exit(3 if "torch_cuda" not in info else 4 if info["missing"] else 0)
EOF
}
# PYTHON, else python3, else python: the first one that imports torch
if [ -n "${PYTHON:-}" ]; then CANDS=("$PYTHON"); else CANDS=(python3 python); fi
ENV_RC=127
PY=${CANDS[0]}
for cand in "${CANDS[@]}"; do
  command -v "$cand" >/dev/null 2>&1 || continue
  left=$(( ENV_T0 + LIMIT[env] - $(date +%s) ))
  [ "$left" -ge 2 ] || break
  PY=$cand
  probe_env "$left" "$PY"
  ENV_RC=$?
  { [ $ENV_RC -eq 0 ] || [ $ENV_RC -eq 4 ]; } && break  # (4: torch imports, a module is missing)
done
echo "== [env] python=$PY out=$OUT budget=${BUDGET}s"
sed 's/^/   /' "$RAW/env.log"
jget() { "$PY" -c "import json,sys; v=json.load(open('$ENV_JSON')).get('$1'); print('' if v is None else v)" 2>/dev/null; }
HAS_GPU=0
# (4: a required module is missing; the GPU is still reported as it is)
{ [ $ENV_RC -eq 0 ] || [ $ENV_RC -eq 4 ]; } && [ "$(jget cuda_available)" = "True" ] && HAS_GPU=1
MISSING=$( [ $ENV_RC -eq 4 ] && jget missing )
GPU_COUNT=$(jget gpu_count); GPU_COUNT=${GPU_COUNT:-0}
SANITIZER=$(jget compute_sanitizer)
BACKENDS="ringseq,sdpa_flash,sdpa_cudnn"
[ -n "$(jget flash_attn)" ] && BACKENDS="$BACKENDS,flash_attn"
record env "$([ $ENV_RC -eq 0 ] && echo ok || echo "FAIL($ENV_RC)")" "$(( $(date +%s) - ENV_T0 ))" \
  "$(jget gpu) torch $(jget torch), nvcc $(jget nvcc)${MISSING:+; MISSING: $MISSING}"
[ -n "$MISSING" ] && FAILED=1

# torch's CUDA headers (ATen/cuda/CUDAContext.h) include cusparse.h/cublas.h. A minimal CUDA
# toolkit lacks them, while the pip wheels torch depends on ship them (nvidia/*/include):
# point the host compiler there instead of failing the build.
CUDA_INC_EXTRA=$(timeout 20 "$PY" - <<'EOF2' 2>/dev/null
import glob, os, shutil, site, sys
home = os.environ.get("CUDA_HOME") or (os.path.dirname(os.path.dirname(shutil.which("nvcc"))) if shutil.which("nvcc") else "/usr/local/cuda")
if not os.path.exists(os.path.join(home, "include", "cusparse.h")):
    for root in site.getsitepackages() + [site.getusersitepackages()] + sys.path:
        hits = sorted(glob.glob(os.path.join(root, "nvidia", "*", "include", "cusparse.h")))
        if hits:
            print(os.path.dirname(hits[0]))
            break
EOF2
)
if [ -n "$CUDA_INC_EXTRA" ]; then
  export CPATH="$CUDA_INC_EXTRA${CPATH:+:$CPATH}"
  echo "== [env] toolkit has no cusparse.h: CPATH += $CUDA_INC_EXTRA (headers of torch's nvidia wheels)"
fi

# ---------------------------------------------------------------- commands
# Build in place for the visible GPU's architecture only (unless TORCH_CUDA_ARCH_LIST is set):
# half the compile time of sm_80 + sm_90, and the .so is importable through PYTHONPATH=$ROOT.
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ] && [ $HAS_GPU -eq 1 ]; then
  TORCH_CUDA_ARCH_LIST=$(jget capability)
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
fi
BUILD_CMD=(bash -c "RINGSEQ_CUDA=1 '$PY' setup.py build_ext --inplace \
&& '$PY' -c 'import ringseq._C as c, sys; print(\"ringseq._C:\", c.__file__, \"WITH_CUDA =\", c.WITH_CUDA); sys.exit(0 if c.WITH_CUDA else 3)'")
# the files with cuda-marked tests only: collecting the whole suite imports what they never use
mapfile -t CUDA_TEST_FILES < <(grep -l "pytest.mark.cuda" tests/test_*.py)
TEST_CMD=("$PY" -m pytest -m cuda -q -rfE -p no:cacheprovider --durations=8 --junitxml="$RAW/tests.xml"
          "${CUDA_TEST_FILES[@]}")
# xdist: the tests are launch- and Python-bound, four processes share the GPU well
[ -n "$(jget xdist)" ] && TEST_CMD+=(-n 4)
# per-test limit: a hang shows up as one failed test, not as a stage timeout with no report
[ -n "$(jget pytest_timeout)" ] && TEST_CMD+=(--timeout 60)
SAN_FILTER=()
if [ -n "$SANITIZER" ]; then
  san_help=$(timeout 20 "$SANITIZER" --help 2>&1)
  # instrument our kernels only: torch's own launches stay fast
  if grep -q -- "--kernel-name " <<<"$san_help"; then SAN_FILTER=(--kernel-name kns=flash_)
  elif grep -q -- "--kernel-regex" <<<"$san_help"; then SAN_FILTER=(--kernel-regex kns=flash_); fi
fi
SAN_ARGS=(--error-exitcode 7 --print-limit 20 "${SAN_FILTER[@]}" "$PY" benchmarks/sanitize_shape.py --quick)
MEMCHECK_CMD=("${SANITIZER:-compute-sanitizer}" --tool memcheck "${SAN_ARGS[@]}")
RACECHECK_CMD=("${SANITIZER:-compute-sanitizer}" --tool racecheck "${SAN_ARGS[@]}")
# every tile config of the forward (csrc/kernel_math.h kNumFwdConfigs; the backward of config 2
# is config 0's, and d=64's config 2 is its config 0 tile)
TILE_CONFIGS=0,1,2
# --masks: then the spans path (a causal window of 1024 keys at s=8192 d=128, soft-cap off and
# 50, against SDPA efficient with the window as a mask): a few seconds, no extra process
BENCH_CMD=("$PY" benchmarks/bench_kernel.py --device cuda --backends "$BACKENDS" --batch 2 --heads 16
           --seqlens 4096,8192 --headdims 64,128 --causal both --dtype bf16 --tile-configs "$TILE_CONFIGS"
           --masks 1024:0,50 --warmup 1 --repeats 3 --json "$RAW/bench_kernel.json")
RING_ARGS="--layouts zigzag --causal true --dtype bf16 --batch 1 --heads 16 --headdim 128 --seqlen 16384 --modes fwd,fwd_bwd --repeats 3 --timeout 60"
# W=1 always; W=2 only where a second GPU exists. Each run bounded on its own.
RUN_W() {  # the command line of bench_ring.py at W=$1 ranks under torchrun, bounded by $2 seconds
  echo "timeout -k 5 $2 '$PY' -m torch.distributed.run --standalone --nproc-per-node $1 benchmarks/bench_ring.py $RING_ARGS --json '$RAW/ring_w$1.json'"
}
RING_CMD=(bash -c "$(RUN_W 1 $(( LIMIT[ring] / 2 ))) || exit \$?; if [ $GPU_COUNT -ge 2 ]; then $(RUN_W 2 $(( LIMIT[ring] / 2 - 5 ))); else echo 'W=2 skipped: one GPU'; fi")

# ---------------------------------------------------------------- plan (dry run)
if [ $DRY -eq 1 ]; then
  total=0
  for s in "${STAGE_NAMES[@]}"; do total=$(( total + ${LIMIT[$s]} )); done
  echo "== plan (dry run; stages: $STAGES)"
  for s in "${STAGE_NAMES[@]}"; do
    case $s in
      env) cmd="python/torch/GPU/nvcc/sanitizer probe" ;;
      build) cmd="MAX_JOBS=$MAX_JOBS TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-<this GPU>} ${BUILD_CMD[*]}" ;;
      tests) cmd="${TEST_CMD[*]}" ;;
      memcheck) cmd="${MEMCHECK_CMD[*]}" ;;
      racecheck) cmd="${RACECHECK_CMD[*]}" ;;
      bench) cmd="${BENCH_CMD[*]}" ;;
      ring) cmd="${RING_CMD[*]}" ;;
    esac
    printf 'PLAN stage=%s limit=%s %s: %s\n' "$s" "${LIMIT[$s]}" "$(wanted "$s" && echo run || echo off)" "$cmd"
  done
  [ -n "$SANITIZER" ] || echo "   note: compute-sanitizer not found here: memcheck/racecheck would be skipped"
  [ $HAS_GPU -eq 1 ] || echo "   note: no CUDA device visible here: a real run would stop after env"
  if [ -n "$MISSING" ]; then
    echo "gpu_check: FAIL: $PY cannot import $MISSING: every stage after env would fail (pip install ${MISSING//,/ })"
    exit 1
  fi
  echo "PLAN total_limits=$total reserve=$RESERVE budget=$BUDGET cap=$HARD_CAP"
  if [ $(( total + RESERVE )) -gt "$BUDGET" ] || [ "$BUDGET" -gt $HARD_CAP ]; then
    echo "gpu_check: FAIL: stage limits ($total s) + reserve ($RESERVE s) must fit the budget ($BUDGET s) and the budget the ${HARD_CAP}s cap"
    exit 1
  fi
  echo "gpu_check: plan fits: ${total}s of stage limits + ${RESERVE}s reserve <= ${BUDGET}s budget <= ${HARD_CAP}s"
  exit 0
fi
if [ "$BUDGET" -gt $HARD_CAP ]; then
  echo "gpu_check: budget ${BUDGET}s is over the ${HARD_CAP}s cap" >&2; exit 64
fi

# ---------------------------------------------------------------- stages
SAN_UNSUPPORTED=0
BUILD_FAILED=0
for s in "${STAGE_NAMES[@]}"; do
  [ "$s" = env ] && continue
  wanted "$s" || continue
  if [ $HAS_GPU -eq 0 ]; then  # the CPU-only build check is .ci/cuda_extension_build.sh
    record "$s" skipped 0 "no CUDA device visible"
    continue
  fi
  if [ -n "$MISSING" ]; then
    record "$s" skipped 0 "$PY cannot import $MISSING"
    continue
  fi
  if [ $BUILD_FAILED -eq 1 ]; then  # nothing after a failed build can run: listed as such
    record "$s" skipped 0 "the build failed"
    continue
  fi
  case $s in
    build)
      run_stage build "extension built with CUDA kernels" "${BUILD_CMD[@]}"
      [ "$STAGE_RC" -ne 0 ] && BUILD_FAILED=1 ;;
    tests) run_stage tests "" "${TEST_CMD[@]}" ;;
    memcheck|racecheck)
      if [ -z "$SANITIZER" ]; then
        record "$s" skipped 0 "compute-sanitizer not found"
      elif [ $SAN_UNSUPPORTED -eq 1 ]; then
        record "$s" unsupported 0 "compute-sanitizer cannot instrument this device (see memcheck)"
      else
        if [ $s = memcheck ]; then
          run_stage memcheck "no errors" "${MEMCHECK_CMD[@]}"
        else
          run_stage racecheck "no hazards" "${RACECHECK_CMD[@]}"
        fi
        # a sandboxed runtime (gVisor) refuses the device: say so, it is not a kernel failure
        if [ "$STAGE_RC" -ne 0 ] && grep -qiE "device not supported|not supported on this|unable to (connect|initialize)" "$RAW/$s.log"; then
          SAN_UNSUPPORTED=1
          sed -i '$ d' "$RAW/stages.txt"
          record "$s" unsupported "0" "compute-sanitizer refused the device (sandboxed runtime?)"
          # the failure was the tool's, not the kernels'
          grep -q "FAIL\|TIMEOUT" "$RAW/stages.txt" || FAILED=0
        fi
      fi ;;
    bench) run_stage bench "raw/bench_kernel.json" "${BENCH_CMD[@]}" ;;
    ring) run_stage ring "raw/ring_w*.json" "${RING_CMD[@]}" ;;
  esac
done

# ---------------------------------------------------------------- summary (printed last)
TOTAL=$(elapsed)
"$PY" benchmarks/gpu_check_summary.py "$OUT" --total "$TOTAL" --has-gpu "$HAS_GPU" --ring-args "$RING_ARGS" \
  || echo "gpu_check: the summary failed; the raw logs are in $RAW"
if [ "${KEEP_RAW:-0}" = 1 ]; then
  tar -czf "$OUT/raw.tar.gz" -C "$OUT" raw
else
  tar -czf "$OUT/raw.tar.gz" -C "$OUT" raw && rm -rf "$RAW"
fi

if [ $HAS_GPU -eq 0 ]; then
  echo "gpu_check: no CUDA device visible (torch.cuda.is_available() is False): the GPU stages did not run"
  exit 2
fi
exit $FAILED
