"""시뮬레이터는 얼마나 맞나: the same (scaled) production trace on the real engine and through the
cost model, step by step (engine/tools/fidelity.py), with a "이 실행으로 보정" button that shows
the error after fitting the cost model on this very run, and the load average with a warning
when the machine was busy. Drawn at the end of a chapter's lab by `fidelity_section()`."""

from __future__ import annotations

import tempfile
from pathlib import Path

import plotly.graph_objects as go
import streamlit as st

from engine.tools.fidelity import (
    BUSY_LOAD,
    SAMPLES,
    TARGET_SPAN_S,
    compare,
    replay_on_engine,
    scale_trace,
)
from engine.tools.trace_readers import Scaling, TraceError
from ui import figures
from ui.widgets import evidence

RESULT = "fidelity_result"  # session key: {"fidelity": Fidelity, "trace": label}
CALIBRATED = "fidelity_calibrated"  # session key: the 보정 button was pressed for this result
TRACES = {
    "Mooncake 샘플 (공유 prefix 있음)": SAMPLES["mooncake"],
    "Azure 샘플": SAMPLES["azure"],
    "파일 올리기": None,
}
ERROR_FORMULA = "오차 = (시뮬레이션 − 측정) ÷ 측정, 스텝마다; 중앙값·p90은 |오차|의 것"


def _picked_trace() -> tuple[str, Path | None]:
    """(label, path) of the trace to run; an uploaded file is written to a temporary file."""
    label = st.radio("트레이스", list(TRACES), key="fidelity_trace", horizontal=True)
    if TRACES[label] is not None:
        return label, TRACES[label]
    upload = st.file_uploader(
        "Mooncake JSONL 또는 Azure CSV", type=["jsonl", "json", "csv"], key="fidelity_upload"
    )
    if upload is None:
        return label, None
    suffix = Path(upload.name).suffix or ".txt"
    with tempfile.NamedTemporaryFile("wb", suffix=suffix, delete=False) as f:
        f.write(upload.getvalue())
    return upload.name, Path(f.name)


def _scaling_controls() -> Scaling:
    cols = st.columns(3)
    requests = cols[0].number_input("요청 수 (앞에서부터)", 2, 40, 10, key="fidelity_requests")
    prompt = cols[1].number_input("프롬프트 최대 토큰", 16, 512, 160, 16, key="fidelity_prompt")
    output = cols[2].number_input("출력 최대 토큰", 2, 64, 16, 2, key="fidelity_output")
    st.caption(
        f"실제 엔진(CPU, 135M)이 몇십 초 안에 끝내도록 줄여서 돌립니다: 앞의 {requests}개 요청, "
        f"프롬프트 ≤ {prompt}, 출력 ≤ {output} 토큰, 도착 시각은 {TARGET_SPAN_S:g}초 안에 "
        "들어오도록 압축(배율은 실행 후 표시). 자른 요청 수는 결과에 그대로 적습니다."
    )
    return Scaling(time_scale=0, max_requests=requests, max_input_len=prompt, max_output_len=output)


def _run(label: str, path: Path, scaling: Scaling) -> None:
    """The real engine (this session's model, device and dtype) on the scaled trace, then the
    cost model on the same steps; kept in the session for the plots and the 보정 button."""
    from engine.core import EngineCore
    from ui.session import current_settings

    settings = current_settings()
    config = settings.to_config(
        num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024
    )
    engine = EngineCore(config)
    try:
        trace = scale_trace(path, engine, scaling=scaling)
        with st.spinner("실제 엔진으로 트레이스를 재생하는 중…"):
            replay = replay_on_engine(engine, trace)
        st.session_state[RESULT] = {"fidelity": compare(replay, trace, engine), "trace": label}
        st.session_state[CALIBRATED] = False
    finally:
        engine.shutdown()


def fidelity_section() -> None:
    """The section: trace picker, scaling, 실행, the per-step plots, 보정, the load average."""
    with st.expander("시뮬레이터는 얼마나 맞나? 실제 트레이스를 두 실행기로", expanded=False):
        st.markdown(
            "같은 트레이스를 **실제 엔진**에서 돌려 스텝마다 시간을 재고, 그 스텝의 배치를 그대로 "
            "**비용 모델**(시뮬레이터가 쓰는 것)에 넣어 계산한 시간과 나란히 봅니다. "
            "진짜 트레이스 파일은 Mooncake(github.com/kvcache-ai/Mooncake)와 "
            "Azure(github.com/Azure/AzurePublicDataset)가 공개합니다."
        )
        label, path = _picked_trace()
        scaling = _scaling_controls()
        if st.button("실행", key="fidelity_run", disabled=path is None):
            try:
                _run(label, path, scaling)
            except TraceError as error:
                st.error(f"트레이스를 읽지 못했습니다: {error}")
            finally:
                if path not in SAMPLES.values():  # an upload's temporary copy
                    path.unlink(missing_ok=True)
        result = st.session_state.get(RESULT)
        if result is not None:
            _show(result["fidelity"], result["trace"])


def _show(f, label: str) -> None:
    c = f.conditions
    t = c["trace"]
    st.markdown(
        f"**{label}**: {t['requests']}/{t['requests_in_file']}개 요청, "
        f"도착 시각 ÷{t['time_scale']:.3g}"
        f" (파일에서 {t['span_in_file_s']:.1f}초 → {t['span_replayed_s']:.1f}초), 잘린 프롬프트 "
        f"{t['capped_input']}개, 잘린 출력 {t['capped_output']}개"
    )
    _load_note(c)
    measured = f.before["measured_s"]
    evidence(
        "측정값",
        f"실제 엔진: {len(measured)}개 스텝, 스텝 시간 합 {sum(measured):.2f}초, "
        f"가장 긴 스텝 {1000 * max(measured):.0f} ms",
        모델=Path(c["model"]).name,
        장치=f"{c['device']}, {c['dtype']}",
        시계="엔진 시계",
    )
    calibrated = st.session_state.get(CALIBRATED, False)
    _step_plot(f)
    _error_plot(f, calibrated)
    before = f.before["median_abs_error"]
    evidence(
        "계산값",
        f"보정 전 스텝 오차 중앙값 {100 * before:.1f} % "
        f"(p90 {100 * f.before['p90_abs_error']:.1f} %), "
        f"{len(f.before['error'])}개 스텝",
        formula=ERROR_FORMULA,
    )
    st.caption(f"보정 전 효율 값: {c['efficiency_before']}")
    if st.button("이 실행으로 보정", key="fidelity_calibrate"):
        st.session_state[CALIBRATED] = calibrated = True
        st.rerun()
    if calibrated:
        after = f.after["median_abs_error"]
        evidence(
            "계산값",
            f"이 실행으로 보정한 뒤 오차 중앙값 {100 * before:.1f} % → {100 * after:.1f} % "
            f"(p90 {100 * f.after['p90_abs_error']:.1f} %)",
            formula=ERROR_FORMULA + "; 효율은 이 실행의 측정 스텝에 최소제곱으로 맞춤",
        )
        st.caption(
            "같은 스텝에 맞추고 같은 스텝으로 잰 오차(표본 안)입니다: 비용 모델의 꼴이 이 기계를 "
            "얼마나 잘 그릴 수 있는지이지, 처음 보는 실행의 예측 오차가 아닙니다."
        )
    _schedule_note(f.schedule)


def _load_note(c: dict) -> None:
    evidence(
        "측정값",
        f"부하 평균(1분) 실행 전 {c['load_before']:.2f}, 실행 후 {c['load_after']:.2f}",
        장치=f"{c['device']}, {c['dtype']}, 스레드 {c['threads']}",
        시계="엔진 시계(스텝마다 잰 시간)",
    )
    if c["busy"]:
        st.warning(
            f"측정하는 동안 기계가 바빴습니다(부하 평균이 실행 전 {BUSY_LOAD} 초과, 또는 실행 후 "
            f"{BUSY_LOAD} + 스레드 수 초과). 스텝 시간에 다른 프로그램의 잡음이 섞여 있으니, 아래 "
            "오차를 시뮬레이터의 오차로 읽지 마세요. 조용할 때 다시 실행해 보세요."
        )


def _schedule_note(s: dict) -> None:
    if s["same_schedule"]:
        st.caption("시뮬레이터가 같은 도착 시각으로 직접 스케줄해도 배치가 스텝마다 같았습니다.")
        return
    st.caption(
        f"시뮬레이터가 같은 도착 시각으로 직접 스케줄하면 {s['first_different_step']}번째 스텝부터 "
        f"배치가 달라집니다(실제 {s['steps']['real']} 스텝, 시뮬레이션 {s['steps']['simulated']} "
        "스텝): 예측한 스텝 시간이 다르면 요청이 다른 스텝에 도착하기 때문입니다. 그래서 위 "
        "비교는 실제 실행의 배치를 그대로 비용 모델에 넣어 스텝끼리 짝지었습니다."
    )


def _step_plot(f) -> None:
    steps = list(range(len(f.before["measured_s"])))
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(x=steps, y=[1000 * s for s in f.before["measured_s"]], name="측정 (실제 엔진)")
    )
    fig.add_trace(
        go.Scatter(x=steps, y=[1000 * s for s in f.before["simulated_s"]], name="계산 (보정 전)")
    )
    if st.session_state.get(CALIBRATED):
        after = [1000 * s for s in f.after["simulated_s"]]
        fig.add_trace(go.Scatter(x=steps, y=after, name="계산 (이 실행으로 보정)"))
    fig.update_layout(
        height=320,
        title="스텝마다의 시간: 측정 vs 비용 모델",
        xaxis=dict(title="스텝 (재생 안에서의 순서)"),
        yaxis=dict(title="ms", rangemode="tozero"),
        legend=figures.LEGEND_BELOW,
        margin=dict(l=10, r=10, t=40, b=60),
    )
    st.plotly_chart(fig, key="fidelity_steps")


def _error_plot(f, calibrated: bool) -> None:
    steps = list(range(len(f.before["error"])))
    fig = go.Figure()
    fig.add_trace(go.Bar(x=steps, y=[100 * e for e in f.before["error"]], name="보정 전"))
    if calibrated:
        fig.add_trace(go.Bar(x=steps, y=[100 * e for e in f.after["error"]], name="보정 후"))
    fig.update_layout(
        height=300,
        title="스텝마다의 오차 (시뮬레이션 − 측정) ÷ 측정",
        xaxis=dict(title="스텝"),
        yaxis=dict(title="%"),
        barmode="group",
        legend=figures.LEGEND_BELOW,
        margin=dict(l=10, r=10, t=40, b=60),
    )
    st.plotly_chart(fig, key="fidelity_error")
