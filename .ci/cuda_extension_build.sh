#!/usr/bin/env bash
# Full CUDA build check, no GPU needed: builds ringseq._C with the CUDA kernels against a CUDA
# build of torch in a fresh venv and a scratch copy of this checkout, then imports it (the
# operator registration loads without a GPU). Packages come from the machine's configured
# (local) pip indexes.
#
#   .ci/cuda_extension_build.sh            # MAX_JOBS defaults to nproc
# Env: CUDA_HOME (default /usr/local/cuda), TORCH_SPEC (default torch==2.14.1), MAX_JOBS,
#      PYTHON (default python3), KEEP=1 keeps the scratch directory.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.14.1}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ringseq-cuext.XXXXXX")
cleanup() { if [[ "${KEEP:-0}" != 1 ]]; then rm -rf "$WORK"; else echo "kept $WORK"; fi; }
trap cleanup EXIT

stage_start=$(date +%s)
stage() {  # prints the duration of the stage that just ended
  local now; now=$(date +%s)
  printf '== %-28s %4ss\n' "$1" "$((now - stage_start))"
  stage_start=$now
}
t_all=$(date +%s)

"$PY" -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q "$TORCH_SPEC" ninja setuptools einops
"$WORK/venv/bin/python" -c "import torch; assert torch.version.cuda, 'torch is not a CUDA build'; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
stage "venv + torch"

mkdir "$WORK/src"
(cd "$ROOT" && tar --exclude=./build --exclude=./.git --exclude='*.so' --exclude='./.venv*' -cf - .) |
  tar -xf - -C "$WORK/src"
cd "$WORK/src"
RINGSEQ_CUDA=1 "$WORK/venv/bin/python" setup.py build_ext --inplace > "$WORK/build.log" 2>&1 || {
  grep -E "error|Error" "$WORK/build.log" | head -40
  echo "cuda_extension_build: FAIL: the CUDA extension does not build (log above)"; exit 1; }
stage "build_ext (MAX_JOBS=$MAX_JOBS)"

"$WORK/venv/bin/python" - <<'PY'
import torch
import ringseq._C as C
assert C.WITH_CUDA, "ringseq._C was built without the CUDA kernels"
for op in ("fwd", "bwd", "bwd_accum"):
    assert hasattr(torch.ops.ringseq, op), op
print("import ringseq._C: ok (WITH_CUDA=True); ops:", torch.ops.ringseq.fwd.default._schema)
PY
stage "import"
echo "cuda_extension_build: PASS in $(( $(date +%s) - t_all ))s"
