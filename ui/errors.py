"""Engine errors as Korean messages that say what to change (no traceback reaches a learner)."""

from __future__ import annotations

import streamlit as st


def korean_error(exc: BaseException) -> str:
    """One Korean sentence (or two) for an engine error: what happened and what to change."""
    from engine.sampling_params import InvalidRequestError
    from engine.tools.presets import PresetError
    from engine.worker.worker import CacheTooSmallError

    text = str(exc)
    if isinstance(exc, PresetError) and "does not fit" in text:
        return (
            "이 모델의 가중치가 이 GPU 메모리에 들어가지 않습니다 (KV 캐시를 두기도 전에). "
            "GPU 수(텐서 병렬)를 늘리거나 메모리가 더 큰 GPU를 고르세요. 모자란 양은 아래 "
            "원문에 있습니다."
        )
    if isinstance(exc, CacheTooSmallError):
        tokens = exc.num_blocks * exc.block_size
        return (
            f"KV 캐시가 너무 작습니다: 블록 {exc.num_blocks}개는 {tokens}토큰을 담는데, 요청 "
            f"하나의 최대 길이는 {exc.max_model_len}토큰입니다. 사이드바에서 KV 블록 수를 늘리거나 "
            f"최대 길이(max_model_len)를 {tokens} 이하로 낮추세요."
        )
    if isinstance(exc, InvalidRequestError):
        d = getattr(exc, "details", {})
        if "max_model_len" in d:
            return (
                f"요청이 너무 깁니다: 프롬프트 {d['num_prompt_tokens']}토큰 + 출력 "
                f"{d['max_tokens']}토큰이 최대 길이 {d['max_model_len']}토큰을 넘습니다. "
                "max_tokens를 줄이거나, 사이드바에서 최대 길이(와 KV 블록 수)를 늘리세요."
            )
        return (
            f"요청이 거절되었습니다 ({getattr(exc, 'param', '') or '입력'}): 입력값을 확인하세요."
        )
    if "max_num_batched_tokens" in text and "max_model_len" in text:
        return (
            "chunked prefill을 끄면 한 스텝의 토큰 예산이 최대 길이 이상이어야 합니다. 토큰 예산을 "
            "늘리거나 최대 길이를 낮추세요."
        )
    if "must be positive" in text:
        return "블록 크기, 토큰 예산, 최대 동시 요청 수는 1 이상이어야 합니다."
    if isinstance(exc, FileNotFoundError) or "artifact" in text.lower():
        return (
            "모델 파일을 찾지 못했습니다. 사이드바의 모델 경로를 비우면 기본 모델을 씁니다 "
            "(처음이면 터미널에서 `python -m engine artifact build`)."
        )
    if isinstance(exc, MemoryError) or "out of memory" in text.lower():
        return "메모리가 부족합니다. KV 블록 수나 최대 동시 요청 수를 줄이세요."
    return (
        "엔진이 이 작업을 끝내지 못했습니다. 리셋하거나 사이드바 설정을 기본값으로 되돌려 보세요."
    )


def show_error(exc: BaseException, where: str = "") -> None:
    """The Korean message, with the engine's own words folded away (never a traceback)."""
    st.error((f"{where}: " if where else "") + korean_error(exc), icon=":material/error:")
    with st.expander("엔진이 남긴 원문 메시지"):
        st.code(f"{type(exc).__name__}: {exc}", language=None)
