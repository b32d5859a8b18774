"""Token chips for chapter 02: what bytes each byte-level BPE token really holds.

A Korean syllable is three UTF-8 bytes; a byte-level BPE token may hold only some of them. Such a
token is shown as its bytes (e.g. <0xEB><0x95>), not as the whole syllable repeated. The bytes
come from the engine's own tokenizer (`Tokenizer.token_bytes`, which the API's logprobs use too).
"""

from __future__ import annotations

import codecs
import functools
import re
from pathlib import Path

from engine.tokenizer import Tokenizer


@functools.lru_cache(maxsize=4)
def _tokenizer(model_dir: str) -> Tokenizer:
    return Tokenizer(model_dir)


def show_bytes(data: bytes) -> str:
    """Text for whole characters, <0xNN> for bytes that do not make a whole character alone."""
    text = data.decode("utf-8", errors="backslashreplace")
    return re.sub(r"\\x([0-9a-f]{2})", lambda m: f"<0x{m.group(1).upper()}>", text)


def chip_pieces(model_dir: str | Path, text: str) -> list[tuple[int, str, bool]]:
    """(token id, what it shows, whether it is a partial character) for each token of `text`."""
    tokenizer = _tokenizer(str(model_dir))
    pieces = []
    for tid, _span in tokenizer.token_pieces(text):
        shown = show_bytes(tokenizer.token_bytes(tid))
        pieces.append((tid, shown, "<0x" in shown))
    return pieces


# -- text a lab shows, from the token bytes (never U+FFFD) ----------------------------------------

BYTES_NOTE = (
    "⟨EC 9A⟩처럼 꺾쇠 안의 16진수는 UTF-8 글자를 이루지 못하는 바이트를 그대로 보인 것입니다."
)
INCOMPLETE_NOTE = (
    "글자 하나는 UTF-8 바이트 여러 개이고 토큰 하나가 그 일부만 담기도 합니다: 생성이 글자 "
    "중간에서 끝났거나(예: max_tokens), 모델이 글자를 이루지 못하는 바이트 토큰을 골랐습니다. "
    + BYTES_NOTE
)

_ESCAPED = re.compile("[\udc80-\udcff]+")  # bytes that were no character (surrogateescape)


def readable(data: bytes, final: bool = True) -> tuple[str, bool]:
    """UTF-8 text of `data` with every byte run that is not a whole character shown as its bytes
    (e.g. "⟨EC 9A⟩"), never as U+FFFD. Returns (text, whether any bytes were shown that way).

    While a request still generates (final=False), an incomplete character at the very end is
    held back, as the API's stream does (engine/tokenizer.py, IncrementalDetokenizer): its next
    token may complete it. At the end (final=True) such bytes are shown."""
    decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
    text = decoder.decode(data, final=final)

    def as_bytes(match: re.Match) -> str:
        return "⟨" + " ".join(f"{ord(c) - 0xDC00:02X}" for c in match.group()) + "⟩"

    shown = _ESCAPED.sub(as_bytes, text)
    return shown, shown != text


def token_text(tokenizer: Tokenizer, token_ids: list[int], final: bool = True) -> tuple[str, bool]:
    """readable() of the bytes these tokens stand for (special tokens such as EOS left out)."""
    special = tokenizer.special_token_ids
    data = b"".join(tokenizer.token_bytes(t) for t in token_ids if t not in special)
    return readable(data, final)
