"""Token chips for chapter 02: what bytes each byte-level BPE token really holds.

A Korean syllable is three UTF-8 bytes; a byte-level BPE token may hold only some of them. Such a
token is shown as its bytes (e.g. <0xEB><0x95>), not as the whole syllable repeated. The bytes
come from the engine's own tokenizer (`Tokenizer.token_bytes`, which the API's logprobs use too).
"""

from __future__ import annotations

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
