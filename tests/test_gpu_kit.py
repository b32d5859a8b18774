"""docs/scripts/gpu_kit.sh packs what a lent GPU machine needs for the GPU check in two calls
that each fit what one call may carry: a broken kit would only show on that machine, in device
minutes that no session can buy back."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

from engine.artifact import REQUIRED_FILES, find_gguf

ROOT = Path(__file__).resolve().parents[1]
KIT = ".kit-test"


def sha256(*paths: Path) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def test_kit_splits_the_gguf_in_two_calls_under_the_limit(default_model_dir):
    cache = str(default_model_dir.parent)
    env = {**os.environ, "GPU_KIT": KIT, "GPU_KIT_WHEELS": "0", "LLM_LAB_CACHE": cache}
    try:
        done = subprocess.run(
            ["bash", "docs/scripts/gpu_kit.sh"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        kit = ROOT / KIT
        gguf = find_gguf()
        assert sha256(kit / "a/gguf.part0", kit / "b/gguf.part1") == sha256(gguf)
        assert (kit / "b/gguf.sha256").read_text().split() == [sha256(gguf), gguf.name]
        meta = {p.name for p in (kit / "b/meta").iterdir()}
        small = {"tokenizer.json.gz", *REQUIRED_FILES} - {"model.safetensors", "tokenizer.json"}
        assert small <= meta
        sizes = re.findall(r"call carrying \S+: (\d+) MB of (\d+) MB", done.stdout)
        assert len(sizes) == 2 and all(int(mb) < int(limit) for mb, limit in sizes)
    finally:
        shutil.rmtree(ROOT / KIT, ignore_errors=True)


def test_the_wheels_the_kit_downloads_are_pinned_in_requirements():
    pins = (ROOT / "requirements.txt").read_text().splitlines()
    script = (ROOT / "docs/scripts/gpu_kit.sh").read_text()
    names = re.findall(r"grep '\^([a-z]+)==' requirements.txt", script)
    assert names == ["gguf", "llguidance", "platformdirs"]
    for name in names:
        assert any(line.startswith(f"{name}==") for line in pins), name
