"""Chapter 14's lab parts (Streamlit): prefill fairness on the engine clock (a long prompt first in
line, the threshold off and on side by side), then the server lab: the learner's own
OpenAI-compatible server (engine/entrypoints/server/) started on 127.0.0.1 and kept across
reruns, simulated users sending it real HTTP requests, the load-latency curve, streamed vs whole
answers, and a stream the learner cuts. What it measures is computed in ui/experiments/ch14*.py;
this module only draws."""

import pandas as pd
import plotly.graph_objects as go
import streamlit as st
from plotly.subplots import make_subplots

from engine.config import DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD
from engine.scheduler import TokenBudget
from ui import figures
from ui.experiments.ch14 import (
    CHOICES,
    FAIR_BUDGET,
    FAIR_LONG,
    FAIR_SEQS,
    FAIR_SHORT,
    FAIR_THRESHOLD,
    LONG_NAME,
    FairnessComparison,
    direction,
    fairness_base,
    fairness_config,
    fairness_label,
    fairness_summary,
    fairness_workload,
)
from ui.experiments.ch14_client import request_body
from ui.experiments.ch14_load import (
    LOAD_MAX_TOKENS,
    LOAD_PROMPT_LEN,
    capacity_estimate,
    curve_table,
    latency_vs_load,
    run_load_test,
)
from ui.experiments.ch14_server import (
    SERVER_BLOCKS,
    SERVER_SEQS,
    samples_table,
    server_overrides,
    start_live_server,
)
from ui.experiments.ch14_stream import (
    STREAM_MIN_TOKENS,
    STREAM_REPEATS,
    STREAM_RULE,
    BackgroundStream,
    disconnect_and_watch,
    stream_e2e_verdict,
    stream_summary,
    stream_vs_nonstream,
)
from ui.experiments.common import measurement_conditions, prompt_ids
from ui.lab import LabContext, Side, run_results, run_workload_button
from ui.lab import lab as engine_lab
from ui.predict import compare, predict
from ui.session import current_settings, get_engine, reset_engine
from ui.widgets import evidence, show_code, show_frame

RESULT = "ch14_fair_result"
FIELDS = (
    "enable_chunked_prefill",
    "max_num_batched_tokens",
    "max_num_seqs",
    "enable_prefix_caching",
    "max_model_len",
    "num_kv_blocks",
    "long_prefill_token_threshold",
)


# -- part 1: prefill fairness on the lab component -------------------------------------------------


def _sides(thresholds: list[int], budget: int, seqs: int) -> list[Side]:
    base = fairness_base(current_settings().to_config())
    sides = []
    for th in thresholds:
        cfg = fairness_config(base, th, budget, seqs)
        key = "ch14_off" if th == 0 else "ch14_on"
        sides.append(Side(key, fairness_label(th), {f: getattr(cfg, f) for f in FIELDS}))
    return sides


def _wrap(results: dict) -> FairnessComparison:
    return FairnessComparison(results, fairness_summary(results))


def _fair_view(ctx: LabContext) -> None:
    result = run_results(ctx, RESULT, _wrap)
    if result is None:
        st.info("두 엔진이 워크로드를 끝내면 여기에 짧은 요청들의 TTFT 비교가 나옵니다.")
        return
    st.markdown("**전체 실행 요약** (엔진 시계)")
    s = result.summary
    show_frame(s, hide_index=True)
    fig = go.Figure()
    for label, res in result.runs.items():
        t = res.request_table()
        fig.add_trace(go.Bar(x=t["request_id"], y=t["ttft_ms"], name=label))
    fig.update_layout(
        height=320,
        barmode="group",
        title="요청별 TTFT (ms, 엔진 시계) — 긴 프롬프트 뒤의 짧은 요청들",
        yaxis_title="ms",
        margin=dict(l=10, r=10, t=40, b=10),
    )
    st.plotly_chart(fig, key="ch14_fair_ttft")
    if len(s) == 2:
        off, on = s["짧은 요청 TTFT 평균 (ms)"]
        measured = direction(on, off)
        if measured is not None:
            compare("ch14_fair", measured)
            st.caption(f"짧은 요청 TTFT 평균: 임계값 끔 {off:.1f} ms, 켬 {on:.1f} ms")
    for label, res in result.runs.items():
        evidence(
            "측정값",
            f"{label}: 스텝 {len(res.records)}개, 전체 {res.elapsed_s:.3f} s (엔진 시계)",
            **res.conditions,
        )
    evidence(
        "계산값",
        "짧은 요청 TTFT = 첫 토큰 시각 − 도착 시각; 짧은 요청이 처음 들어간 스텝 = 짧은 요청이 "
        "하나라도 스케줄된 첫 스텝",
        formula="RequestMetrics (엔진 시계), StepRecord.scheduled",
    )


def fairness_lab() -> None:
    st.subheader("① prefill 공정성: 긴 프롬프트 하나가 짧은 요청들 앞에 설 때")
    c1, c2, c3, c4 = st.columns(4)
    budget = c1.slider(
        "토큰 예산 (max_num_batched_tokens)", 32, 256, FAIR_BUDGET, step=16, key="ch14_budget"
    )
    threshold = c2.slider(
        "long_prefill_token_threshold (켠 쪽)", 8, 128, FAIR_THRESHOLD, step=8, key="ch14_threshold"
    )
    long_len = c3.slider("긴 프롬프트 길이 (토큰)", 100, 600, FAIR_LONG, step=20, key="ch14_long")
    num_short = c4.slider("짧은 요청 수", 1, 6, FAIR_SHORT, key="ch14_num_short")
    workload = fairness_workload(long_len, num_short=num_short)
    st.caption(
        f"워크로드: {long_len}토큰 프롬프트 하나(출력 4)가 먼저 줄을 서고, 같은 순간 짧은 요청 "
        f"{num_short}개(프롬프트 8, 출력 8)가 그 뒤에 섭니다. 두 엔진 모두 chunked prefill 켬, "
        f"토큰 예산 {budget}, 최대 동시 요청 4. 다른 것은 임계값 하나뿐입니다. 끈 쪽은 엔진 "
        f"기본값({DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD})이 아니라 0을 직접 정한 엔진입니다."
    )
    if threshold >= budget:
        st.warning(
            f"임계값({threshold})이 토큰 예산({budget}) 이상이면 긴 요청이 여전히 예산을 다 "
            "가져갈 수 있어, 두 엔진의 차이가 사라집니다."
        )

    def before(ctx: LabContext) -> None:
        predict(
            "ch14_fair",
            f"임계값을 {threshold}로 켜면, 끌 때에 비해 짧은 요청들의 TTFT 평균은?",
            options=CHOICES,
            locked=ctx.started,
        )
        run_workload_button(ctx, workload)

    engine_lab(
        "ch14",
        _sides([0, threshold], budget, FAIR_SEQS),
        presets=None,
        workload=workload,
        workload_note=workload.describe() + f" · 긴 요청 이름: {LONG_NAME}",
        before=before,
        chapter_view=_fair_view,
        show_code_panel=False,
    )
    show_code(TokenBudget.fit, "방금 실행된 코드 (요청 하나가 이번 스텝에 받을 토큰 수)")


# -- part 2: the live server -----------------------------------------------------------------------

SERVER = "_ch14_server"  # st.session_state: the LiveServer
SERVER_ENGINE = "ch14_server"  # ui.session engine key of the server's engine
STREAM = "_ch14_stream"  # st.session_state: the BackgroundStream
LOAD = "_ch14_load"
CURVE = "_ch14_curve"
STREAMCMP = "_ch14_streamcmp"
DISCONNECT = "_ch14_disconnect"
CURVE_DRAIN_S = 4.0
CURVE_RATES = [0.5, 1.0, 2.0, 4.0, 8.0, 16.0]


def _signature(overrides: dict) -> tuple:
    return (current_settings(), tuple(sorted(overrides.items())))


def _stop_stream() -> None:
    stream = st.session_state.pop(STREAM, None)
    if stream is not None:
        stream.disconnect()


def stop_server() -> None:
    """Stop the background stream, the server (uvicorn + engine loop) and free its engine."""
    _stop_stream()
    live = st.session_state.pop(SERVER, None)
    if live is not None:
        live.stop()
    reset_engine(SERVER_ENGINE)


def ensure_server(overrides: dict):
    """This session's live server, started once and reused across reruns (idempotent). Changed
    settings stop the old one first, then start a new one on a fresh engine."""
    signature = _signature(overrides)
    live = st.session_state.get(SERVER)
    if live is not None and live.alive and live.signature == signature:
        return live
    stop_server()
    with st.spinner("인프로세스 API 서버를 시작하는 중… (127.0.0.1, 빈 포트)"):
        engine = get_engine(SERVER_ENGINE, **overrides)
        live = start_live_server(engine, signature)
    st.session_state[SERVER] = live
    return live


def _prompts(live, prompt_len: int, n: int) -> list[list[int]]:
    return [prompt_ids(live.engine, prompt_len, i) for i in range(max(n, 1))]


def _conditions(live, **extra) -> dict:
    cfg = live.engine.config
    return measurement_conditions(
        live.engine,
        경로="HTTP 127.0.0.1 (같은 프로세스의 uvicorn)",
        최대동시요청=cfg.max_num_seqs,
        KV블록=live.engine.num_blocks,
        시계="벽시계 (클라이언트, 요청을 보낸 순간부터)",
        **extra,
    )


def _live_figure(samples, key: str, title: str, marker_s: float | None = None) -> None:
    table = samples_table(samples)
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(
        go.Scatter(x=table["시각 (s)"], y=table["실행 중"], name="실행 중 (running)"),
        secondary_y=False,
    )
    fig.add_trace(
        go.Scatter(x=table["시각 (s)"], y=table["대기"], name="대기 (waiting)"),
        secondary_y=False,
    )
    fig.add_trace(
        go.Scatter(
            x=table["시각 (s)"],
            y=table["KV 사용률 (%)"],
            name="KV 사용률 (%)",
            line=dict(dash="dot"),
        ),
        secondary_y=True,
    )
    if marker_s is not None:
        fig.add_vline(x=marker_s, line_dash="dash", annotation_text="연결 끊음")
    fig.update_layout(
        height=380,
        title=title,
        legend=figures.LEGEND_BELOW,
        margin=dict(l=10, r=10, t=40, b=90),
    )
    fig.update_xaxes(title_text="시각 (s)")
    fig.update_yaxes(title_text="요청 수", rangemode="tozero", secondary_y=False)
    fig.update_yaxes(
        title_text="KV %", range=[0, 105], tickvals=[0, 25, 50, 75, 100], secondary_y=True
    )
    st.plotly_chart(fig, key=key)


def _progress_bar(what: str):
    bar = st.progress(0.0, text=f"{what} 준비 중…")

    def tick(p: dict) -> None:
        done, total = p.get("done", 0), max(p.get("total", 0), 1)
        elapsed, cap = p.get("elapsed_s", 0.0), p.get("cap_s", 0.0)
        point = f" · 점 {p['point']}/{p['points']} ({p['rate']} 요청/s)" if "point" in p else ""
        frac = min(max(done / total, elapsed / cap if cap else 0.0), 1.0)
        bar.progress(
            frac,
            text=f"{what}{point}: 끝난 요청 {done}/{total} · {elapsed:.1f} s (상한 {cap:.0f} s)",
        )

    return bar, tick


def _load_view(live) -> None:
    res = st.session_state.get(LOAD)
    if res is None:
        st.info("**[부하 보내기]**를 누르면 가상 사용자들이 실제 HTTP로 요청을 보냅니다.")
        return
    p = res.percentiles()
    st.markdown(
        f"**부하 결과** — 도착률 {res.rate} 요청/s, 사용자 {p['요청']}명 도착, 완료 {p['완료']}, "
        f"상한에서 끊음 {p['끊음']}, 오류 {p['오류']} · 걸린 시간 {res.wall_s:.1f} s"
    )
    if p["완료"] == 0:
        st.warning(
            "상한 안에 끝난 요청이 하나도 없습니다. 이 기계에서는 도착률이나 출력 길이, 사용자 "
            "수를 줄이거나 측정 시간 상한을 늘려 보세요."
        )
    elif p["끊음"]:
        st.caption(
            f"{p['끊음']}개는 상한에서 연결을 끊었습니다(그중 첫 조각도 못 받은 요청 "
            f"{p['첫 조각 없음']}개). 끊긴 요청도 첫 조각을 받았다면 TTFT·ITL에 들어가고, E2E에는 "
            "끝난 요청만 들어갑니다."
        )
    _live_figure(
        res.samples, "ch14_live", "서버의 /metrics: 실행 중·대기 요청 수와 KV 사용률 (폴링)"
    )
    c1, c2 = st.columns(2)
    c1.markdown("**지연 백분위수** (클라이언트 측)")
    show_frame(res.percentile_table(), container=c1, hide_index=True)
    server = res.server_means_ms()
    c2.markdown("**서버가 스스로 잰 평균** (/metrics 히스토그램의 합 ÷ 개수, 이번 부하의 증가분)")
    means = [
        {"지표": k, "평균 (ms)": server[k], "관측 수": server[f"{k} 관측 수"]}
        for k in ("TTFT", "ITL", "E2E")
    ]
    show_frame(pd.DataFrame(means), container=c2)  # a missing mean shows as "—", Arrow-safe
    _arrivals_view(res)
    _load_evidence(live, res, p)


def _arrivals_view(res) -> None:
    """TTFT by arrival time, the per-request table and one client's SSE chunks."""
    table = res.request_table()
    fig = go.Figure(
        go.Scatter(
            x=table["도착 (s)"],
            y=table["TTFT (ms)"],
            mode="markers",
            text=table["사용자"],
            name="TTFT",
        )
    )
    fig.update_layout(
        height=300,
        title="도착 시각별 TTFT — 뒤에 온 요청일수록 줄을 서는지",
        xaxis_title="도착 (s)",
        yaxis_title="TTFT (ms)",
        margin=dict(l=10, r=10, t=40, b=10),
    )
    st.plotly_chart(fig, key="ch14_ttft_scatter")
    with st.expander(f"요청별 표 ({len(table)}개)"):
        show_frame(table, hide_index=True)
    one = max(res.clients, key=lambda c: len(c.chunk_times), default=None)
    if one is not None and one.chunk_times:
        st.markdown(f"**한 클라이언트(사용자 {one.index})의 SSE 조각이 도착한 시각**")
        times = [round(1000 * (t - one.sent_s), 1) for t in one.chunk_times]
        fig = go.Figure(
            go.Scatter(
                x=times,
                y=list(range(1, len(times) + 1)),
                mode="lines+markers",
                text=one.chunk_texts,
                hovertemplate="%{x} ms · 조각 %{y}: %{text}<extra></extra>",
                name="조각",
            )
        )
        fig.update_layout(
            height=280,
            title="누적 조각 수 (x: 요청을 보낸 뒤 ms)",
            xaxis_title="ms",
            yaxis_title="조각",
            margin=dict(l=10, r=10, t=40, b=10),
        )
        st.plotly_chart(fig, key="ch14_chunks")
        with st.expander("조각 목록 (data: …의 text)"):
            st.dataframe(
                [{"받은 시각 (ms)": t, "조각": repr(x)} for t, x in zip(times, one.chunk_texts)],
                hide_index=True,
            )


def _load_evidence(live, res, p: dict) -> None:
    evidence(
        "측정값",
        f"TTFT p50 {p['TTFT p50 (ms)']} ms · p90 {p['TTFT p90 (ms)']} ms, ITL p50 "
        f"{p['ITL p50 (ms)']} ms · p90 {p['ITL p90 (ms)']} ms, E2E p50 {p['E2E p50 (ms)']} ms "
        f"(완료 {p['완료']}개), 최대 대기 {p['최대 대기']}, 최대 KV {p['최대 KV 사용률 (%)']}%",
        **_conditions(
            live,
            도착률=f"{res.rate}/s (포아송)",
            사용자=res.max_users,
            프롬프트=f"{res.prompt_tokens}토큰",
            출력=f"{res.max_tokens}토큰",
            상한=f"도착 {res.duration_s:.0f}s + 마무리 {2 * res.duration_s:.0f}s",
        ),
    )
    evidence(
        "계산값",
        "TTFT = 첫 조각을 받은 시각 − 보낸 시각; ITL = 연속한 두 조각 사이; E2E = [DONE]까지. "
        "조각 하나에 토큰 하나가 보통이지만, 글자가 덜 된 토큰은 다음 조각과 합쳐 옵니다.",
        formula="engine/tools/workload.py의 percentile (numpy.percentile과 같은 선형 보간)",
    )


def _curve_view(live) -> None:
    results = st.session_state.get(CURVE)
    if not results:
        return
    table = curve_table(results)
    fig = go.Figure()
    for col in ("TTFT p50 (ms)", "TTFT p90 (ms)", "E2E p50 (ms)", "E2E p90 (ms)"):
        fig.add_trace(
            go.Scatter(x=table["도착률 (요청/s)"], y=table[col], mode="lines+markers", name=col)
        )
    cap = capacity_estimate(live.engine.config.max_num_seqs, table["E2E p50 (ms)"].iloc[0])
    if cap is not None:
        fig.add_vline(x=cap, line_dash="dash", annotation_text=f"추정 한계 {cap:.1f}/s")
    fig.update_layout(
        height=340,
        title="부하-지연 곡선: 도착률을 올리면 지연은 어디서 꺾이나",
        xaxis_title="도착률 (요청/s)",
        yaxis_title="ms",
        margin=dict(l=10, r=10, t=40, b=10),
    )
    st.plotly_chart(fig, key="ch14_curve")
    show_frame(table, hide_index=True)
    res = results[0]
    evidence(
        "측정값",
        f"도착률 {', '.join(str(r.rate) for r in results)} 요청/s에서 각각 측정한 지연",
        **_conditions(
            live,
            사용자=f"최대 {res.max_users}",
            출력=f"{res.max_tokens}토큰",
            프롬프트=f"{res.prompt_tokens}토큰",
            상한=f"점마다 도착 {res.duration_s:.0f}s + 마무리 {CURVE_DRAIN_S:.0f}s",
        ),
    )
    if cap is not None:
        evidence(
            "계산값",
            f"추정 한계 ≈ {cap:.1f} 요청/s: 동시에 {live.engine.config.max_num_seqs}개가 각각 가장 "
            "낮은 부하의 E2E만큼 걸린다고 본 상한 (배치가 차면 스텝이 길어지므로 실제는 이보다 "
            "낮음)",
            formula="max_num_seqs ÷ E2E p50(가장 낮은 도착률)",
        )


def _stream_view(live) -> None:
    table = st.session_state.get(STREAMCMP)
    if table is None:
        return
    med = stream_summary(table)
    fig = go.Figure()
    for col in ("첫 글자가 보이기까지 (ms)", "전체 답 (E2E, ms)"):
        fig.add_trace(go.Bar(x=med["방식"], y=med[col], name=col))
    fig.update_layout(
        height=320,
        barmode="group",
        title="같은 요청, 스트리밍과 비스트리밍 (중앙값)",
        yaxis_title="ms",
        margin=dict(l=10, r=10, t=40, b=10),
    )
    st.plotly_chart(fig, key="ch14_stream")
    st.dataframe(table.drop(columns=["_text"]), hide_index=True)
    same = table["_text"].nunique() == 1
    st.caption(
        "두 방식이 돌려준 글이 "
        + ("모두 같습니다 (같은 요청, greedy)." if same else "다릅니다 — 확인이 필요합니다.")
    )
    spread = table.groupby("방식", sort=False)["전체 답 (E2E, ms)"].agg(["min", "max"])
    st.caption(
        "E2E의 범위 (시도별 최소–최대): "
        + ", ".join(
            f"{mode} {row['min']:.0f}–{row['max']:.0f} ms" for mode, row in spread.iterrows()
        )
        + ". "
        + STREAM_RULE
    )
    measured = stream_e2e_verdict(table)
    if measured is not None:
        compare("ch14_stream", measured)
    evidence(
        "측정값",
        " · ".join(
            f"{row['방식']}: 첫 글자 {row['첫 글자가 보이기까지 (ms)']} ms, 전체 "
            f"{row['전체 답 (E2E, ms)']} ms"
            for _, row in med.iterrows()
        ),
        **_conditions(live, 반복=f"방식마다 {len(table) // 2}번 (번갈아)", 부하="요청 1개씩"),
    )


def _stream_state(stream: BackgroundStream) -> str:
    if stream.alive:
        return "살아 있음 (조각을 받는 중)"
    if stream.finished:
        return "끝남 (답을 다 받음)"
    if stream.error:
        return f"오류 ({stream.error})"
    return "끊김 (연결을 닫음)"


def _stream_status() -> None:
    """The background stream as it grows: refreshed every 0.5 s while it is live."""
    stream = st.session_state.get(STREAM)
    live_now = stream is not None and stream.alive

    @st.fragment(run_every=0.5 if live_now else None)
    def _status() -> None:
        current = st.session_state.get(STREAM)
        if current is None:
            return
        st.markdown(f"**긴 스트림**: {_stream_state(current)} · 받은 조각 {len(current.chunks)}개")
        st.text(current.text[-400:] or "…")
        if live_now and not current.alive:
            st.rerun(scope="app")  # it ended: stop the timer with a full rerun

    _status()


def _disconnect_view(live) -> None:
    _stream_status()
    result = st.session_state.get(DISCONNECT)
    if result is None:
        return
    if not result.cut:
        st.warning(
            "연결을 끊기 전에 스트림이 이미 끝났습니다. 출력 길이를 늘리거나 시작 직후에 "
            "끊어 보세요. 아래는 그래도 끝난 뒤의 서버 상태입니다."
        )
    _live_figure(
        [result.before, *result.after], "ch14_disconnect_fig", "연결을 끊은 뒤의 /metrics", 0.0
    )
    st.dataframe(result.table(), hide_index=True)
    freed = "—" if result.freed_after_ms is None else f"{result.freed_after_ms:.0f} ms"
    after = result.after[-1] if result.after else result.before
    evidence(
        "측정값",
        f"끊기 직전 실행 중 {result.before.running:.0f} · KV {100 * result.before.kv_usage:.1f}% → "
        f"끊은 뒤 실행 중 {after.running:.0f} · KV {100 * after.kv_usage:.1f}% "
        f"(처음으로 비기까지 {freed}, 받은 조각 {result.chunks_before}개)",
        **_conditions(live, 폴링="50 ms마다 /metrics"),
    )


def _server_controls():
    """The server's own settings, its start and stop buttons. Returns (overrides, live server)."""
    st.subheader("② 내 서버에 사용자들을 보내기: 실제 HTTP, 서버의 /metrics")
    st.caption(
        "같은 프로세스 안에서 이 세션 전용 OpenAI 호환 서버(engine/entrypoints/server/)가 "
        "127.0.0.1의 빈 "
        "포트로 뜹니다. 엔진은 사이드바 설정을 따르되, 줄이 생기는 것을 보기 쉽도록 동시 요청 "
        "수와 KV 블록을 작게 둡니다."
    )
    c1, c2, c3 = st.columns(3)
    seqs = c1.slider("서버 최대 동시 요청 수 (max_num_seqs)", 1, 8, SERVER_SEQS, key="ch14s_seqs")
    blocks = c2.slider("서버 KV 블록 수", 16, 128, SERVER_BLOCKS, step=8, key="ch14s_blocks")
    overrides = server_overrides(seqs, blocks)
    live = st.session_state.get(SERVER)
    with c3:
        if st.button("서버 시작", key="ch14s_start", width="stretch"):
            live = ensure_server(overrides)
        if st.button("서버 멈추기", key="ch14s_stop", width="stretch"):
            stop_server()
            for key in (LOAD, CURVE, STREAMCMP, DISCONNECT):
                st.session_state.pop(key, None)
            live = None
    if live is not None and live.alive:
        changed = live.signature != _signature(overrides)
        st.markdown(
            f"서버 실행 중: `{live.url}` · 엔진 KV 블록 {live.engine.num_blocks}개 · 최대 동시 "
            f"요청 {live.engine.config.max_num_seqs}"
            + (" · 설정이 바뀌어 다음 측정 때 새로 시작합니다" if changed else "")
        )
    else:
        st.caption("서버가 꺼져 있습니다. 아래 측정 버튼을 누르면 먼저 서버를 시작합니다.")
    return overrides, live


def _load_section(overrides: dict, live):
    """Simulated users against the server, and the load-latency curve. Returns
    (live server, prompt length, max_tokens) for the sections below."""
    st.markdown("#### 가상 사용자들")
    c1, c2, c3, c4, c5 = st.columns(5)
    users = c1.slider("사용자 수 (N)", 1, 40, 12, key="ch14s_users")
    rate = c2.slider("도착률 (요청/초)", 0.5, 20.0, 2.0, step=0.5, key="ch14s_rate")
    duration = c3.slider("측정 시간 상한 (초)", 1, 6, 3, key="ch14s_duration")
    max_tokens = c4.slider(
        "출력 길이 (max_tokens)", 4, 64, LOAD_MAX_TOKENS, step=4, key="ch14s_max_tokens"
    )
    prompt_len = c5.slider(
        "프롬프트 길이 (토큰)", 8, 256, LOAD_PROMPT_LEN, step=8, key="ch14s_prompt_len"
    )
    st.caption(
        f"사용자마다 요청 하나: /v1/completions, stream=true, greedy, 출력 정확히 {max_tokens}토큰 "
        f"(ignore_eos). 도착은 포아송 과정(평균 간격 {1 / rate:.2f} s), 도착은 {duration} s "
        "안에서만, "
        f"그 뒤 최대 {2 * duration} s 더 기다리고 남은 요청은 연결을 끊습니다."
    )
    predict(
        "ch14_knee",
        "도착률을 올려 가면 TTFT p50은 어떻게 변할까요?",
        options=[
            "도착률에 비례해 조금씩",
            "어느 지점까지 거의 그대로, 그 뒤 급격히",
            "변하지 않음",
        ],
    )
    c1, c2 = st.columns(2)
    if c1.button("부하 보내기", key="ch14s_load", type="primary", width="stretch"):
        live = ensure_server(overrides)
        _stop_stream()
        bar, tick = _progress_bar("부하")
        st.session_state[LOAD] = run_load_test(
            live.url,
            _prompts(live, prompt_len, users),
            rate,
            users,
            float(duration),
            max_tokens,
            prompt_len,
            drain_s=2.0 * duration,
            on_tick=tick,
        )
        bar.empty()
    rates = c2.multiselect(
        "곡선의 도착률들 (요청/초)",
        CURVE_RATES,
        default=[0.5, 1.0, 2.0, 4.0],
        key="ch14s_rates",
    )
    if c2.button("부하-지연 곡선 측정", key="ch14s_curve", width="stretch"):
        if not rates:
            st.warning("도착률을 하나 이상 고르세요.")
        else:
            live = ensure_server(overrides)
            _stop_stream()
            bar, tick = _progress_bar("곡선")
            st.session_state[CURVE] = latency_vs_load(
                live.url,
                _prompts(live, prompt_len, users),
                rates,
                users,
                float(min(duration, 2)),
                max_tokens,
                prompt_len,
                drain_s=CURVE_DRAIN_S,
                on_tick=tick,
            )
            bar.empty()
    if live is not None:
        _load_view(live)
        _curve_view(live)
        _knee_compare()
    return live, prompt_len, max_tokens


def _knee_compare() -> None:
    """The measured curve's shape (TTFT p50 over the rates) beside the learner's prediction."""
    points = st.session_state.get(CURVE)
    if not points:
        return
    p50 = curve_table(points)["TTFT p50 (ms)"].dropna().tolist()
    if len(p50) < 3:
        return
    jumps = [b / a if a else 0 for a, b in zip(p50, p50[1:])]
    knee = max(jumps) > 2 * min(jumps) and max(jumps) > 1.5
    flat = max(p50) < 1.25 * min(p50)
    measured = (
        "변하지 않음"
        if flat
        else "어느 지점까지 거의 그대로, 그 뒤 급격히"
        if knee
        else "도착률에 비례해 조금씩"
    )
    compare("ch14_knee", measured)


def _stream_section(overrides: dict, live, prompt_len: int, max_tokens: int):
    """The same request streamed and not, on an idle server. Returns the live server."""
    st.markdown("#### 스트리밍은 무엇을 줄이나")
    predict(
        "ch14_stream",
        "같은 요청을 stream=true로 받으면 stream=false에 비해 전체 답을 다 받는 시간(E2E)은?",
        options=CHOICES,
    )
    if st.button("스트리밍 vs 비스트리밍 측정", key="ch14s_streamcmp"):
        live = ensure_server(overrides)
        _stop_stream()
        bar = st.progress(0.0, text="같은 요청을 두 방식으로 번갈아 보내는 중…")

        def tick(p: dict) -> None:
            done, total = p["done"], max(p["total"], 1)
            bar.progress(min(done / total, 1.0), text=f"요청 {done}/{total} 끝남 (한 번에 하나씩)")

        st.session_state[STREAMCMP] = stream_vs_nonstream(
            live.url,
            _prompts(live, prompt_len, 1)[0],
            max(max_tokens, STREAM_MIN_TOKENS),
            STREAM_REPEATS,
            tick,
        )
        bar.empty()
    if live is not None:
        _stream_view(live)
    return live


def _disconnect_section(overrides: dict, live, prompt_len: int) -> None:
    """A long stream the learner cuts, and the server freeing its blocks."""
    st.markdown("#### 연결이 끊기면")
    st.caption(
        "긴 답(출력 400토큰)을 스트리밍으로 받기 시작한 뒤, 사용자가 탭을 닫은 것처럼 연결을 "
        "끊습니다. 서버는 그 요청을 중단(abort)하고 KV 블록을 돌려받아야 합니다."
    )
    c1, c2 = st.columns(2)
    if c1.button("긴 스트림 시작", key="ch14s_stream_start", width="stretch"):
        live = ensure_server(overrides)
        _stop_stream()
        st.session_state.pop(DISCONNECT, None)
        prompt = _prompts(live, prompt_len, 1)[0]
        room = live.engine.max_model_len - len(prompt) - 1
        st.session_state[STREAM] = BackgroundStream(
            live.url, request_body(prompt, max(min(400, room), 1), True)
        )
    if c2.button("연결 끊기", key="ch14s_disconnect", width="stretch"):
        stream = st.session_state.get(STREAM)
        live = st.session_state.get(SERVER)
        if stream is None or live is None:
            st.toast("먼저 '긴 스트림 시작'을 누르세요.")
        else:
            with st.spinner("연결을 끊고 /metrics를 50 ms마다 읽는 중… (최대 5 s)"):
                st.session_state[DISCONNECT] = disconnect_and_watch(live.url, stream)
    if live is not None:
        _disconnect_view(live)


def server_lab() -> None:
    overrides, live = _server_controls()
    live, prompt_len, max_tokens = _load_section(overrides, live)
    live = _stream_section(overrides, live, prompt_len, max_tokens)
    _disconnect_section(overrides, live, prompt_len)
