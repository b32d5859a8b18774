"""12 · executor and workers: the same requests on tp 1 and tp N (and optionally pp 2) side by side,
each tp/pp engine running one worker process per rank (engine/executor/multiproc.py). The chapter
view shows what each worker holds (the weight matrices cut by columns and rows, with the workers'
own shard shapes), per-step compute vs all-reduce time measured in the workers, the all-reduce
count derived and measured, and the step times of the layouts on this machine's shared CPU.

실제 엔진 / 시뮬레이션 (ui/simulation.py): in simulation the same views draw a model preset (by
default Llama-3.1-70B) on N GPUs of a hardware preset, against N/2 GPUs as the base: the layout
and the per-rank compute vs all-reduce times are computed (engine/tools/simulator.py's
SimulatedExecutor, 계산값), plus a table of the communication share as tp grows.
The lab's views are drawn in ui/labs/ch12.py."""

import time

import streamlit as st

from engine.artifact import resolve_model_path
from engine.executor.multiproc import MultiprocExecutor
from engine.layers.sharding import all_reduces_per_step, valid_tensor_parallel_sizes
from engine.models.config import LlamaConfig
from engine.tools.presets import load_model_preset
from engine.tools.simulator import SimulatedExecutor
from ui.errors import show_error
from ui.experiments.ch12 import (
    DEFAULT_OUT,
    DEFAULT_REQUESTS,
    DEFAULT_TP,
    PROMPT_LEN,
    SPEED_CHOICES,
    lab_workload,
    simulated_fit_error,
    simulated_sizes,
)
from ui.experiments.common import Workload
from ui.lab import LabContext, Side, attach_workload, run_steps, set_playing
from ui.lab import lab as engine_lab
from ui.labs.ch12 import (
    BASE_KEY,
    PP_KEY,
    TP_KEY,
    communication_view,
    holdings_view,
    planned_view,
    scale_view,
    summary_view,
)
from ui.lesson import render_chapter
from ui.predict import predict
from ui.session import current_settings, get_engine, reset_engine
from ui.simulation import simulation_caption, simulation_overrides, simulation_picker
from ui.widgets import evidence, show_code

SIM_MODEL, SIM_TP = "llama-3.1-70b", 8  # the simulated default: 70B on 8 GPUs vs 4
LIVE = "_ch12_live"  # the signature of the real engines the learner started (None: not yet)
PENDING = "_ch12_pending"  # "run" or "load": what to do once those engines are up
CLAIM = (
    "tp 3(워커 3개)과 pp 2(워커 2개)는 tp 1과 토큰 하나까지 같은 greedy 출력을 냅니다. tp 3의 "
    "워커 하나는 층마다 행렬의 1/3만 가지고(임베딩·lm_head는 모두 똑같이 가짐), pp 2의 워커는 "
    "층의 절반씩을 가집니다: 워커마다의 바이트는 실험실 표가 보여 주는 그대로입니다."
)


def _model_config() -> LlamaConfig:
    return LlamaConfig.from_model_dir(resolve_model_path(current_settings().model or None))


def _label(tp: int, pp: int) -> str:
    return f"tp {tp} × pp {pp}"


def _simulated_sides(spec: dict, with_pp: bool) -> list[Side] | str:
    """The simulated lab's sides (N/2 GPUs as the base, N GPUs as tp, optionally N/2 × pp 2), or
    the reason they cannot run."""
    sizes = simulated_sizes(spec["tensor_parallel_size"])
    if not sizes:
        return "GPU 수를 2장 이상 고르세요: GPU 수의 절반(기준)과 나란히 비교합니다."
    if not with_pp:
        sizes = sizes[:2]
    cfg = current_settings().to_config()
    for tp, pp in sizes:
        error = simulated_fit_error(
            spec["model_preset"],
            spec["hardware"],
            tp,
            pp,
            cfg.max_model_len or 8192,
            cfg.block_size,
            cfg.max_num_batched_tokens,
            cfg.max_num_seqs,
        )
        if error:
            return f"tp {tp} × pp {pp}: {error}"
    keys = [BASE_KEY, TP_KEY, PP_KEY]
    return [
        Side(
            key,
            _label(tp, pp),
            simulation_overrides(
                {**spec, "tensor_parallel_size": tp, "pipeline_parallel_size": pp}
            ),
        )
        for key, (tp, pp) in zip(keys, sizes)
    ]


def _real_sides(tp: int, with_pp: bool, model_config: LlamaConfig) -> list[Side]:
    """tp 1 and tp N (and pp 2) on the CPU, each multi-worker engine one process per rank.
    Prefix caching off: a rerun on the same engines computes every prompt token again."""
    common = {"device": "cpu", "enable_prefix_caching": False}
    sides = [
        Side(BASE_KEY, _label(1, 1), dict(common)),
        Side(TP_KEY, _label(tp, 1), {**common, "tensor_parallel_size": tp}),
    ]
    if with_pp and model_config.num_layers >= 2:
        sides.append(Side(PP_KEY, _label(1, 2), {**common, "pipeline_parallel_size": 2}))
    return sides


def _workers(sides: list[Side]) -> int:
    """Worker processes the sides start (tp × pp of each multi-worker engine)."""
    sizes = [
        s.overrides.get("tensor_parallel_size", 1) * s.overrides.get("pipeline_parallel_size", 1)
        for s in sides
    ]
    return sum(n for n in sizes if n > 1)


def _signature(sides: list[Side]) -> tuple:
    return (current_settings(), tuple((s.key, tuple(sorted(s.overrides.items()))) for s in sides))


def _start_engines(sides: list[Side]) -> bool:
    """Build every side's engine now, saying which one is starting and how long each took (the
    worker processes import torch and load their shards: seconds each on a CPU)."""
    n = _workers(sides)
    with st.status(f"엔진을 만드는 중… (워커 프로세스 {n}개)", expanded=True) as status:
        for side in sides:
            start = time.perf_counter()
            st.write(f"{side.label}: 시작하는 중…")
            try:
                get_engine(side.key, **side.overrides)
            except Exception as exc:  # noqa: BLE001 - a Korean message, the page stays usable
                status.update(label="엔진을 만들지 못했습니다", state="error")
                show_error(exc, f"엔진을 만들 수 없습니다 ({side.label})")
                return False
            st.write(f"{side.label}: 준비됨 ({time.perf_counter() - start:.1f} s)")
        status.update(label=f"엔진 준비됨 (워커 프로세스 {n}개)", state="complete", expanded=False)
    return True


def _not_started(sides: list[Side], question: str, model_config: LlamaConfig, tp: int) -> None:
    """The real lab before its engines exist: the planned layout, the prediction, and the two
    buttons that start the worker processes (nothing heavy runs when the page opens)."""
    stale = st.session_state.pop(LIVE, None)
    if stale is not None:  # the learner changed the layout: stop the workers it no longer uses
        now = dict(_signature(sides)[1])
        for key, overrides in stale[1]:
            if key != BASE_KEY and now.get(key) != overrides:
                reset_engine(key)
    planned_view(model_config, tp)
    evidence(
        "계산값",
        f"tp {tp}: 스텝마다 워커 하나가 all-reduce {all_reduces_per_step(model_config, tp, 1)}번 "
        f"(층 {model_config.num_layers}개 × 2: o 뒤 한 번, down 뒤 한 번)",
        formula="2 × 층 수 (tp > 1일 때; tp 1이면 0)",
    )
    predict("ch12_speed", question, options=SPEED_CHOICES)
    st.caption(
        f"아래 버튼을 누르면 엔진 {len(sides)}개와 워커 프로세스 {_workers(sides)}개가 뜹니다. "
        "워커마다 torch를 불러오고 자기 몫의 가중치를 읽으므로 이 기계에서 십수 초 걸립니다 "
        "(진행 상황이 여기 보입니다)."
    )
    c1, c2 = st.columns(2)
    run = c1.button(
        "실행", key="ch12_start_run", type="primary", width="stretch",
        help="엔진과 워커를 띄우고, 워크로드를 넣어 끝까지 실행합니다",
    )  # fmt: skip
    load = c2.button(
        "워크로드 넣기", key="ch12_start_load", width="stretch",
        help="엔진과 워커를 띄우고 워크로드만 넣습니다 (그 뒤 다음 스텝으로 한 스텝씩)",
    )  # fmt: skip
    if (run or load) and _start_engines(sides):
        st.session_state[LIVE] = _signature(sides)
        st.session_state[PENDING] = "run" if run else "load"
        st.rerun()


def load_workload(ctx: LabContext, workload: Workload) -> None:
    """Put the workload on every engine, each from step 0. An engine that has run nothing yet is
    used as it is (its workers are not started twice); a used one is rebuilt first, with a
    message while its workers start again."""
    used = [s for s in ctx.sides if ctx.records(s) or ctx.engines[s.key].all_requests()]
    n = _workers(used)
    message = f"엔진을 새로 만드는 중… (워커 프로세스 {n}개를 다시 띄웁니다, 십수 초)"
    with st.spinner(message if n else "엔진을 새로 만드는 중…"):
        for side in used:
            reset_engine(side.key)
            ctx.engines[side.key] = get_engine(side.key, **side.overrides)
    for side in ctx.sides:
        attach_workload(ctx, side.key, workload)


def _run_buttons(ctx: LabContext, workload: Workload) -> None:
    """실행 and 워크로드 넣기 of the real lab (and what the start buttons asked for)."""
    pending = st.session_state.pop(PENDING, None)
    c1, c2 = st.columns(2)
    run = c1.button(
        "실행", key="ch12_run", type="primary", width="stretch",
        help="워크로드를 넣고 끝까지 실행합니다 (한 스텝씩 보려면 워크로드 넣기 → 다음 스텝)",
    ) or pending == "run"  # fmt: skip
    load = c2.button(
        "워크로드 넣기", key="ch12_load", width="stretch",
        help="워크로드의 요청을 모든 엔진에 넣습니다 (다음 스텝으로 한 스텝씩)",
    ) or pending == "load"  # fmt: skip
    if run or load:
        set_playing("ch12", False)
        load_workload(ctx, workload)
        if run:
            run_steps(ctx, None)


def _layout_controls(real_config: LlamaConfig, spec: dict | None) -> tuple[int, int, int, bool]:
    """tp, requests, output tokens and the pp switch (tp: the sizes this model divides into)."""
    sizes = [s for s in valid_tensor_parallel_sizes(real_config) if s > 1] or [1]
    c1, c2, c3, c4 = st.columns(4)
    tp = c1.selectbox(
        "tp 크기 (tensor_parallel_size)",
        sizes,
        index=sizes.index(DEFAULT_TP) if DEFAULT_TP in sizes else 0,
        key="ch12_tp",
        help=f"이 모델(query 헤드 {real_config.num_heads}개, KV 헤드 "
        f"{real_config.num_kv_heads}개)을 나눌 수 있는 크기만 보입니다 (시뮬레이션에서는 위의 "
        "GPU 수를 씀)",
        disabled=spec is not None,
    )
    num = c2.slider("요청 수", 1, 4, DEFAULT_REQUESTS, key="ch12_requests")
    out = c3.slider("출력 토큰 수", 4, 32, DEFAULT_OUT, step=4, key="ch12_out")
    with_pp = c4.checkbox(
        "pp 2도 나란히", value=False, key="ch12_pp", help="층을 두 워커에 나눈 엔진을 하나 더"
    )
    return tp, num, out, with_pp


def _caption(spec: dict | None, num: int, out: int, tp: int, sides: list[Side]) -> None:
    if spec is None:
        st.caption(
            f"워크로드: 요청 {num}개(프롬프트 {PROMPT_LEN}토큰, 출력 {out}토큰)를 모든 엔진에 "
            "똑같이 넣습니다. 모든 엔진은 CPU에서 실행되고, tp·pp 엔진은 랭크마다 워커 프로세스 "
            "하나를 띄웁니다 (torch.distributed, gloo)."
        )
        return
    st.caption(
        f"워크로드: 요청 {num}개(프롬프트 {PROMPT_LEN}토큰, 출력 {out}토큰)를 모든 엔진에 "
        f"똑같이 넣습니다. 기준은 GPU {tp // 2}장(tp {tp // 2}), 비교는 GPU {tp}장(tp {tp})"
        + (f", 그리고 같은 {tp}장을 tp {tp // 2} × pp 2로" if len(sides) > 2 else "")
        + ". 스케줄러와 KV 관리자는 실제 코드이고, 스텝 시간과 워커별 시간은 계산값입니다."
    )


def lab() -> None:
    st.subheader("같은 요청을 워커 1개와 워커 여러 개로")
    spec = simulation_picker("ch12", default_model=SIM_MODEL, default_tp=SIM_TP)
    real_config = _model_config()
    model_config = real_config if spec is None else load_model_preset(spec["model_preset"]).config
    if spec is None and not [s for s in valid_tensor_parallel_sizes(real_config) if s > 1]:
        st.warning("이 모델은 tensor parallel로 나눌 수 있는 크기가 없습니다.")
        return
    tp, num, out, with_pp = _layout_controls(real_config, spec)
    if spec is None:
        sides = _real_sides(tp, with_pp, model_config)
        question = f"tp {tp}(워커 {tp}개)로 돌리면, tp 1에 비해 decode 스텝 시간은?"
    else:
        tp = spec["tensor_parallel_size"]
        sides = _simulated_sides(spec, with_pp)
        if isinstance(sides, str):
            st.warning(sides)
            return
        question = (
            f"GPU를 {tp // 2}장에서 {tp}장으로 늘리면(tp {tp // 2} → tp {tp}), decode 스텝 시간은?"
        )
    if len(sides) < 3:
        reset_engine(PP_KEY)  # its worker processes stop
    workload = lab_workload(num, out)
    _caption(spec, num, out, tp, sides)
    if spec is None and st.session_state.get(LIVE) != _signature(sides):
        _not_started(sides, question, model_config, tp)
        return

    def before(ctx: LabContext) -> None:
        predict("ch12_speed", question, options=SPEED_CHOICES, locked=ctx.started)
        _run_buttons(ctx, workload)

    def chapter_view(ctx: LabContext) -> None:
        holdings_view(ctx, model_config, tp)
        communication_view(ctx, model_config, tp)
        summary_view(ctx, tp)

    engine_lab(
        "ch12",
        sides,
        presets=None,
        before=before,
        chapter_view=chapter_view,
        show_code_panel=False,
    )
    if spec is not None:
        scale_view(spec)
        st.caption(simulation_caption(spec))
        show_code(
            SimulatedExecutor.worker_timings,
            "방금 실행된 코드 (시뮬레이션: 워커별 계산·통신 시간을 비용 모델로 계산)",
        )
        return
    show_code(MultiprocExecutor.execute_model, "방금 실행된 코드 (실행자가 워커들에게 스텝을 보냄)")


render_chapter("12", lab, claim=CLAIM)
