"""Chapter 06's lab parts (Streamlit): the block grid and block tables of live requests, and the
same workload under a contiguous max-length reservation vs paged blocks. The page composes them;
what they compute is in ui/experiments/ch06.py."""

import plotly.graph_objects as go
import streamlit as st

from engine.kv_cache import KVCacheManager
from engine.utils import cdiv
from ui import figures
from ui.experiments import block_tables_frame, fragmentation, run_workload
from ui.experiments.ch06 import (
    DEFAULT_MAX_LEN,
    DEFAULT_MAX_OUT,
    DEFAULT_NUM_REQUESTS,
    MIN_BLOCKS,
    live_workload,
    paged_workload,
    shared_blocks,
)
from ui.experiments.common import expected_steps
from ui.lab import LabContext, Progress
from ui.lab import lab as engine_lab
from ui.predict import compare, predict
from ui.session import current_settings, get_engine
from ui.widgets import evidence, show_code, show_frame

RESULT = "ch06_result"


def live_lab() -> None:
    st.subheader("① 블록 격자와 블록 테이블 (한 스텝씩)")
    st.caption(
        "**워크로드 넣기**로 요청 세 개를 넣고 **다음 스텝**을 눌러 보세요. 'KV 캐시' 탭의 "
        "격자에서 색은 주인 요청입니다. 두 번째 요청은 첫 요청과 프롬프트가 같아, prefix 캐시가 "
        "켜져 있으면 앞쪽 블록을 첫 요청과 함께 씁니다(블록 테이블의 '공유')."
    )
    engine_lab(
        "ch06",
        default_max_tokens=40,
        workload=live_workload(get_engine("ch06")),
        workload_note=(
            "워크로드: 예시 프롬프트 요청 세 개 (채팅 템플릿 포함, 출력 40·24·32 토큰, 종료 토큰 "
            "무시). 두 번째는 첫 요청과 같은 프롬프트로 조금 뒤에 도착합니다."
        ),
        chapter_view=_block_tables,
        show_code_panel=False,
    )
    show_code(KVCacheManager.allocate_slots, "방금 실행된 코드 (블록 배정)")


def _block_tables(ctx: LabContext) -> None:
    records = ctx.records("ch06")
    if not records:
        return
    record = records[-1]
    table = block_tables_frame(record)
    st.markdown(f"**스텝 {record.step}의 블록 테이블** (논리 블록 번호 → 물리 블록 번호)")
    if table.empty:
        st.caption("지금 블록을 가진 요청이 없습니다.")
        return
    shared = shared_blocks(record)
    names = figures.short_names(r.request_id for r in ctx.engines["ch06"].all_requests())
    table["physical"] = [f"{b} (공유)" if b in shared else str(b) for b in table["physical"]]
    pivot = table.pivot(index="request_id", columns="logical", values="physical")
    pivot.index = [names.get(rid, rid) for rid in pivot.index]
    pivot.index.name = "요청"
    pivot.columns = [f"논리 {c}" for c in pivot.columns]
    show_frame(pivot.fillna(""), hide_index=False)
    if shared:
        listed = ", ".join(
            f"{b}번 ({', '.join(names.get(r, r) for r in rids)})" for b, rids in shared.items()
        )
        st.caption(
            f"(공유) 물리 블록 {listed}은 여러 요청의 블록 테이블에 함께 올라 있습니다. 프롬프트 "
            "앞부분이 같아 prefix 캐시가 꽉 찬 블록을 한 번만 저장하고 나눠 쓰는 것입니다(10장). "
            "이 블록은 그 요청들이 모두 끝나야 풀로 돌아갑니다."
        )


def compare_lab() -> None:
    st.subheader("② 연속 최대 길이 예약 vs 블록 방식 (같은 실행에서)")
    c1, c2, c3, c4 = st.columns(4)
    n = c1.slider("요청 수", 2, 8, DEFAULT_NUM_REQUESTS, key="ch06_n")
    max_out = c2.slider(
        "출력 길이 상한 (max_tokens)", 8, 64, DEFAULT_MAX_OUT, step=8, key="ch06_maxout"
    )
    max_len = c3.select_slider(
        "최대 길이 (max_model_len)", [128, 256, 512], value=DEFAULT_MAX_LEN, key="ch06_maxlen"
    )
    mode = c4.radio("연속 예약 크기 R", ["max_model_len", "prompt+max_tokens"], key="ch06_mode")
    bs = current_settings().block_size
    blocks = max(MIN_BLOCKS, cdiv(max_len, bs))
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
        workload = paged_workload(n, max_out)
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
    _show_comparison(res, fragmentation(res, mode), mode)


def _compare_figure(fr, mode: str) -> go.Figure:
    """Slots per step: used, paged reserved (measured) and the contiguous replay (계산값)."""
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
        title=dict(text="스텝마다의 KV 칸 (토큰 자리)", y=0.98, yanchor="top"),
        xaxis_title="스텝",
        yaxis=dict(title="칸", rangemode="tozero"),
        legend=dict(orientation="h", x=0, xanchor="left", y=1.02, yanchor="bottom"),
        margin=dict(l=10, r=10, t=90, b=10),
    )
    return fig


def _show_comparison(res, fr, mode: str) -> None:
    """The comparison's figure, table, evidence, prediction and the run's middle grid."""
    st.plotly_chart(_compare_figure(fr, mode), key="ch06_compare_fig")
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
