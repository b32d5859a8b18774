"""06 · 블록 단위 KV 관리: the block grid and block tables of live requests (standard lab), and the
same workload under a contiguous max-length reservation vs the engine's paged blocks."""

import plotly.graph_objects as go
import streamlit as st

from engine.kv_cache import KVCacheManager
from engine.utils import cdiv
from ui import figures
from ui.experiments import RequestSpec, Workload, block_tables_frame, fragmentation, run_workload
from ui.experiments.common import expected_steps
from ui.lab import LabContext, Progress
from ui.lab import lab as engine_lab
from ui.lesson import render_chapter
from ui.predict import compare, predict
from ui.session import current_settings
from ui.widgets import evidence, show_code, show_frame

RESULT = "ch06_result"


def live_lab() -> None:
    st.subheader("① 블록 격자와 블록 테이블 (한 스텝씩)")
    st.caption(
        "예시 요청을 몇 개 넣고 **다음 스텝**을 눌러 보세요. 'KV 캐시' 탭의 격자에서 색은 주인 "
        "요청입니다."
    )
    engine_lab("ch06", default_max_tokens=40, chapter_view=_block_tables, show_code_panel=False)
    show_code(KVCacheManager.allocate_slots, "방금 실행된 코드 (블록 배정)")


def _block_tables(ctx: LabContext) -> None:
    records = ctx.records("ch06")
    if not records:
        return
    table = block_tables_frame(records[-1])
    st.markdown(f"**스텝 {records[-1].step}의 블록 테이블** (논리 블록 번호 → 물리 블록 번호)")
    if table.empty:
        st.caption("지금 블록을 가진 요청이 없습니다.")
        return
    pivot = table.pivot(index="request_id", columns="logical", values="physical")
    pivot.index.name = "요청"
    pivot.columns = [f"논리 {c}" for c in pivot.columns]
    show_frame(pivot, hide_index=False)


def _workload(n: int, max_out: int) -> Workload:
    prompts = [20, 44, 28, 60, 36, 24, 52, 32]
    outs = [max(4, int(max_out * f)) for f in (0.3, 1.0, 0.5, 0.7, 0.2, 0.9, 0.4, 0.6)]
    arrivals = [0, 0, 0, 0, 150, 300, 450, 600]
    return Workload([RequestSpec(prompts[i], outs[i], arrivals[i]) for i in range(n)])


def compare_lab() -> None:
    st.subheader("② 연속 최대 길이 예약 vs 블록 방식 (같은 실행에서)")
    c1, c2, c3, c4 = st.columns(4)
    n = c1.slider("요청 수", 2, 8, 6, key="ch06_n")
    max_out = c2.slider("출력 길이 상한 (max_tokens)", 8, 64, 32, step=8, key="ch06_maxout")
    max_len = c3.select_slider(
        "최대 길이 (max_model_len)", [128, 256, 512], value=256, key="ch06_maxlen"
    )
    mode = c4.radio("연속 예약 크기 R", ["max_model_len", "prompt+max_tokens"], key="ch06_mode")
    bs = current_settings().block_size
    blocks = max(48, cdiv(max_len, bs))
    predict(
        "ch06_util",
        "블록 방식의 사용률(사용량/예약량)은 몇 %일까요? (연속 예약과 비교해 보세요)",
        unit="%",
        step=5.0,
    )
    if st.button("실행", key="ch06_run", type="primary"):
        cfg = current_settings().to_config(
            max_model_len=max_len, num_kv_blocks=blocks, enable_prefix_caching=False
        )
        workload = _workload(n, max_out)
        progress = Progress(expected_steps(workload, cfg))
        res = run_workload(cfg, workload, "paged", on_step=progress)
        progress.close()
        st.session_state[RESULT] = res
    res = st.session_state.get(RESULT)
    if res is None:
        st.info(
            "**실행**을 누르면 워크로드를 실제 엔진(블록 방식)으로 돌리고, 같은 실행의 요청 길이로 "
            "연속 예약이었다면 어땠을지를 계산해 나란히 보여 줍니다."
        )
        return
    fr = fragmentation(res, mode)
    df = fr.per_step
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=df["step"], y=df["used_slots"], name="사용량 (실제 토큰, 측정)", line_color="#2ca02c"
        )
    )
    fig.add_trace(
        go.Scatter(
            x=df["step"],
            y=df["paged_reserved"],
            name="블록 방식 예약량 (측정)",
            line_color="#1f77b4",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=df["step"],
            y=df["contiguous_reserved"],
            name=f"연속 예약량 (R={mode}, 계산)",
            line_color="#d62728",
            line_dash="dash",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=df["step"],
            y=df["contiguous_unusable"],
            name="연속: 쓸 수 없는 빈칸 (계산)",
            line_color="#ff7f0e",
            line_dash="dot",
        )
    )
    fig.add_hline(y=fr.pool_slots, line_dash="dash", annotation_text=f"KV 풀 {fr.pool_slots} 칸")
    fig.update_layout(
        height=340,
        title="스텝마다의 KV 칸 (토큰 자리)",
        xaxis_title="스텝",
        yaxis_title="칸",
        margin=dict(l=10, r=10, t=40, b=10),
    )
    st.plotly_chart(fig, key="ch06_compare_fig")
    st.dataframe(fr.summary, hide_index=True)
    evidence(
        "측정값",
        f"블록 방식: 예약 {fr.summary.iloc[1]['평균 예약량 (칸)']} 칸, 사용 "
        f"{fr.summary.iloc[1]['평균 사용량 (칸)']} 칸 (스텝 평균), 동시에 블록을 가진 요청 최대 "
        f"{fr.paged_max_concurrent}개",
        **dict(
            res.conditions, 블록=f"{res.num_blocks}×{res.block_size}", 최대길이=res.max_model_len
        ),
    )
    evidence(
        "계산값",
        "연속 예약: 요청마다 R칸을 도착부터 완료까지 묶어 둠 → 사용률 "
        f"{fr.summary.iloc[0]['사용률 = 사용량/예약량 (%)']}%, 같은 풀({fr.pool_slots}칸)에 "
        f"R={fr.largest_reservation}칸 요청은 최대 {fr.contiguous_capacity}개",
        formula="예약량 = Σ R, 내부 단편화 = 예약량 − 사용량, "
        "쓸 수 없는 칸 = R_max보다 작은 빈 구멍의 합 (first-fit 재현)",
    )
    compare("ch06_util", float(fr.summary.iloc[1]["사용률 = 사용량/예약량 (%)"] or 0), "%")
    if fr.contiguous_rejected:
        st.warning(
            "연속 예약이었다면 도착 시 자리가 없어 기다려야 했을 요청: "
            f"{', '.join(fr.contiguous_rejected)} (블록 방식에서는 바로 실행됨)"
        )
    mid = res.records[len(res.records) // 2]
    st.plotly_chart(figures.kv_grid_figure(mid.kv), key="ch06_grid_mid")
    st.caption(f"스텝 {mid.step}의 블록 격자 (이 실행의 가운데 스텝)")
    show_code(fragmentation, "방금 실행된 코드 (비교 계산)")


def lab() -> None:
    live_lab()
    st.divider()
    compare_lab()


render_chapter("06", lab)
