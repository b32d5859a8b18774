"""Engine settings, one EngineCore per browser session, and the step records the plots draw.

Weights are read-only, so they are loaded once per process (engine/worker/worker.py's load_model
shares them). Everything that changes — queues, KV cache, requests, records — lives in
st.session_state, so two learners never see each other's requests. A process-wide registry
(ui/registry.py) knows every session's engines: it caps how many there are, allocates their KV
tensors on first use and gives the memory back once the browser tab has gone. A token in the URL
(restore_session) lets a reload of the page find its state in that registry again, until the
same reaper releases it.
"""

from __future__ import annotations

import datetime as _dt
import re
import secrets
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import streamlit as st

from engine.core import EngineConfig, EngineCore
from engine.trace import StepRecord

SETTINGS_KEY = "_engine_settings"
_ENGINES = "_engines"  # key → {"signature": ..., "engine": EngineCore}
_RECORDS = "_records"  # key → list[StepRecord]
_TEXTS = "_texts"  # key → {request_id: text so far}

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
POLICIES = ("fcfs", "priority", "static")
QUANTIZATIONS = ("none", "int8", "int4", "gguf")  # weight-only (engine/worker/quantization.py)


@dataclass(frozen=True)
class EngineSettings:
    """What the sidebar sets. Defaults keep a lab step interactive on a CPU."""

    model: str = ""  # "" = the embedded default artifact (SmolLM2-135M-Instruct)
    device: str = "auto"
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    block_size: int = 16
    num_kv_blocks: int = 64
    max_model_len: int = 1024
    max_num_batched_tokens: int = 128
    max_num_seqs: int = 8
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    quantization: str = "none"  # "none", "int8", "int4" (group 32) or "gguf" (Q4_1 blocks)
    # Speculative decoding (chapter 13): "" = off, "ngram" = prompt lookup drafts.
    speculative_method: str = ""
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1

    def speculative_config(self) -> dict | None:
        """vLLM's `speculative_config` dict for these settings (None: speculation off)."""
        if not self.speculative_method:
            return None
        return {
            "method": self.speculative_method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "prompt_lookup_max": self.prompt_lookup_max,
            "prompt_lookup_min": self.prompt_lookup_min,
        }

    def to_config(self, **overrides) -> EngineConfig:
        config = EngineConfig(
            model=self.model or None,
            device=self.device,
            dtype=None if self.dtype == "auto" else self.dtype,
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            enable_prefix_caching=self.enable_prefix_caching,
            scheduling_policy=self.scheduling_policy,
            quantization=None if self.quantization == "none" else self.quantization,
        )
        config = replace(config, speculative_config=self.speculative_config())
        return replace(config, **overrides)  # an unknown setting raises TypeError


def current_settings() -> EngineSettings:
    """The settings of this session (defaults if the sidebar has not run, e.g. a page alone)."""
    return st.session_state.get(SETTINGS_KEY) or EngineSettings()


# The sidebar form's number fields: widget key → (EngineSettings field, label, lowest, highest).
# The inputs themselves take any number (a browser keeps an out-of-range number in the box with
# a red mark and sends nothing); validate_settings brings it into range and says so.
NUMBER_FIELDS = {
    "cfg_block_size": ("block_size", "블록 크기", 1, 256),
    "cfg_num_kv_blocks": ("num_kv_blocks", "KV 블록 수", 1, 100_000),
    "cfg_budget": ("max_num_batched_tokens", "토큰 예산/스텝", 1, 8192),
    "cfg_max_seqs": ("max_num_seqs", "최대 동시 요청", 1, 256),
    "cfg_max_len": ("max_model_len", "최대 길이", 16, 32768),
    "cfg_spec_k": ("num_speculative_tokens", "초안 k", 1, 16),
    "cfg_spec_max": ("prompt_lookup_max", "n-gram 최대", 1, 8),
    "cfg_spec_min": ("prompt_lookup_min", "n-gram 최소", 1, 8),
}
_OTHER_FIELDS = {  # widget key → EngineSettings field (text, choices, a checkbox)
    "cfg_model": "model",
    "cfg_device": "device",
    "cfg_dtype": "dtype",
    "cfg_prefix": "enable_prefix_caching",
    "cfg_policy": "scheduling_policy",
    "cfg_quantization": "quantization",
}
SPEC_METHODS = {"끔": "", "ngram (prompt lookup)": "ngram"}  # sidebar label → method
_FORM_SHOWS = "_settings_form_shows"  # the settings the form's fields were last set from


def form_values(settings: EngineSettings) -> dict:
    """The sidebar form's widget values that show `settings`."""
    values = {key: getattr(settings, f) for key, (f, *_) in NUMBER_FIELDS.items()}
    values.update({key: getattr(settings, f) for key, f in _OTHER_FIELDS.items()})
    method = next(k for k, v in SPEC_METHODS.items() if v == settings.speculative_method)
    values["cfg_spec_method"] = method
    return values


def settings_from_form(values) -> EngineSettings:
    """The settings the form's widget values ask for (numbers as typed: validate_settings
    brings them into range)."""
    fields = {f: int(values[key]) for key, (f, *_) in NUMBER_FIELDS.items()}
    fields.update({f: values[key] for key, f in _OTHER_FIELDS.items()})
    fields["model"] = str(fields["model"] or "").strip()
    fields["enable_prefix_caching"] = bool(fields["enable_prefix_caching"])
    fields["speculative_method"] = SPEC_METHODS[values["cfg_spec_method"]]
    return EngineSettings(**fields)


def _show_in_form(settings: EngineSettings) -> None:
    """Set the form's fields to `settings` (before the widgets are drawn), so the sidebar always
    shows the settings in use."""
    st.session_state.update(form_values(settings))
    st.session_state[_FORM_SHOWS] = settings


def _apply_form() -> None:
    """설정 적용 (the form's callback, run before the script): validate what the fields ask for,
    apply it or refuse it with a Korean note, and set the fields to what is in use."""
    asked = settings_from_form(st.session_state)
    new, note, ok = validate_settings(asked)
    st.session_state[_SETTINGS_NOTE] = (note, ok)
    if ok:
        st.session_state[SETTINGS_KEY] = new
    _show_in_form(current_settings())


def engine_settings_sidebar(show_status: bool = True) -> EngineSettings:
    """The sidebar's engine settings form (and the main engine's status). Returns the settings.

    The fields always show the settings in use: a value out of range is brought into range, one
    the KV cache cannot serve is lowered, a refused change is undone, each with a Korean note.
    app.py passes show_status=False: the lab draws the status into the sidebar (ui/lab.py)."""
    settings = current_settings()
    st.session_state.setdefault(SETTINGS_KEY, settings)
    if st.session_state.get(_FORM_SHOWS) != settings:
        _show_in_form(settings)
    with st.sidebar:
        st.subheader("엔진 설정")
        with st.form("engine_settings_form", border=False):
            _settings_fields()
            st.form_submit_button("설정 적용 (엔진 재시작)", key="cfg_apply", on_click=_apply_form)
        note = st.session_state.get(_SETTINGS_NOTE)
        if note and note[0]:
            (st.warning if note[1] else st.error)(note[0], icon=":material/info:")
        if show_status:
            engine_status()
    return current_settings()


def _number(column, key: str, label: str, help: str | None = None) -> None:
    """A number field; out of NUMBER_FIELDS' range it is brought into range on 설정 적용."""
    low, high = NUMBER_FIELDS[key][2:]
    help = f"{help} ({low:,}–{high:,})" if help else None
    column.number_input(label, step=1, key=key, help=help)


def _settings_fields() -> None:
    """The form's widgets; their values live in st.session_state (form_values)."""
    st.text_input("모델 경로 (비우면 기본 SmolLM2-135M-Instruct)", key="cfg_model")
    c1, c2 = st.columns(2)
    c1.selectbox("장치", DEVICES, key="cfg_device")
    c2.selectbox("dtype", DTYPES, key="cfg_dtype")
    c1, c2 = st.columns(2)
    _number(c1, "cfg_block_size", "블록 크기 (토큰)")
    _number(c2, "cfg_num_kv_blocks", "KV 블록 수")
    c1, c2 = st.columns(2)
    _number(c1, "cfg_budget", "토큰 예산/스텝")
    _number(c2, "cfg_max_seqs", "최대 동시 요청")
    _number(st, "cfg_max_len", "최대 길이 (max_model_len)")
    c1, c2 = st.columns(2)
    c1.checkbox("prefix caching", key="cfg_prefix")
    c2.selectbox("정책", POLICIES, key="cfg_policy")
    st.selectbox(
        "가중치 양자화",
        QUANTIZATIONS,
        key="cfg_quantization",
        help="int8: 출력 채널마다 scale 하나 · int4: 32개 묶음마다 scale과 min · "
        "gguf: 기본 모델 GGUF 파일의 Q4_1 블록 그대로 (11장)",
    )
    st.selectbox(
        "추측 디코딩 (speculative decoding)",
        list(SPEC_METHODS),
        key="cfg_spec_method",
        help="ngram: 요청 자신의 글에서 다음 토큰 후보(초안)를 찾아 한 forward로 검증합니다",
    )
    c1, c2, c3 = st.columns(3)
    _number(c1, "cfg_spec_k", "초안 k", "num_speculative_tokens: 한 스텝에 검증할 초안 토큰 수")
    _number(c2, "cfg_spec_max", "n-gram 최대", "prompt_lookup_max: 찾아볼 가장 긴 n-gram")
    _number(c3, "cfg_spec_min", "n-gram 최소", "prompt_lookup_min: 찾아볼 가장 짧은 n-gram")


_SETTINGS_NOTE = "_settings_note"  # (Korean note on the last 설정 적용, whether it was applied)
MIN_MAX_MODEL_LEN = 16


def clamp_settings(settings: EngineSettings) -> tuple[EngineSettings, list[str]]:
    """Every number field brought into its range (NUMBER_FIELDS), with a Korean note for each
    one that moved."""
    changes, notes = {}, []
    for field_name, label, low, high in NUMBER_FIELDS.values():
        value = int(getattr(settings, field_name))
        fixed = min(max(value, low), high)
        if fixed != value:
            changes[field_name] = fixed
            notes.append(
                f"{label} {value:,}은(는) 쓸 수 있는 범위({low:,}–{high:,}) 밖이라 "
                f"{fixed:,}(으)로 맞췄습니다."
            )
    return replace(settings, **changes), notes


def validate_settings(settings: EngineSettings) -> tuple[EngineSettings, str, bool]:
    """Check what the sidebar form asks for before an engine is built from it.

    Returns (settings to apply, a Korean note or "", whether to apply). Numbers out of range are
    brought into range; a KV cache that cannot hold one request of max_model_len gets
    max_model_len lowered to what its blocks hold; a cache too small for even a short request is
    refused with the fix named. Each change comes with its note."""
    settings, notes = clamp_settings(settings)
    settings, note, ok = _check_capacity(settings)
    return settings, " ".join(notes + ([note] if note else [])), ok


def _check_capacity(settings: EngineSettings) -> tuple[EngineSettings, str, bool]:
    """The n-gram range and the KV cache's capacity, on settings already in range."""
    if settings.speculative_method and settings.prompt_lookup_min > settings.prompt_lookup_max:
        return (
            settings,
            (
                f"n-gram 최소({settings.prompt_lookup_min})가 n-gram 최대"
                f"({settings.prompt_lookup_max})보다 큽니다. 최소를 최대 이하로 낮추세요. "
                "설정은 바꾸지 않았습니다."
            ),
            False,
        )
    slots = settings.num_kv_blocks * settings.block_size
    if slots < MIN_MAX_MODEL_LEN:
        need = -(-MIN_MAX_MODEL_LEN // settings.block_size)
        return (
            settings,
            (
                f"KV 블록 {settings.num_kv_blocks}개 × 블록 {settings.block_size}토큰 = "
                f"{slots}토큰으로는 짧은 요청 하나({MIN_MAX_MODEL_LEN}토큰)도 담을 수 없습니다. "
                f"KV 블록 수를 {need}개 이상으로 올리세요. 설정은 바꾸지 않았습니다."
            ),
            False,
        )
    if settings.max_model_len > slots:
        fixed = replace(settings, max_model_len=slots)
        return (
            fixed,
            (
                f"KV 블록 {settings.num_kv_blocks}개 × {settings.block_size}토큰 = {slots}토큰은 "
                f"최대 길이 {settings.max_model_len}토큰 요청 하나를 담지 못해서, "
                "최대 길이(max_model_len)를 "
                f"{slots}토큰으로 낮춰 적용했습니다. 더 긴 요청이 필요하면 KV 블록 수를 "
                f"{-(-settings.max_model_len // settings.block_size)}개 이상으로 올리세요."
            ),
            True,
        )
    return settings, "", True


def kernel_paths(engine) -> str | None:
    """Which code runs the attention (and the quantized linears) of this engine: our C++ kernels
    (with the instruction set they were built for) or the torch reference path."""
    from engine import kernels as kernel_lib

    model = getattr(getattr(getattr(engine, "executor", None), "worker", None), "model", None)
    if model is None:  # e.g. a multiprocess executor: the model lives in other processes
        return None

    def name(path: str) -> str:
        return f"C++ ({kernel_lib.cpu_isa()})" if path == "cpu" else "torch 참조 경로"

    text = f"어텐션 **{name(model.kernel_path)}**"
    if getattr(model, "quantization", None):
        text += f" · 양자화 선형층 **{name(model.linear_kernel_path)}**"
    elif getattr(model, "linear_precision", None):  # bfloat16 linears in a float32 engine
        library = model.linear_precision["library"]
        text += f" · 선형층 **bfloat16** ({library}; 가중치 bfloat16, 나머지 연산은 float32)"
    elif model.device.type == "cpu" and str(model.dtype) == "torch.float32":
        from engine.kernels.float32_linear import float32_linear_backend

        library = {"mkl": "MKL", "onednn": "oneDNN"}[float32_linear_backend()["backend"]]
        text += f" · float32 선형층 **{library}** (이 CPU에서 둘을 재어 고름)"
    return text


def engine_status(key: str = "main", others: list[tuple[str, str]] = ()) -> None:
    """Device, dtype, blocks used/total, running/waiting and the step of the session's engine
    under `key` (the sidebar), read as the lab's counters read it (the step = its records); for a
    comparison, `others` (label, key) get one line each."""
    from ui.registry import MB, get_registry, lazy_worker_of, planned_kv_bytes

    track_session()
    st.subheader("엔진 상태")
    registry = get_registry()
    engines, kv = registry.usage()
    classroom = (
        f"이 서버: 학습자 엔진 {engines}/{registry.limits.max_engines}개 · KV "
        f"{kv / MB:,.0f}/{registry.limits.max_kv_bytes / MB:,.0f} MB"
    )
    entry = st.session_state.get(_ENGINES, {}).get(key)
    if entry is None:
        st.caption("엔진이 아직 시작되지 않았습니다. 실험실에서 요청을 넣으면 시작됩니다.")
        st.caption(classroom)
        return
    engine: EngineCore = entry["engine"]
    snap = engine.kv_cache_manager.snapshot()
    worker = lazy_worker_of(engine)
    kv_state = f"KV 텐서 {planned_kv_bytes(engine) / MB:,.1f} MB " + (
        "할당됨" if worker is None or worker.kv_allocated else "(첫 스텝에서 할당)"
    )
    st.markdown(
        f"- 장치 **{engine.device}** · dtype **{str(engine.dtype).replace('torch.', '')}**"
        + (f" · 양자화 **{engine.config.quantization}**" if engine.config.quantization else "")
        + "\n"
        f"- 스텝 **{len(get_records(key))}** · KV 블록 **{snap.num_used}/{snap.num_blocks}** 사용 "
        f"(캐시 보관 {snap.num_cached_free})\n"
        f"- {kv_state}\n"
        f"- 실행 중 **{len(engine.scheduler.running)}** · "
        f"대기 **{len(engine.scheduler.waiting)}**"
        + (f"\n- 커널 {kernels}" if (kernels := kernel_paths(engine)) else "")
    )
    for label, other in others:
        _other_status(label, other)
    _gpu_status(engine)
    st.caption(classroom)


def _other_status(label: str, key: str) -> None:
    """One line for another engine of a comparison: its step and KV blocks."""
    entry = st.session_state.get(_ENGINES, {}).get(key)
    if entry is None:
        return
    snap = entry["engine"].kv_cache_manager.snapshot()
    st.markdown(
        f"- {label}: 스텝 **{len(get_records(key))}** · KV 블록 **{snap.num_used}/"
        f"{snap.num_blocks}**"
    )


def _gpu_status(engine: EngineCore) -> None:
    from engine.worker.worker import device_memory

    gpu = device_memory(engine.device)
    if gpu is None:
        return
    gib = 1 << 30
    st.markdown(
        f"- GPU **{gpu.name}**: 가중치 {engine.weight_bytes() / gib:.2f} GiB · "
        f"KV {engine.kv_cache_bytes() / gib:.2f} GiB · 여유 {gpu.free / gib:.1f}/"
        f"{gpu.total / gib:.1f} GiB"
    )
    st.caption("측정값: torch.cuda.mem_get_info, 이 프로세스의 모든 세션 합계")


def _signature(settings: EngineSettings, overrides: dict) -> tuple:
    return tuple(sorted(asdict(settings).items())) + tuple(
        sorted((k, repr(v)) for k, v in overrides.items())
    )


def build_engine(settings: EngineSettings | None = None, **overrides) -> EngineCore:
    """A fresh EngineCore for these settings. Weights are shared per process
    (engine/worker/worker.py's load_model); the KV tensors are allocated on the engine's first
    step (ui/registry.py)."""
    from engine.artifact import resolve_model_path
    from engine.executor.uniproc import UniProcExecutor
    from engine.worker.worker import is_model_loaded, resolve_device, resolve_dtype
    from ui.registry import LazyKVWorker

    simulation = overrides.pop("simulation", None)
    config = (settings or current_settings()).to_config(**overrides)
    if simulation is not None:  # the same EngineCore over a cost model (ui/simulation.py)
        from ui.simulation import build_simulated_engine

        return build_simulated_engine(simulation, config)
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        # chapter 12: EngineCore starts one worker process per rank (MultiprocExecutor); they
        # load their own shards and KV caches, and engine.shutdown() (the registry) stops them
        with st.spinner(
            f"워커 프로세스 {config.tensor_parallel_size * config.pipeline_parallel_size}개를 "
            "시작하는 중… (각자 자기 몫의 가중치를 불러옵니다)"
        ):
            return EngineCore(config)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    model_dir = resolve_model_path(config.model)

    def build() -> EngineCore:
        worker = LazyKVWorker(
            model_dir,
            device,
            dtype,
            config.block_size,
            quantization=config.quantization,
            quantization_group_size=config.quantization_group_size,
            kv_transfer_config=config.kv_transfer_config,  # the KV connector's worker side
        )
        return EngineCore(config, executor=UniProcExecutor(worker))

    if is_model_loaded(model_dir, device, dtype):
        return build()
    dtype_name = str(dtype).replace("torch.", "")
    with st.spinner(f"가중치를 불러오는 중… ({model_dir.name}, {device}, {dtype_name})"):
        return build()


def session_id() -> str:
    """This browser session's id ("bare" outside a Streamlit script run)."""
    from streamlit.runtime.scriptrunner import get_script_run_ctx

    ctx = get_script_run_ctx(suppress_warning=True)
    return ctx.session_id if ctx is not None else "bare"


# -- a learner's state across a page reload ------------------------------------------------------

TOKEN_PARAM = "lab"  # the URL's ?lab=<token>: which saved state this browser tab holds
_TOKEN = "_session_token"
_TOKEN_SHAPE = re.compile(r"[A-Za-z0-9_-]{16,64}")
# What a reload keeps: the engines, their records and texts, the settings (other modules add theirs
# with persist_key: the lab's workload feeders, the predictions). Kept by reference in the
# registry's entry for the token, so they are released with the engines (ui/registry.py).
PERSISTED_KEYS = {_ENGINES, _RECORDS, _TEXTS, SETTINGS_KEY}


def persist_key(name: str) -> None:
    """Keep st.session_state[name] across a reload of the page (see restore_session)."""
    PERSISTED_KEYS.add(name)


def restore_session() -> str:
    """A token for this browser session's state, in the URL (?lab=...) so that a reload finds it.

    A new Streamlit session (a reload) whose URL names a token still held by the registry takes
    that state over: its engines, records, texts, feeders, settings, predictions. Only when the
    token's last session is gone (a reload closes it) or unknown: a second live tab opened on the
    same link gets a token of its own, never a shared engine. An unknown or expired token (its
    engines were released after LLM_LAB_SESSION_TTL_S) gives a fresh state. Called by app.py on
    every full run (a page switch drops the query string; it is put back)."""
    from ui.registry import get_registry

    state = st.session_state
    token = state.get(_TOKEN)
    if token is None:
        asked = str(st.query_params.get(TOKEN_PARAM) or "")
        saved = None
        if _TOKEN_SHAPE.fullmatch(asked):
            saved = get_registry().claim(_key_of(asked), runtime_id=session_id())
        if saved is not None:
            state.update(saved)
            token = asked
        else:
            token = secrets.token_urlsafe(16)
        state[_TOKEN] = token
    if st.query_params.get(TOKEN_PARAM) != token:
        st.query_params[TOKEN_PARAM] = token
    return token


def session_token() -> str | None:
    """This browser session's reload token (restore_session), None before app.py set one."""
    return st.session_state.get(_TOKEN)


def _key_of(token: str) -> str:
    return f"lab:{token}"


def _registry_key() -> str:
    """The registry's name for this session: its token (restore_session), else its id plus its
    engine table, since AppTest gives every test app the same session id."""
    token = st.session_state.get(_TOKEN)
    if token is not None:
        return _key_of(token)
    return f"{session_id()}/{id(st.session_state.setdefault(_ENGINES, {})):x}"


def track_session() -> None:
    """Tell the process-wide registry this session is alive (every script or fragment run), and
    hand it what a reload keeps."""
    from ui.registry import get_registry

    state = st.session_state
    get_registry().touch(
        _registry_key(),
        state.setdefault(_ENGINES, {}),
        state.setdefault(_RECORDS, {}),
        state.setdefault(_TEXTS, {}),
        runtime_id=session_id(),
        saved={k: state[k] for k in PERSISTED_KEYS if k in state},
    )


def _classroom_full(exc) -> None:
    """The learner's message when a cap is reached: the figures, a retry button, no traceback."""
    st.error(exc.message_ko())
    st.button("다시 시도", key="_classroom_retry", icon=":material/refresh:")
    st.stop()


def get_engine(key: str = "main", **overrides) -> EngineCore:
    """This session's engine under `key`; rebuilt (records cleared) when settings or overrides
    change.

    A new engine is admitted by the process-wide registry (ui/registry.py): past the classroom's
    caps the learner sees "교실이 가득 찼습니다" with the figures and this run stops there."""
    from ui.registry import ClassroomFull, get_registry, planned_kv_bytes

    track_session()
    engines = st.session_state[_ENGINES]
    settings = current_settings()
    signature = _signature(settings, overrides)
    entry = engines.get(key)
    if entry is None or entry["signature"] != signature:
        registry = get_registry()
        sid = _registry_key()
        try:
            registry.check_room(sid, key, 0)  # the engine count, before spending a build on it
            engine = build_engine(settings, **overrides)  # no KV tensors yet: nothing to undo
            # a simulated engine's KV cache is a number, not memory: it counts for nothing
            simulated = "simulation" in overrides
            registry.admit(sid, key, engine, 0 if simulated else planned_kv_bytes(engine))
        except ClassroomFull as exc:
            _classroom_full(exc)
        engines[key] = {
            "signature": signature,
            "engine": engine,
            "overrides": dict(overrides),
            "created": time.perf_counter(),
        }
        st.session_state[_RECORDS][key] = []
        st.session_state[_TEXTS][key] = {}
    return engines[key]["engine"]


def adopt_engine(key: str, engine: EngineCore, parent: str) -> None:
    """Keep an engine made outside get_engine (a fork of `parent`'s engine, ui/fork.py) under
    `key`: admitted by the registry like a built one, with the parent's records and texts so
    far (its history is the parent's up to the fork). Raises ui.registry.ClassroomFull past the
    classroom's caps (the caller says so; nothing is kept)."""
    from ui.registry import get_registry, planned_kv_bytes
    from ui.simulation import is_simulated

    track_session()
    registry, sid = get_registry(), _registry_key()
    registry.check_room(sid, key, 0)
    registry.admit(sid, key, engine, 0 if is_simulated(engine) else planned_kv_bytes(engine))
    st.session_state[_ENGINES][key] = {
        "signature": ("fork", parent),
        "engine": engine,
        "overrides": {},
        "created": time.perf_counter(),
    }
    st.session_state[_RECORDS][key] = list(get_records(parent))
    st.session_state[_TEXTS][key] = dict(get_texts(parent))


def adopted_engine(key: str) -> EngineCore | None:
    """The engine adopt_engine keeps under `key`, if it is still there."""
    entry = st.session_state.get(_ENGINES, {}).get(key)
    return entry["engine"] if entry else None


def current_engine(key: str = "main") -> EngineCore:
    """The engine already built under `key` (whatever its overrides), else a default one."""
    track_session()
    entry = st.session_state[_ENGINES].get(key)
    if entry is not None:
        return entry["engine"]
    return get_engine(key)


def reset_engine(key: str = "main") -> None:
    """Throw away this session's engine under `key` (a new one is built on the next get_engine);
    its KV memory goes back at once."""
    from ui.registry import get_registry

    st.session_state.get(_ENGINES, {}).pop(key, None)
    st.session_state.get(_RECORDS, {}).pop(key, None)
    st.session_state.get(_TEXTS, {}).pop(key, None)
    get_registry().release(_registry_key(), key)


def get_records(key: str = "main") -> list[StepRecord]:
    return st.session_state.setdefault(_RECORDS, {}).setdefault(key, [])


def get_texts(key: str = "main") -> dict[str, str]:
    """Text streamed so far per request (from each step's RequestOutput)."""
    return st.session_state.setdefault(_TEXTS, {}).setdefault(key, {})


def record_step(key: str, record: StepRecord) -> None:
    get_records(key).append(record)
    texts = get_texts(key)
    for output in record.outputs:
        texts[output.request_id] = output.text


def run_step(key: str = "main") -> StepRecord | None:
    """One EngineCore.step() if work remains; its record is appended to get_records(key)."""
    engine = current_engine(key)
    if not engine.has_unfinished_requests():
        return None
    record = engine.step()
    record_step(key, record)
    return record


def run_to_end(key: str = "main", max_steps: int = 500) -> list[StepRecord]:
    """Step until every request is finished (or max_steps). Returns the new records."""
    new = []
    for _ in range(max_steps):
        record = run_step(key)
        if record is None:
            break
        new.append(record)
    return new


def engine_overrides(key: str = "main") -> dict:
    entry = st.session_state.get(_ENGINES, {}).get(key)
    return dict(entry["overrides"]) if entry else {}


def conditions_of(engine: EngineCore, **extra) -> dict:
    """Measurement conditions for a 측정값 label: device, dtype, model, date (+ batch etc.).
    For a simulated engine: the presets and efficiency factors of its 계산값 instead."""
    from ui.simulation import is_simulated, simulated_conditions

    if is_simulated(engine):
        return {**simulated_conditions(engine), **extra}
    cond = {
        "장치": str(engine.device),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "모델": Path(engine.model_dir).name,
    }
    cond.update(extra)
    cond["날짜"] = _dt.date.today().isoformat()
    return cond
