"""03 · KV 캐시: generation with vs without the cache (measured), KV bytes per token from
config.json (derived), and the cache growing block by block (the standard lab)."""

import streamlit as st

from ui.experiments.ch03 import GROWTH_MAX_TOKENS
from ui.labs.ch03 import cache_compare_lab, growth_lab, kv_bytes_lab
from ui.lesson import render_chapter


def lab() -> None:
    cache_compare_lab()
    st.divider()
    kv_bytes_lab()
    st.divider()
    growth_lab()


render_chapter(
    "03",
    lab,
    claim=(
        f"출력 {GROWTH_MAX_TOKENS} 토큰을 만드는 요청 하나의 KV 캐시는 prefill이 받은 블록에 "
        "머물지 않습니다. decode가 블록 하나(16토큰)를 채울 때마다 새 블록을 받아, 끝나기 "
        "직전에는 prefill 직후보다 블록이 세 개 많습니다 (블록 크기 16 기준)."
    ),
)
