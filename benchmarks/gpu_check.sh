#!/usr/bin/env bash
# One command for a GPU machine: build the CUDA extension in place, run the GPU tests, time the
# kernels against torch SDPA (flash, cuDNN), run compute-sanitizer on one small shape, and print
# a compact table last. Everything lands under ${OUT:-gpu_check_out} (logs, JSON, junit XML).
#
#   bash benchmarks/gpu_check.sh                 # all stages, < 8 minutes on one H200
#   bash benchmarks/gpu_check.sh --dry-run       # plan + environment only; exit 2 without a GPU
#   bash benchmarks/gpu_check.sh --stages build,tests
#
# Needs: python with a CUDA build of torch, nvcc of the same CUDA major, pytest; no network.
# Optional: ninja (else torch builds serially: slower), compute-sanitizer, flash_attn.
# Environment: OUT (output folder), PYTHON (interpreter, default python then python3),
# MAX_JOBS (default 16), GPU_CHECK_BUDGET_S (overall deadline, default 465 s),
# GPU_CHECK_BUILD_S (build stage limit, default 270 s). Each stage runs
# under `timeout` with min(its own limit, time left before the deadline), so one hang cannot
# eat the budget; stages that no longer fit are reported as skipped.
# Exit: 0 all run stages passed, 1 a stage failed or timed out, 2 no CUDA device (nothing run
# that needs one), 64 bad usage.
set -u -o pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$(pwd)
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
BUDGET=${GPU_CHECK_BUDGET_S:-465}
export MAX_JOBS=${MAX_JOBS:-16}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif command -v python >/dev/null 2>&1; then PY=python
else PY=python3; fi

ALL_STAGES="env build tests tests_other bench memcheck racecheck"
GPU_STAGES=" tests tests_other bench memcheck racecheck "
DRY=0
STAGES=""
usage() { sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
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
EXPLICIT=0
if [ -n "$STAGES" ]; then
  EXPLICIT=1
  for s in $STAGES; do
    case " $ALL_STAGES " in *" $s "*) ;; *) echo "gpu_check: unknown stage $s (have: $ALL_STAGES)" >&2; exit 64 ;; esac
  done
  case " $STAGES " in *" env "*) ;; *) STAGES="env $STAGES" ;; esac
else
  STAGES=$ALL_STAGES
fi

START=$(date +%s)
ROWS=()      # "stage|status|seconds|note"
FAILED=0
STAGE_RC=0

elapsed() { echo $(( $(date +%s) - START )); }
record() { ROWS+=("$1|$2|$3|$4"); }
wanted() { case " $STAGES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

# run_stage NAME MAX_SECONDS NOTE_ON_OK CMD...   (output -> $OUT/NAME.log)
run_stage() {
  local name=$1 max=$2 okmsg=$3; shift 3
  local left=$(( START + BUDGET - $(date +%s) ))
  STAGE_RC=1
  if [ "$left" -lt 15 ]; then
    record "$name" "skipped" "0" "overall budget of ${BUDGET}s used up"
    echo "== [$name] skipped: budget used up"
    return 0
  fi
  local limit=$max
  [ "$left" -lt "$limit" ] && limit=$left
  local log="$OUT/$name.log"
  echo "== [$name] start at +$(elapsed)s, timeout ${limit}s: $*"
  local t0 t1 rc
  t0=$(date +%s.%N)
  timeout -k 10 "$limit" "$@" >"$log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  local secs
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  local status note
  if [ $rc -eq 0 ]; then
    status=ok; note=$okmsg
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    status=TIMEOUT; note="killed after ${limit}s"; FAILED=1
  else
    status="FAIL($rc)"; note="see $log"; FAILED=1
  fi
  # pytest's closing line says more than ok/FAIL
  local summary
  summary=$(grep -E '[0-9]+ (passed|failed|skipped|error)' "$log" | tail -n 1 | sed 's/=//g; s/^ *//; s/ *$//')
  [ -n "$summary" ] && note="$summary"
  STAGE_RC=$rc
  record "$name" "$status" "$secs" "$note"
  echo "== [$name] $status in ${secs}s: $note"
  if [ "$status" != ok ]; then tail -n 40 "$log" | sed "s/^/   [$name] /"; else tail -n 4 "$log" | sed "s/^/   [$name] /"; fi
}

# ---------------------------------------------------------------- env (always)
ENV_JSON="$OUT/env.json"
"$PY" - "$ENV_JSON" >"$OUT/env.log" 2>&1 <<'EOF'
import json, os, shutil, subprocess, sys
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
except Exception as exc:  # report, never crash the check
    info["torch"] = f"not importable: {exc}"
    info["cuda_available"] = False
nvcc = shutil.which("nvcc") or (os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"))
try:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    rel = [l for l in out.splitlines() if "release" in l]
    info["nvcc"] = rel[0].split("release", 1)[1].strip() if rel else "no version line"
except Exception as exc:
    info["nvcc"] = f"not found ({exc.__class__.__name__})"
try:
    import ninja  # noqa: F401
    info["ninja"] = "python package"
except Exception:
    info["ninja"] = shutil.which("ninja") or "MISSING: torch builds the extension serially (slower)"
cs = shutil.which("compute-sanitizer")
for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
    if not cs and root and os.path.exists(os.path.join(root, "bin", "compute-sanitizer")):
        cs = os.path.join(root, "bin", "compute-sanitizer")
info["compute_sanitizer"] = cs
for mod in ("flash_attn", "triton", "einops", "pytest"):
    try:
        m = __import__(mod)
        info[mod] = getattr(m, "__version__", "present")
    except Exception:
        info[mod] = None
info["cpus"] = os.cpu_count()
json.dump(info, open(sys.argv[1], "w"), indent=1)
for k, v in info.items():
    print(f"{k:18} {v}")
EOF
ENV_RC=$?
echo "== [env] python=$PY out=$OUT budget=${BUDGET}s"
sed 's/^/   /' "$OUT/env.log"
jget() { "$PY" -c "import json,sys; v=json.load(open('$ENV_JSON')).get('$1'); print('' if v is None else v)" 2>/dev/null; }
HAS_GPU=0
[ $ENV_RC -eq 0 ] && [ "$(jget cuda_available)" = "True" ] && HAS_GPU=1
SANITIZER=$(jget compute_sanitizer)
BACKENDS="ringseq,sdpa_flash,sdpa_cudnn"
[ -n "$(jget flash_attn)" ] && BACKENDS="$BACKENDS,flash_attn"
record env "$([ $ENV_RC -eq 0 ] && echo ok || echo "FAIL($ENV_RC)")" "$(elapsed)" \
  "$(jget gpu) torch $(jget torch), nvcc $(jget nvcc)"

# torch's CUDA headers (ATen/cuda/CUDAContext.h) include cusparse.h/cublas.h. A minimal CUDA
# toolkit lacks them, while the pip wheels torch depends on ship them (nvidia/cu*/include):
# point the host compiler there instead of failing the build.
CUDA_INC_EXTRA=$("$PY" - <<'EOF2' 2>/dev/null
import glob, os, shutil, site, sys
home = os.environ.get("CUDA_HOME") or (os.path.dirname(os.path.dirname(shutil.which("nvcc"))) if shutil.which("nvcc") else "/usr/local/cuda")
if not os.path.exists(os.path.join(home, "include", "cusparse.h")):
    roots = site.getsitepackages() + [site.getusersitepackages()] + sys.path
    for root in roots:
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

# ---------------------------------------------------------------- plan
# Build in place for the visible GPU's architecture only (unless TORCH_CUDA_ARCH_LIST is set):
# half the compile time of sm_80 + sm_90, and the .so is importable through PYTHONPATH=$ROOT.
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ] && [ $HAS_GPU -eq 1 ]; then
  TORCH_CUDA_ARCH_LIST=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())" 2>/dev/null || echo "8.0;9.0")
  export TORCH_CUDA_ARCH_LIST
fi
command -v ninja >/dev/null 2>&1 || "$PY" -c "import ninja" 2>/dev/null || echo "== [env] WARNING: ninja not found: the build compiles serially"
BUILD_CMD=(bash -c "RINGSEQ_CUDA=1 '$PY' setup.py build_ext --inplace \
&& '$PY' -c 'import ringseq._C as c, sys; print(\"ringseq._C:\", c.__file__, \"WITH_CUDA =\", c.WITH_CUDA); sys.exit(0 if c.WITH_CUDA else 3)'")
TEST_CMD=("$PY" -m pytest -m cuda --maxfail=10 -rfE -q -p no:cacheprovider tests/test_kernel_cuda.py --junitxml="$OUT/tests.xml")
# exit 5 = no other cuda-marked tests: fine
OTHER_CMD=(bash -c "'$PY' -m pytest -m cuda -q -p no:cacheprovider tests --ignore=tests/test_kernel_cuda.py --junitxml='$OUT/tests_other.xml'; rc=\$?; [ \$rc -eq 5 ] && { echo 'no other cuda-marked tests'; exit 0; }; exit \$rc")
BENCH_CMD=("$PY" benchmarks/bench_kernel.py --device cuda --backends "$BACKENDS" --batch 2 --heads 16
           --seqlens 4096,8192 --headdims 64,128 --causal both --dtype bf16 --tile-configs 0,1
           --json "$OUT/bench_kernel.json")
SAN_FILTER=()
if [ -n "$SANITIZER" ]; then
  help=$("$SANITIZER" --help 2>&1)
  # only instrument our kernels: torch's own launches stay fast
  if grep -q -- "--kernel-name " <<<"$help"; then SAN_FILTER=(--kernel-name kns=flash_)
  elif grep -q -- "--kernel-regex" <<<"$help"; then SAN_FILTER=(--kernel-regex kns=flash_); fi
fi
MEMCHECK_CMD=("$SANITIZER" --tool memcheck --error-exitcode 7 --print-limit 20 "${SAN_FILTER[@]}" "$PY" benchmarks/sanitize_shape.py --quick)
RACECHECK_CMD=("$SANITIZER" --tool racecheck --error-exitcode 7 --print-limit 20 "${SAN_FILTER[@]}" "$PY" benchmarks/sanitize_shape.py --quick)

if [ $DRY -eq 1 ]; then
  echo "== plan (dry run; stages: $STAGES)"
  echo "   build      (<=${GPU_CHECK_BUILD_S:-270}s) MAX_JOBS=$MAX_JOBS ${BUILD_CMD[*]}"
  echo "   tests      (<=160s) ${TEST_CMD[*]}"
  echo "   tests_other (<=60s) ${OTHER_CMD[*]}"
  echo "   bench      (<=120s) ${BENCH_CMD[*]}"
  if [ -n "$SANITIZER" ]; then
    echo "   memcheck    (<=90s) ${MEMCHECK_CMD[*]}"
    echo "   racecheck   (<=90s) ${RACECHECK_CMD[*]}"
  else
    echo "   memcheck, racecheck: compute-sanitizer not found, will be skipped"
  fi
  for s in build tests tests_other bench memcheck racecheck; do
    wanted "$s" && record "$s" "planned" "0" "dry run"
  done
fi

# ---------------------------------------------------------------- stages
if [ $DRY -eq 0 ]; then
  for s in build tests tests_other bench memcheck racecheck; do
    wanted "$s" || continue
    if [ $HAS_GPU -eq 0 ] && { [ $EXPLICIT -eq 0 ] || [[ "$GPU_STAGES" == *" $s "* ]]; }; then
      record "$s" "skipped" "0" "no CUDA device visible"
      continue
    fi
    case $s in
      build)
        run_stage build "${GPU_CHECK_BUILD_S:-270}" "extension built with CUDA kernels" "${BUILD_CMD[@]}"
        if [ "$STAGE_RC" -ne 0 ]; then
          # nothing after this can use the kernels
          STAGES="env build"
        fi ;;
      tests) run_stage tests 160 "" "${TEST_CMD[@]}" ;;
      tests_other) run_stage tests_other 60 "" "${OTHER_CMD[@]}" ;;
      bench) run_stage bench 120 "$OUT/bench_kernel.json" "${BENCH_CMD[@]}" ;;
      memcheck|racecheck)
        if [ -z "$SANITIZER" ]; then
          record "$s" "skipped" "0" "compute-sanitizer not found"
        elif [ $s = memcheck ]; then
          run_stage memcheck 90 "no errors" "${MEMCHECK_CMD[@]}"
        else
          run_stage racecheck 90 "no hazards" "${RACECHECK_CMD[@]}"
        fi ;;
    esac
  done
fi

# ---------------------------------------------------------------- summary (printed last)
TOTAL=$(elapsed)
printf '%s\n' "${ROWS[@]}" >"$OUT/stages.txt"
"$PY" - "$OUT" "$TOTAL" "$HAS_GPU" <<'EOF'
import json, os, sys
out, total, has_gpu = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
stages = []
for line in open(os.path.join(out, "stages.txt")):
    if line.strip():
        name, status, secs, note = line.rstrip("\n").split("|", 3)
        stages.append({"stage": name, "status": status, "seconds": float(secs), "note": note})
env = {}
try:
    env = json.load(open(os.path.join(out, "env.json")))
except Exception:
    pass
bench = None
try:
    bench = json.load(open(os.path.join(out, "bench_kernel.json")))["results"]
except Exception:
    pass
json.dump({"total_seconds": total, "has_gpu": has_gpu, "env": env, "stages": stages,
           "bench": bench}, open(os.path.join(out, "summary.json"), "w"), indent=1)

lines = []
if bench:
    rows = [r for r in bench if not r.get("skipped") and r.get("ms")]
    keys = sorted({(r["seqlen"], r["headdim"], r["causal"], r["mode"]) for r in rows},
                  key=lambda k: (k[3] != "fwd", k[0], k[1], k[2]))
    names = ["ringseq", "ringseq:1", "sdpa_flash", "sdpa_cudnn", "flash_attn"]
    names = [n for n in names if any(r["backend"] == n for r in rows)]
    head = f"{'mode':8}{'s':>6}{'d':>5} {'mask':7}" + "".join(f"{n + ' TF/s':>17}" for n in names) \
        + f"{'r0/flash':>10}{'r1/flash':>10}"
    lines += ["", "bench_kernel (b=2 h=16 bf16; TF/s = TFLOP/s, rN/flash = sdpa_flash ms / ringseq cfg N ms)", head]
    for k in keys:
        got = {r["backend"]: r for r in rows if (r["seqlen"], r["headdim"], r["causal"], r["mode"]) == k}
        cells = "".join(f"{got[n]['tflops']:17.1f}" if n in got else f"{'-':>17}" for n in names)
        rat = ""
        for n in ("ringseq", "ringseq:1"):
            x = got.get(n, {}).get("x_sdpa_flash")
            rat += f"{x:10.2f}" if x else f"{'-':>10}"
        lines.append(f"{k[3]:8}{k[0]:6d}{k[1]:5d} {'causal' if k[2] else 'full':7}{cells}{rat}")
lines += ["", f"gpu_check: {env.get('gpu', 'no GPU')} | torch {env.get('torch')} | "
          f"nvcc {env.get('nvcc')} | total {total}s | out {out}",
          f"{'stage':12} {'status':10} {'seconds':>8}  note"]
for s in stages:
    lines.append(f"{s['stage']:12} {s['status']:10} {s['seconds']:8.1f}  {s['note']}")
print("\n".join(lines))
open(os.path.join(out, "summary.txt"), "w").write("\n".join(lines) + "\n")
EOF

if [ $HAS_GPU -eq 0 ]; then
  echo "gpu_check: no CUDA device visible (torch.cuda.is_available() is False): the GPU stages did not run"
  exit 2
fi
[ $DRY -eq 1 ] && exit 0
exit $FAILED
