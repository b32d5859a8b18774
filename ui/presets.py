"""Instructor presets: named scenarios per chapter that a shared link can name (?preset=이름).

PRESETS[chapter id][name] = (one-line Korean description, the link's parameters). The parameters
are a shared link's own (ui/share.py): `w.<widget key>` with a JSON value, `cfg.<setting>`, `step`.
A link's own parameters win over its preset's, so `?preset=예산 64&step=3` opens the preset at
step 3. tests/test_share.py applies every preset to its chapter's page and checks it runs.
"""

from __future__ import annotations

import json
from typing import Callable

import streamlit as st


def _w(**values) -> dict[str, str]:
    """Widget values as a link's `w.` parameters."""
    return {f"w.{key}": json.dumps(value, ensure_ascii=False) for key, value in values.items()}


PRESETS: dict[str, dict[str, tuple[str, dict[str, str]]]] = {
    "00": {
        "짧은 답": ("출력 8토큰: prefill 1스텝 + decode 7스텝을 세어 보기", _w(main_max_tokens=8)),
        "긴 답": ("출력 64토큰: decode 스텝이 출력 수만큼 늘어나는지 보기", _w(main_max_tokens=64)),
    },
    "01": {
        "영어 질문": (
            "기본 모델이 잘 답하는 영어 질문 하나를 HTTP로",
            _w(ch01_prompt="What is the capital of France?"),
        ),
        "한국어 질문": (
            "한국어 질문: 토큰이 더 많이 드는 것을 보기",
            _w(ch01_prompt="한국어로 자기소개를 해 주세요."),
        ),
    },
    "02": {
        "decode 8스텝": (
            "decode 스텝 8번: prefill과 decode 시간 비교의 기본",
            _w(ch02_num_decode=8),
        ),
        "decode 32스텝": ("decode 32번: 스텝마다 시간이 거의 같은지 보기", _w(ch02_num_decode=32)),
    },
    "03": {
        "짧은 프롬프트": (
            "프롬프트 16토큰, 4토큰 생성: 캐시 이득이 작은 경우",
            _w(ch03_prompt_len=16, ch03_new_tokens=4),
        ),
        "긴 프롬프트": (
            "프롬프트 256토큰, 48토큰 생성: 캐시 없이 다시 계산하는 비용이 커지는 경우",
            _w(ch03_prompt_len=256, ch03_new_tokens=48),
        ),
    },
    "04": {
        "한 번에 하나": (
            "최대 동시 요청 1: 순차 실행의 지연과 처리량",
            _w(ch04_seqs=1, ch04_gap=0),
        ),
        "여덟 개 한꺼번에": (
            "요청 8개가 동시에 도착, 동시 8: 처리량이 오르고 지연은?",
            _w(ch04_n=8, ch04_seqs=8, ch04_gap=0),
        ),
    },
    "05": {
        "float32": ("가중치·KV float32: 같은 GPU에 들어가는 요청 수", _w(ch05_dtype="float32")),
        "int8": ("가중치·KV int8: 메모리가 절반이 되면 요청 수는?", _w(ch05_dtype="int8")),
    },
    "06": {
        "최대 길이 예약": (
            "연속 예약이 max_model_len만큼 잡을 때의 낭비",
            _w(ch06_n=8, ch06_mode="max_model_len"),
        ),
        "필요한 만큼 예약": (
            "연속 예약이 prompt+max_tokens일 때와 블록 단위 비교",
            _w(ch06_n=8, ch06_mode="prompt+max_tokens"),
        ),
    },
    "07": {
        "작은 배치": ("배치 크기 2: 늦게 온 요청이 배치가 빌 때까지 기다리기", _w(ch07_batch=2)),
        "큰 배치": ("배치 크기 6, 늦은 요청 간격 10스텝", _w(ch07_batch=6, ch07_late_steps=10)),
    },
    "08": {
        "예산 32": (
            "토큰 예산 32: 긴 프롬프트가 32토큰씩 잘게 나뉘어 decode 사이에 끼는 모습",
            {**_w(ch08_budget=32), "step": "5"},
        ),
        "예산 512": (
            "토큰 예산 512: 긴 프롬프트가 한 스텝에 들어가면 chunked의 차이는?",
            _w(ch08_budget=512),
        ),
    },
    "09": {
        "선점 보기": (
            "KV 블록 8개에 요청 다섯: 누가 밀려나나",
            {**_w(ch09_exp="① 누가 선점되나", ch09_blocks=8), "step": "8"},
        ),
        "넉넉한 캐시": (
            "KV 블록 16개: 선점이 사라지는지 보기",
            _w(ch09_exp="① 누가 선점되나", ch09_blocks=16),
        ),
        "정책 비교": (
            "FCFS, 우선순위, 정적 배칭을 같은 도착에",
            _w(ch09_exp="③ FCFS vs 우선순위 vs 정적"),
        ),
    },
    "10": {
        "공유 시스템 프롬프트": (
            "같은 시스템 프롬프트를 쓰는 질문들: 캐시 적중",
            _w(ch10_scenario="공유 시스템 프롬프트"),
        ),
        "멀티턴 대화": (
            "대화가 이어질수록 앞 턴이 재사용되는 모습",
            _w(ch10_scenario="멀티턴 대화"),
        ),
    },
    "11": {
        "요청 하나": ("동시 요청 1: 양자화의 decode 속도 차이", _w(ch11_batch=1)),
        "요청 여덟": ("동시 요청 8: 배치가 커지면 차이는?", _w(ch11_batch=8)),
    },
    "12": {
        "요청 하나": (
            "요청 1개, 출력 8토큰: 워커 사이 통신만 보기",
            _w(ch12_requests=1, ch12_out=8),
        ),
        "pp까지": ("요청 4개와 pp 2 엔진을 나란히", _w(ch12_requests=4, ch12_pp=True)),
    },
    "13": {
        "k 1": ("초안 1토큰: 수락률과 속도", _w(ch13_k=1)),
        "k 8": ("초안 8토큰: 다 받아들여지지 않으면 낭비", _w(ch13_k=8)),
    },
    "14": {
        "작은 예산": (
            "토큰 예산 32: 긴 프롬프트가 짧은 요청의 TTFT를 얼마나 미루나",
            _w(ch14_budget=32),
        ),
        "큰 예산": ("토큰 예산 256: 한 스텝에 다 들어갈 때", _w(ch14_budget=256)),
    },
    "15": {
        "아주 긴 프롬프트": (
            "decode 중에 900토큰 프롬프트가 도착: 함께 배치 쪽의 토큰 간격이 얼마나 튀나",
            _w(ch15_long_len=900),
        ),
        "짧은 프롬프트, 느린 링크": (
            "128토큰의 K/V를 25 Gb/s 이더넷으로: 전송이 이득을 삼키는 쪽",
            _w(ch15_bytes_tokens=128, ch15_bytes_link="eth25"),
        ),
        "긴 프롬프트, NVLink": (
            "8,192토큰의 K/V를 NVLink로: 바이트는 크지만 시간은 짧은 쪽",
            _w(ch15_bytes_tokens=8192, ch15_bytes_link="nvlink"),
        ),
    },
    "16": {
        "enum과 숫자 범위": (
            "날씨 스키마: enum 값과 −30~45의 숫자에서 마스크가 무엇을 지우나",
            _w(ch16_kind="JSON 스키마", ch16_constraint="날씨 (enum + 숫자 범위 −30–45)"),
        ),
        "정규식 날짜": (
            "YYYY-MM-DD: 모양은 맞아도 날짜는 틀릴 수 있다",
            _w(ch16_kind="정규식", ch16_constraint="날짜 (정규식 YYYY-MM-DD)"),
        ),
        "선택지 셋": (
            "선택지 3개: 첫 스텝에서 지운 확률이 거의 1인 경우",
            _w(ch16_kind="선택지", ch16_constraint="감정 (선택지 3개)"),
        ),
    },
}


def chapter_presets(chapter_id: str) -> dict[str, tuple[str, dict[str, str]]]:
    return PRESETS.get(chapter_id, {})


def preset_params(chapter_id: str, name: str | None) -> dict[str, str]:
    """A preset's link parameters ({} when the chapter has no preset of that name)."""
    entry = chapter_presets(chapter_id).get(str(name or ""))
    return dict(entry[1]) if entry else {}


def preset_links(chapter_id: str, url_of: Callable[[dict], str]) -> None:
    """The chapter's presets, each with its description and its link (?preset=이름)."""
    presets = chapter_presets(chapter_id)
    if not presets:
        return
    st.markdown("**강사용 프리셋**")
    for name, (description, _params) in presets.items():
        st.markdown(f"- **{name}** — {description}")
        st.code(url_of({"preset": name}), language=None)
