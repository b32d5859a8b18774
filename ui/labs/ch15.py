"""Chapter 15's lab parts (Streamlit): the K/V bytes one request hands from a prefill engine to a
decode engine and their time over a chosen link. The page composes them; what they compute is in
ui/experiments/ch15.py."""

import streamlit as st

from ui.errors import show_error
from ui.experiments.ch15 import kv_bytes_of, link_names, link_rows, link_time
from ui.session import current_settings, get_engine
from ui.widgets import evidence, show_frame


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
