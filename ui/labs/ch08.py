"""Chapter 08's lab parts (Streamlit): chunked prefill on and off under the same token budget (the
sides, the refusals, the summary) and the simulated budget sweep. The page composes them; what
they compute is in ui/experiments/ch08.py."""

import streamlit as st

from engine.config import DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD
from ui.experiments.ch08 import (
    CHUNKED_MODES,
    OFF,
    REAL_DEFAULTS,
    SIM_DEFAULTS,
    SWEEP_BUDGETS,
    ChunkedComparison,
    budget_sweep,
    budget_sweep_figure,
    chunked_config,
    chunked_summary,
    itl_change,
    itl_figure,
    step_time_figure,
    worst_itl,
)
from ui.lab import LabContext, Progress, Side, evidence_kind, run_results
from ui.predict import compare
from ui.session import current_settings
from ui.simulation import simulation_caption, simulation_overrides
from ui.widgets import decision_table, evidence, show_frame

RESULT = "ch08_result"
SIDE_KEYS = {"chunked prefill 켬": "ch08_on", "chunked prefill 끔": "ch08_off"}
FIELDS = (
    "enable_chunked_prefill",
    "max_num_batched_tokens",
    "max_num_seqs",
    "enable_prefix_caching",
    "max_model_len",
    "num_kv_blocks",
    "long_prefill_token_threshold",
)


def lab_sides(labels: list[str], budget: int, seqs: int, spec: dict | None) -> list[Side]:
    settings = current_settings()
    blocks = max(settings.num_kv_blocks, 1024 // settings.block_size)
    # simulated: a long context, and the KV capacity from the GPU's memory budget
    defaults = SIM_DEFAULTS if spec else REAL_DEFAULTS
    base = settings.to_config(
        max_model_len=defaults.max_model_len, num_kv_blocks=None if spec else blocks
    )
    sides = []
    for label in labels:
        cfg = chunked_config(base, CHUNKED_MODES[label], budget, seqs)
        overrides = {f: getattr(cfg, f) for f in FIELDS} | simulation_overrides(spec)
        sides.append(Side(SIDE_KEYS[label], label, overrides))
    return sides


def _wrap(results: dict) -> ChunkedComparison:
    return ChunkedComparison(results, chunked_summary(results))


def _refusals(ctx: LabContext) -> None:
    """Both sides accept the default workload; a request refused anyway (a prompt longer than
    max_model_len) is named, never silently left out of the comparison."""
    for side in ctx.sides:
        feeder = ctx.feeders.get(side.key)
        if feeder is not None and feeder.rejected:
            st.warning(
                f"{side.label}: 최대 길이({ctx.engines[side.key].max_model_len}토큰)보다 긴 요청을 "
                f"엔진이 거절했습니다 — {', '.join(feeder.rejected)}."
            )


def summary_view(ctx: LabContext) -> None:
    _refusals(ctx)
    result = run_results(ctx, RESULT, _wrap)
    if result is None:
        st.info("모든 엔진이 워크로드를 끝내면 여기에 전체 요약이 나옵니다.")
        return
    st.markdown("**전체 실행 요약** (엔진 시계)")
    show_frame(result.summary, hide_index=True)
    st.plotly_chart(step_time_figure(result.runs), key="ch08_step_times")
    st.plotly_chart(itl_figure(result.runs), key="ch08_itl")
    on, off = worst_itl(result.summary)
    if on is not None and off is not None:
        compare("ch08_itl", itl_change(on, off))
        st.caption(f"짧은 요청들의 ITL 최대(가장 긴 토큰 간격): 켬 {on:.1f} ms, 끔 {off:.1f} ms")
    for side, (label, res) in zip(ctx.sides, result.runs.items()):
        evidence(
            evidence_kind(ctx.engines[side.key]),
            f"{label}: 스텝 {len(res.records)}개, 전체 {res.elapsed_s:.2f} s (엔진 시계)",
            **res.conditions,
        )
    evidence(
        "계산값",
        "다른 요청 ITL 최대 = 짧은 요청들의 연속한 두 토큰 시각 차 중 최대; "
        "긴 요청 TTFT = 첫 토큰 시각 − 도착 시각",
        formula="RequestMetrics (엔진 시계)",
    )
    first = next(iter(result.runs.values()))
    mixed = [r for r in first.records if len({x.phase for x in r.scheduled}) > 1]
    if mixed:
        st.markdown(f"**섞인 스텝 하나의 결정** ({first.label}, 스텝 {mixed[0].step})")
        show_frame(decision_table(mixed[0]), hide_index=True)
    for res in result.runs.values():
        blocked = [r for r in res.records if "token_budget" in r.unscheduled.values()]
        if blocked:
            st.markdown(
                f"**토큰 예산 때문에 빠진 요청이 있는 스텝** ({res.label}, 스텝 {blocked[0].step})"
            )
            show_frame(decision_table(blocked[0]), hide_index=True)


def budget_sweep_view(spec: dict) -> None:
    """At 8B/70B scale: TTFT vs ITL as the token budget moves (simulated, 계산값)."""
    st.subheader("규모를 키우면: 토큰 예산에 따른 TTFT와 ITL (시뮬레이션)")
    c1, c2 = st.columns(2)
    rate = c1.slider("요청 도착률 (초당)", 1.0, 16.0, 4.0, step=1.0, key="ch08_sweep_rate")
    num = c2.slider("요청 수", 40, 200, 80, step=20, key="ch08_sweep_requests")
    st.caption(
        f"같은 Poisson 워크로드(프롬프트 256–4096, 출력 32–256토큰)를 토큰 예산 "
        f"{', '.join(map(str, SWEEP_BUDGETS))}로 한 번씩 돌립니다. chunked prefill 켬."
    )
    cache = st.session_state.setdefault("ch08_sweeps", {})
    tp = spec.get("tensor_parallel_size", 1)
    sweep_key = (spec["model_preset"], spec["hardware"], tp, rate, num)
    if st.button("예산 훑기 실행", key="ch08_sweep_run", icon=":material/query_stats:"):
        progress = Progress(len(SWEEP_BUDGETS), "예산")
        try:
            cache[sweep_key] = budget_sweep(
                spec["model_preset"],
                spec["hardware"],
                rate,
                num_requests=num,
                tensor_parallel_size=tp,
                progress=progress,
            )
        finally:
            progress.close()
    table = cache.get(sweep_key)
    if table is None:
        st.info("버튼을 누르면 예산마다 시뮬레이션을 한 번씩 돌려 표와 그림을 그립니다.")
        return
    fig = budget_sweep_figure(table)
    st.plotly_chart(fig, key="ch08_sweep_fig")
    show_frame(table)
    evidence(
        "계산값",
        "TTFT·ITL 백분위, 처리량: 시뮬레이션 엔진 시계 (실제 스케줄러, 비용 모델의 스텝 시간)",
        formula="스텝 시간 = max(가중치 바이트/대역폭, FLOPs/최대 FLOP/s)/효율 + 어텐션 + 고정",
    )
    st.caption(simulation_caption(spec))


def lab_settings(spec: dict | None) -> tuple[int, int, int, int, list[str]]:
    """The lab's sliders: budget, max_num_seqs, long prompt length, its arrival, the sides."""
    c1, c2, c3, c4 = st.columns(4)
    d = REAL_DEFAULTS if spec is None else SIM_DEFAULTS
    budget_label, long_label = "토큰 예산 (max_num_batched_tokens)", "긴 프롬프트 길이 (토큰)"
    if spec is None:
        budget = c1.slider(budget_label, 16, 512, d.budget, step=16, key="ch08_budget")
        long_len = c3.slider(long_label, 100, 600, d.long_prompt_len, step=20, key="ch08_long")
    else:  # a GPU-scale engine: GPU-scale budgets and prompts
        budget = c1.slider(budget_label, 256, 8192, d.budget, step=256, key="ch08_budget_sim")
        long_len = c3.slider(
            long_label, 1000, 8000, d.long_prompt_len, step=500, key="ch08_long_sim"
        )
    seqs = c2.slider("최대 동시 요청 수 (max_num_seqs)", 1, 8, d.max_num_seqs, key="ch08_seqs")
    arrival = c4.slider(
        "긴 프롬프트 도착 (ms)", 0, 500, int(d.long_arrival_ms), step=50, key="ch08_arrival"
    )
    c1, c2 = st.columns(2)
    chunked = c1.toggle(
        "chunked prefill",
        value=True,
        key="ch08_chunked",
        help="한 엔진만 돌릴 때 켤지 끌지 (나란히 비교를 끄면 쓰임)",
    )
    both = c2.checkbox("켬·끔 나란히 비교 (한 스텝에 두 엔진)", value=True, key="ch08_both")
    chosen = next(k for k, v in CHUNKED_MODES.items() if v == chunked)
    return budget, seqs, long_len, arrival, list(CHUNKED_MODES) if both else [chosen]


def off_note(sides: list[Side], budget: int) -> None:
    """Why no engine here caps a prompt's chunk below the budget (the engine's default does),
    and why the chunked-prefill-off engine runs with a larger budget (vLLM's rule)."""
    st.caption(
        f"이 실험실의 엔진은 `long_prefill_token_threshold`를 0(상한 없음)으로 둡니다. 엔진 "
        f"기본값({DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD})이라면 긴 프롬프트는 예산과 상관없이 "
        f"한 스텝에 {DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD}토큰까지만 들어가지만, 여기서는 조각 "
        "크기를 토큰 예산 하나로만 정해 예산 슬라이더가 말 그대로의 뜻을 갖게 했습니다. 그 상한과 "
        "그 대가는 14장 실험실에서 비교합니다."
    )
    off = next((s for s in sides if s.label == OFF), None)
    if off is None:
        return
    off_budget = off.overrides["max_num_batched_tokens"]
    st.info(
        "chunked prefill을 끈 엔진은 프롬프트를 한 스텝에 통째로 넣어야 하므로, vLLM은 이때 토큰 "
        "예산이 최대 길이(max_model_len) 이상이기를 요구하고 따로 정하지 않으면 예산을 최대 "
        f"길이로 올립니다. 이 실험실도 같은 규칙을 따라 끔 쪽 예산을 {off_budget:,}토큰"
        f"(최대 길이)으로 두었습니다. 켬 쪽은 고른 예산 {budget:,}토큰 그대로입니다. 그래서 두 "
        "엔진은 같은 요청을 모두 받고, 다른 것은 긴 프롬프트를 나눠 넣느냐뿐입니다."
    )
