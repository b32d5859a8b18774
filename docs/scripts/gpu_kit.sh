#!/usr/bin/env bash
# Packs what the GPU check (docs/scripts/gpu_check.sh) needs on a lent device machine that has
# PyTorch with CUDA but reaches nothing outside: the embedded GGUF (98 MB, more than one call may
# carry: 64 MiB with the working tree) split in two, the Python 3.12 wheels that machine lacks,
# and the artifact's small files for a random-weights fallback. Run it here, in the repository
# root, after ./run.sh setup; then make the two calls it prints (docs/performance.md, "GPU").
set -euo pipefail
cd "$(dirname "$0")/../.."

KIT=${GPU_KIT:-.kit}
LIMIT=$((64 * 1024 * 1024))  # what one call may carry, working tree included
FIRST_PART=54000000          # bytes of the GGUF in the first call
PY=.venv/bin/python

gguf=$(PYTHONPATH=. "$PY" -c "from engine.artifact import find_gguf; print(find_gguf())")
model=$(PYTHONPATH=. "$PY" -c "from engine.artifact import default_artifact_path as p; print(p())")
rm -rf "$KIT" && mkdir -p "$KIT/a" "$KIT/b/whl" "$KIT/b/meta"

head -c "$FIRST_PART" "$gguf" > "$KIT/a/gguf.part0"
tail -c +"$((FIRST_PART + 1))" "$gguf" > "$KIT/b/gguf.part1"
(cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") > "$KIT/b/gguf.sha256"

# The device image has torch, transformers, safetensors, tokenizers, numpy, pyyaml, requests
# and tqdm (/work/.library/device/KINDS.md); the engine also imports these three.
[ "${GPU_KIT_WHEELS:-1}" = 0 ] || python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$KIT/b/whl" \
  "$(grep '^gguf==' requirements.txt)" "$(grep '^llguidance==' requirements.txt)" \
  "$(grep '^platformdirs==' requirements.txt)"

for name in config.json tokenizer_config.json generation_config.json chat_template.jinja; do
  cp "$model/$name" "$KIT/b/meta/"
done
gzip -9 -c "$model/tokenizer.json" > "$KIT/b/meta/tokenizer.json.gz"

# A carried path must be ignored by git; a fresh clone ignores .kit*/ through .gitignore.
git check-ignore -q "$KIT/a/gguf.part0" || { echo "gpu_kit: $KIT is not ignored by git" >&2; exit 1; }
tree_bytes=$( (git ls-files -z; git ls-files -z --others --exclude-standard) |
  xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s}')
for part in a b; do
  bytes=$((tree_bytes + $(du -sb "$KIT/$part" | cut -f1)))
  echo "call carrying $KIT/$part: $((bytes / 1000000)) MB of $((LIMIT / 1000000)) MB"
  [ "$bytes" -lt "$LIMIT" ] || { echo "gpu_kit: over the limit" >&2; exit 1; }
done
cat <<EOF
kit ready. The two device calls, the second at once after the first (a machine stays warm 30 s):
  run(command="mkdir -p /tmp/kit && cp $KIT/a/gguf.part0 /tmp/kit/ && nvidia-smi -L",
      carry=["$KIT/a"], timeout_s=120)
  run(command="bash docs/scripts/gpu_check.sh", carry=["$KIT/b"], timeout_s=570)
EOF
