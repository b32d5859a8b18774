"""실제 엔진 / 시뮬레이션: the switch a lab shows to run its engines at 8B/70B scale.

A simulated engine is the engine's own EngineCore (scheduler, KV-cache manager, journeys, step
records) over engine/tools/simulator.py's SimulatedExecutor: no weights, each step's time
computed by the cost model from a model preset's shapes and a hardware preset's vendor figures.
So a lab draws it with the same plots; only the evidence label changes (계산값, with the presets
and the efficiency factors named).

A lab passes `simulation_overrides(...)` into its Sides' overrides; ui.session.build_engine
builds a simulated engine when it sees the `simulation` key.
"""

from __future__ import annotations

import streamlit as st

from engine.tools.presets import hardware_preset_names, load_hardware_preset, load_model_preset
from ui.experiments.common import is_simulated, simulated_conditions  # noqa: F401 (re-exported)

MODE_REAL = "실제 엔진"
MODE_SIM = "시뮬레이션"
DEFAULT_MODEL_PRESET = "llama-3.1-8b"
DEFAULT_HARDWARE = "h100-sxm"


def model_preset_choices() -> list[str]:
    from engine.tools.presets import model_preset_names

    return model_preset_names()


def hardware_choices() -> list[str]:
    """Vendor GPU presets ("this machine" needs a calibration run; the CLI offers it)."""
    from engine.tools.presets import THIS_MACHINE

    return [h for h in hardware_preset_names() if h != THIS_MACHINE]


GPU_COUNTS = [1, 2, 4, 8]


def simulation_picker(
    key: str, default_model: str = DEFAULT_MODEL_PRESET, default_tp: int = 1
) -> dict | None:
    """The switch and, in simulation, the model and hardware pickers. Returns the simulation
    spec ({"model_preset", "hardware", "tensor_parallel_size"}) or None for the real engine."""
    mode = st.radio(
        "실행 대상",
        [MODE_REAL, MODE_SIM],
        horizontal=True,
        key=f"{key}_target",
        help="시뮬레이션: 같은 스케줄러·KV 관리자를 돌리되, 스텝 시간은 모델 모양과 GPU 사양에서 "
        "비용 모델이 계산합니다 (가중치를 읽지 않음).",
    )
    real = mode == MODE_REAL  # the pickers stay visible (greyed out) so the lab's layout holds
    models = model_preset_choices()
    gpus = hardware_choices()
    c1, c2, c3 = st.columns([2, 2, 1])
    model = c1.selectbox(
        "모델 프리셋",
        models,
        index=models.index(default_model) if default_model in models else 0,
        key=f"{key}_sim_model",
        format_func=lambda k: load_model_preset(k).name,
        disabled=real,
    )
    hardware = c2.selectbox(
        "하드웨어 프리셋",
        gpus,
        index=gpus.index(DEFAULT_HARDWARE) if DEFAULT_HARDWARE in gpus else 0,
        key=f"{key}_sim_hardware",
        format_func=lambda k: load_hardware_preset(k).name,
        disabled=real,
    )
    tp = c3.selectbox(
        "GPU 수 (텐서 병렬)",
        GPU_COUNTS,
        index=GPU_COUNTS.index(default_tp) if default_tp in GPU_COUNTS else 0,
        key=f"{key}_sim_tp",
        help="가중치와 KV 헤드를 GPU들이 나눠 갖고, 층마다 all-reduce 두 번이 더해집니다.",
        disabled=real,
    )
    if real:
        return None
    spec = {"model_preset": model, "hardware": hardware, "tensor_parallel_size": tp}
    st.caption(simulation_caption(spec))
    return spec


def simulation_overrides(spec: dict | None) -> dict:
    """What a Side's overrides get: nothing for the real engine."""
    return {} if spec is None else {"simulation": dict(spec)}


def simulation_caption(spec: dict) -> str:
    model = load_model_preset(spec["model_preset"])
    hw = load_hardware_preset(spec["hardware"])
    tp, pp = spec.get("tensor_parallel_size", 1), spec.get("pipeline_parallel_size", 1)
    gpus = f" × {tp * pp}장" if tp * pp > 1 else ""
    if pp > 1:
        gpus += f" (tp {tp} × pp {pp})"
    return (
        f"계산값: {model.name} 모양(config.json, {model.source}) × {hw.name}{gpus} 사양 "
        f"({hw.evidence}: {hw.source}). 스텝 시간은 engine/tools/cost_model.py가 계산하며, "
        "효율 계수는 가정값입니다 (GPU에서 보정하지 않음). "
        "스케줄링 결정은 실제 엔진과 같은 코드입니다."
    )


def build_simulated_engine(spec: dict, config):
    """A simulated EngineCore with the lab's engine settings (limits, block size, policies)."""
    from engine.tools.simulator import make_simulated_engine

    fields = dict(
        block_size=config.block_size,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        enable_prefix_caching=config.enable_prefix_caching,
        enable_chunked_prefill=config.enable_chunked_prefill,
        scheduling_policy=config.scheduling_policy,
        preemption_mode=config.preemption_mode,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        max_model_len=config.max_model_len or 8192,
    )
    if spec.get("num_kv_blocks"):
        fields["num_kv_blocks"] = spec["num_kv_blocks"]
    return make_simulated_engine(
        spec["model_preset"],
        spec["hardware"],
        tensor_parallel_size=spec.get("tensor_parallel_size", 1),
        pipeline_parallel_size=spec.get("pipeline_parallel_size", 1),
        **fields,
    )
