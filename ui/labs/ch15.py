"""Chapter 15's lab parts (Streamlit): the K/V bytes one request hands from a prefill engine to a
decode engine and their time over a chosen link; the host tier's three cases (device hit, tier
hit, miss). The page composes them; what they compute is in
ui/experiments/ch15.py."""

import uuid

import streamlit as st

from ui.errors import show_error
from ui.experiments import ch15
from ui.experiments.ch15 import kv_bytes_of, link_names, link_rows, link_time
from ui.experiments.common import measurement_conditions
from ui.lab import LabContext, Progress, Side, run_results
from ui.predict import compare, predict
from ui.session import build_engine, current_settings, get_engine, persist_key
from ui.widgets import evidence, show_frame

TIER_KEY = "ch15_tier"
SWEEP_KEY = "ch15_sweep"


def _mb(num_bytes: float) -> str:
    return f"{num_bytes / 1e6:,.2f} MB"


def bytes_section(engine_key: str, overrides: dict) -> None:
    """Bytes per request (계산값 from the running engine's model and dtype) and the time over each
    link preset (계산값; the bandwidth is the vendor's figure)."""
    st.subheader("링크를 건너는 K/V: 요청 하나에 몇 바이트, 얼마 동안")
    try:
        engine = get_engine(engine_key, **overrides)
    except Exception as exc:  # noqa: BLE001
        show_error(exc, "엔진을 만들 수 없습니다")
        return
    c1, c2 = st.columns(2)
    tokens = c1.slider("보낼 프롬프트 길이 (토큰)", 16, 8192, 400, step=16, key="ch15_bytes_tokens")
    names = link_names()
    link = c2.selectbox(
        "링크", list(names), format_func=names.get, index=len(names) - 2, key="ch15_bytes_link"
    )
    dtype_bytes = engine.dtype.itemsize if hasattr(engine.dtype, "itemsize") else 4
    kv = kv_bytes_of(engine.model_config, dtype_bytes, tokens)
    evidence(
        "계산값",
        f"요청 하나의 K/V: {_mb(kv.total)} (토큰당 {kv.per_token:,} B)",
        formula=kv.formula(),
    )
    seconds, reported, source = link_time(link, kv.total)
    evidence(
        "계산값",
        f"{names[link]}로 보내면 약 {1e3 * seconds:,.3f} ms",
        formula="바이트 ÷ 한 방향 대역폭 + 가정한 지연 (링크에 이 전송 하나만 있을 때)",
    )
    evidence("제조사 문서", f"{names[link]}: {reported}", source=source)
    st.markdown("**링크마다 같은 바이트를 보내면** (계산값)")
    show_frame(link_rows(kv.total))
    st.caption(
        f"모델: {current_settings().model or '기본 모델'} · dtype {str(engine.dtype)[6:]} · "
        "지연은 프리셋이 가정한 값이며 제조사의 숫자가 아닙니다."
    )


TIER_CHOICES = [
    "장치 < 계층 < 못 찾음",
    "계층 < 장치 < 못 찾음",
    "장치 < 못 찾음 < 계층",
    "셋이 같다",
]


def _tier_order(cases) -> str:
    """The measured TTFT order as one of TIER_CHOICES (ties count as equal only when all are)."""
    device, tier, miss = (c.ttft_s for c in cases)
    if device == tier == miss:
        return TIER_CHOICES[3]
    if tier < device:
        return TIER_CHOICES[1]
    return TIER_CHOICES[0] if tier <= miss else TIER_CHOICES[2]


def tier_section(engine_key: str, overrides: dict) -> None:
    """The shared prefix that comes back: from the device cache, from the host tier, or
    recomputed; each on a fresh engine with the OffloadingConnector (or none)."""
    st.subheader("호스트 계층: 밀려난 시스템 프롬프트가 돌아올 때")
    block_size = current_settings().block_size
    st.caption(
        f"작은 장치 캐시(KV 블록 {ch15.TIER_BLOCKS}개, 블록당 {block_size}토큰, 스텝당 "
        f"{ch15.TIER_BUDGET}토큰)에 A(공유 시스템 프롬프트 {ch15.TIER_PREFIX_BLOCKS}블록 + 질문) → "
        "B(캐시를 다 쓰는 다른 프롬프트) → A2(같은 시스템 프롬프트 + 새 질문)를 차례로 보냅니다. "
        "A2의 첫 토큰까지를 세 경우로 잽니다: B 없이 바로(장치에서 찾음), 계층을 켜고(계층에서 "
        "찾음), 계층 없이(못 찾음). 경우마다 새 엔진입니다."
    )
    cases = st.session_state.get(TIER_KEY)
    predict(
        "ch15_tier",
        "A2의 TTFT는 세 경우에 어떤 순서일까요?",
        options=TIER_CHOICES,
        locked=cases is not None,
    )
    if st.button("계층 실험 실행", key="ch15_tier_run"):
        bar = Progress(3 * ch15.TIER_REPEATS, "실행")
        try:
            engine = get_engine(engine_key, **overrides)
            per_token = ch15.kv_bytes_of(engine.model_config, engine.dtype.itemsize, 1).total
            st.session_state[TIER_KEY] = cases = ch15.tier_experiment(
                _make_engine, block_size, per_token, progress=bar
            )
        except Exception as exc:  # noqa: BLE001
            show_error(exc, "계층 실험을 실행하지 못했습니다")
        bar.close()
    if cases is None:
        return
    show_frame(ch15.tier_table(cases))
    compare("ch15_tier", _tier_order(cases))
    device, tier, miss = cases
    engine = get_engine(engine_key, **overrides)
    evidence(
        "측정값",
        f"A2의 TTFT ({ch15.TIER_REPEATS}번 잰 중앙값): 장치에서 찾음 {1e3 * device.ttft_s:.1f} ms, "
        "계층에서 찾음 "
        f"{1e3 * tier.ttft_s:.1f} ms (불러오기 {1e3 * tier.load_seconds:.2f} ms 포함), 못 찾음 "
        f"{1e3 * miss.ttft_s:.1f} ms (엔진 시계); 첫 토큰까지 스텝 {device.steps_to_first_token}, "
        f"{tier.steps_to_first_token}, {miss.steps_to_first_token}",
        **measurement_conditions(engine, 블록크기=block_size),
    )
    stats = tier.tier_stats
    evidence(
        "측정값",
        f"계층의 숫자 (계층에서 찾음의 엔진): 찾은 토큰 {stats.get('tier_hit_tokens', 0)}, "
        f"불러오기 {stats.get('loads', 0)}번, 적어 두기 {stats.get('stores', 0)}번, "
        f"계층에서 밀려난 블록 {stats.get('tier_evictions', 0)}개, "
        f"불러온 바이트 {tier.load_bytes:,} B",
        **measurement_conditions(engine, 블록크기=block_size),
    )
    if _tier_order(cases) != TIER_CHOICES[0]:
        st.warning(
            "이번 측정의 TTFT 순서는 계산량의 순서(첫 토큰까지 스텝과 계산한 프롬프트 토큰)와 "
            "다릅니다. 한 스텝의 시간은 이 기계의 다른 일에 따라 크게 흔들립니다. 표의 반복한 "
            "TTFT를 보고, 다시 실행해 보세요."
        )
    if device.output_token_ids == tier.output_token_ids == miss.output_token_ids:
        st.success(
            "세 경우 모두 A2의 출력 토큰이 같습니다(측정값). 계층은 계산을 건너뛰게 할 뿐, "
            "답을 바꾸지 않습니다."
        )


def _make_engine(**overrides):
    """A fresh engine for the experiments below the lab (weights are shared per process)."""
    return build_engine(current_settings(), **overrides)


# -- colocated vs split, in lockstep (the shared lab) ------------------------------------------

SIDE_KEYS = {"colocated": "ch15_colocated", "prefill": "ch15_prefill", "decode": "ch15_decode"}
RESULT = "ch15_result"
SPLIT_CHOICES = ["함께 배치만", "분리만", "둘 다", "둘 다 아님"]
LONG_COLUMN = "그 스텝에서 계산한 긴 프롬프트 토큰"


CHANNEL = "_ch15_channel"
persist_key(CHANNEL)  # a reload keeps the name, hence the pair's engines (their overrides name it)


def _channel() -> str:
    """This session's channel name: the pair's two engines meet there, no other session's do."""
    return st.session_state.setdefault(CHANNEL, f"ch15-{uuid.uuid4().hex[:12]}")


def lab_sides() -> list[Side]:
    prefill, decode = ch15.pair_overrides(_channel())
    overrides = {"colocated": ch15.lab_overrides(), "prefill": prefill, "decode": decode}
    return [Side(key, ch15.SIDE_LABELS[side], overrides[side]) for side, key in SIDE_KEYS.items()]


def make_feeders(ctx: LabContext, workload) -> dict:
    """The colocated engine's feeder and the pair's two (one DisaggregatedPair over the prefill
    and the decode side's engines)."""
    from engine.entrypoints.disagg import DisaggregatedPair

    engines = ctx.engines
    pair = DisaggregatedPair(engines[SIDE_KEYS["prefill"]], engines[SIDE_KEYS["decode"]])
    feeders = ch15.side_feeders(engines[SIDE_KEYS["colocated"]], pair, workload)
    return {SIDE_KEYS[side]: feeder for side, feeder in feeders.items()}


def predict_split(ctx: LabContext) -> None:
    predict(
        "ch15_split",
        "긴 프롬프트의 prefill이 짧은 요청들의 decode와 같은 스텝에 드는(그래서 그 토큰 간격이 "
        "늘어나는) 쪽은 어디일까요?",
        options=SPLIT_CHOICES,
        locked=ctx.started,
    )


def _driver(ctx: LabContext):
    feeder = ctx.feeders.get(SIDE_KEYS["prefill"])
    return getattr(feeder, "driver", None)


def split_view(ctx: LabContext) -> None:
    """Below the three engines' views: each request's crossing (prefill, transfer, decode), and
    once the workload is done, the short requests' ITL colocated vs split."""
    driver = _driver(ctx)
    if driver is None or not driver.transfers:
        st.info(
            "워크로드를 넣고 진행하면, 여기에 요청마다 prefill → 전송 → decode 구간이 나옵니다."
        )
    else:
        st.markdown("**요청마다 건너간 길** (prefill 엔진 → 전송 → decode 엔진)")
        st.plotly_chart(ch15.crossing_figure(driver), key="ch15_crossing")
        _transfer_evidence(ctx, driver)
    runs = run_results(ctx, RESULT)
    if runs is None:
        return
    colocated = ch15.short_itl_rows(runs[ch15.SIDE_LABELS["colocated"]])
    split = ch15.short_itl_rows(runs[ch15.SIDE_LABELS["decode"]])
    st.markdown("**짧은 요청들의 토큰 간격 (ITL)**: 함께 배치 vs 분리의 decode 엔진")
    st.plotly_chart(ch15.itl_figure(colocated, split), key="ch15_itl")
    spiked = bool((colocated[LONG_COLUMN] > 0).any())
    split_spiked = bool((split[LONG_COLUMN] > 1).any())
    measured = SPLIT_CHOICES[
        {(True, False): 0, (False, True): 1, (True, True): 2}.get((spiked, split_spiked), 3)
    ]
    compare("ch15_split", measured)
    _itl_evidence(ctx, colocated, split)


def _transfer_evidence(ctx: LabContext, driver) -> None:
    engine = ctx.engines[SIDE_KEYS["decode"]]
    show_frame(ch15.transfer_table(driver))
    last = driver.transfers[-1]
    evidence(
        "측정값",
        f"{last.request_id}: {last.num_tokens}토큰의 K/V {last.num_bytes:,} B를 prefill 엔진이 "
        f"내보내는 데 {1e3 * last.save_seconds:.3f} ms, decode 엔진이 불러오는 데 "
        f"{1e3 * last.load_seconds:.3f} ms (한 프로세스 안의 메모리 복사: 어떤 링크의 시간도 "
        "아닙니다)",
        **measurement_conditions(engine, 블록크기=engine.config.block_size),
    )


def _itl_evidence(ctx: LabContext, colocated, split) -> None:
    engine = ctx.engines[SIDE_KEYS["colocated"]]
    long_rows = colocated[colocated[LONG_COLUMN] > 0]
    if len(long_rows):
        evidence(
            "측정값",
            f"함께 배치: 긴 프롬프트 {int(long_rows[LONG_COLUMN].max())}토큰의 prefill과 같은 "
            f"스텝에서 나온 짧은 요청의 ITL {long_rows['ITL (ms)'].max():.1f} ms, 그 밖의 ITL "
            f"중앙값 {colocated[colocated[LONG_COLUMN] == 0]['ITL (ms)'].median():.1f} ms "
            "(엔진 시계)",
            **measurement_conditions(engine, 토큰예산=engine.config.max_num_batched_tokens),
        )
    evidence(
        "측정값",
        f"분리의 decode 엔진: 짧은 요청의 ITL 중앙값 {split['ITL (ms)'].median():.1f} ms, 최대 "
        f"{split['ITL (ms)'].max():.1f} ms; 한 스텝에서 계산한 긴 프롬프트 토큰은 많아야 "
        f"{int(split[LONG_COLUMN].max())}개 (나머지는 불러옴)",
        **measurement_conditions(ctx.engines[SIDE_KEYS["decode"]]),
    )
    st.caption(
        "여러 사람이 나눠 쓰는 CPU에서는 다른 일 때문에 스텝 하나가 수십~수백 ms 늘기도 합니다. "
        "간격 하나의 크기보다, 그 간격을 만든 스텝이 무엇을 계산했는지(표의 마지막 열)를 함께 "
        "읽으세요."
    )


# -- the simulator's P:D sweep ----------------------------------------------------------------


def sweep_section() -> None:
    st.subheader("P:D 훑기: prefill GPU는 몇 대가 알맞나 (시뮬레이터)")
    c1, c2, c3, c4 = st.columns(4)
    gpu = c1.selectbox("GPU", list(ch15.SWEEP_GPUS), key="ch15_sweep_gpu")
    total = c2.slider("GPU 수", 2, 6, 4, key="ch15_sweep_total")
    rate = c3.slider("도착률 (요청/초)", 2.0, 32.0, 16.0, step=2.0, key="ch15_sweep_rate")
    names = link_names()
    link = c4.selectbox("전송 링크", list(names), format_func=names.get, key="ch15_sweep_link")
    ttft, tpot = ch15.SWEEP_SLO
    st.caption(
        f"{ch15.SWEEP_MODEL} (bf16), 요청 {ch15.SWEEP_REQUESTS}개가 포아송 도착, 프롬프트 "
        f"{ch15.SWEEP_PROMPTS[0]}–{ch15.SWEEP_PROMPTS[1]}토큰, 출력 {ch15.SWEEP_OUTPUTS[0]}–"
        f"{ch15.SWEEP_OUTPUTS[1]}토큰. SLO(가정한 목표): TTFT {1e3 * ttft:.0f} ms, TPOT "
        f"{1e3 * tpot:.0f} ms. 같은 요청들을 P:D마다, 그리고 같은 수의 GPU에 함께 배치해 돌립니다."
    )
    if st.button("P:D 훑기 실행", key="ch15_sweep_run"):
        with st.spinner("시뮬레이터가 배치마다 같은 워크로드를 돌리는 중…"):
            try:
                st.session_state[SWEEP_KEY] = ch15.pd_sweep(gpu, total, rate, link)
            except Exception as exc:  # noqa: BLE001
                show_error(exc, "P:D 훑기를 실행하지 못했습니다")
    sweep = st.session_state.get(SWEEP_KEY)
    if sweep is None:
        return
    table = ch15.sweep_table(sweep)
    show_frame(table)
    st.plotly_chart(ch15.sweep_figure(table, sweep.best), key="ch15_sweep_fig")
    cond = sweep.results[0].conditions
    evidence(
        "계산값",
        f"GPU {sweep.total_gpus}대에서 goodput이 가장 높은 분리: P:D {sweep.best}",
        formula="비용 모델(GPU 프리셋)로 잰 가상 시계의 스텝 시간; 전송 = KV 바이트 ÷ 링크의 한 "
        "방향 대역폭 + 가정한 지연",
    )
    evidence(
        "제조사 문서",
        f"{cond['hardware']['name']}, {cond['link']['name']} ({cond['link']['reported']})",
        source=f"{cond['hardware']['source']}; {cond['link']['source']}",
    )
