"""12 · executor and workers: the same requests on tp 1 and tp N (and optionally pp 2) side by side,
each tp/pp engine running one worker process per rank (engine/executor/multiproc.py). The chapter
view shows what each worker holds (the weight matrices cut by columns and rows, with the workers'
own shard shapes), per-step compute vs all-reduce time measured in the workers, the all-reduce
count derived and measured, and the step times of the layouts on this machine's shared CPU.

실제 엔진 / 시뮬레이션 (ui/simulation.py): in simulation the same views draw a model preset (by
default Llama-3.1-70B) on N GPUs of a hardware preset, against N/2 GPUs as the base: the layout
and the per-rank compute vs all-reduce times are computed (engine/tools/simulator.py's
SimulatedExecutor, 계산값), plus a table of the communication share as tp grows.
The lab's parts are in ui/labs/ch12.py."""

import streamlit as st

from engine.executor.multiproc import MultiprocExecutor
from engine.layers.sharding import valid_tensor_parallel_sizes
from engine.tools.presets import load_model_preset
from engine.tools.simulator import SimulatedExecutor
from ui.experiments.ch12 import SPEED_CHOICES, lab_workload
from ui.fidelity import fidelity_section
from ui.lab import LabContext
from ui.lab import lab as engine_lab
from ui.labs.ch12 import (
    LIVE,
    PP_KEY,
    SIM_MODEL,
    SIM_TP,
    communication_view,
    holdings_view,
    lab_caption,
    lab_model_config,
    lab_signature,
    layout_controls,
    not_started,
    real_sides,
    run_buttons,
    scale_view,
    simulated_sides,
    summary_view,
)
from ui.lesson import render_chapter
from ui.predict import predict
from ui.session import reset_engine
from ui.simulation import simulation_caption, simulation_picker
from ui.widgets import show_code

CLAIM = (
    "tp 3(워커 3개)과 pp 2(워커 2개)는 tp 1과 토큰 하나까지 같은 greedy 출력을 냅니다. tp 3의 "
    "워커 하나는 층마다 행렬의 1/3만 가지고(임베딩·lm_head는 모두 똑같이 가짐), pp 2의 워커는 "
    "층의 절반씩을 가집니다: 워커마다의 바이트는 실험실 표가 보여 주는 그대로입니다."
)


def lab() -> None:
    st.subheader("같은 요청을 워커 1개와 워커 여러 개로")
    spec = simulation_picker("ch12", default_model=SIM_MODEL, default_tp=SIM_TP)
    real_config = lab_model_config()
    model_config = real_config if spec is None else load_model_preset(spec["model_preset"]).config
    if spec is None and not [s for s in valid_tensor_parallel_sizes(real_config) if s > 1]:
        st.warning("이 모델은 tensor parallel로 나눌 수 있는 크기가 없습니다.")
        return
    tp, num, out, with_pp = layout_controls(real_config, spec)
    if spec is None:
        sides = real_sides(tp, with_pp, model_config)
        question = f"tp {tp}(워커 {tp}개)로 돌리면, tp 1에 비해 decode 스텝 시간은?"
    else:
        tp = spec["tensor_parallel_size"]
        sides = simulated_sides(spec, with_pp)
        if isinstance(sides, str):
            st.warning(sides)
            return
        question = (
            f"GPU를 {tp // 2}장에서 {tp}장으로 늘리면(tp {tp // 2} → tp {tp}), decode 스텝 시간은?"
        )
    if len(sides) < 3:
        reset_engine(PP_KEY)  # its worker processes stop
    workload = lab_workload(num, out)
    lab_caption(spec, num, out, tp, sides)
    if spec is None and st.session_state.get(LIVE) != lab_signature(sides):
        not_started(sides, question, model_config, tp)
        return

    def before(ctx: LabContext) -> None:
        predict("ch12_speed", question, options=SPEED_CHOICES, locked=ctx.started)
        run_buttons(ctx, workload)

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


def lab_and_fidelity() -> None:
    """The lab, then the simulator's fidelity on a real trace (ui/fidelity.py), drawn even when
    the lab fails (its error is shown above by render_chapter)."""
    try:
        lab()
    except Exception:  # not st.stop / st.rerun (BaseException): those end the run here
        fidelity_section()
        raise
    fidelity_section()


render_chapter("12", lab_and_fidelity, claim=CLAIM)
