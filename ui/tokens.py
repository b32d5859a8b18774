"""Token chips for chapter 02: what bytes each byte-level BPE token really holds.

A Korean syllable is three UTF-8 bytes; a byte-level BPE token may hold only some of them. Such a
token is shown as its bytes (e.g. <0xEB><0x95>), not as the whole syllable repeated. Read from the
artifact's tokenizer.json (the same file the engine's tokenizer loads)."""

from __future__ import annotations

import functools
import re
from pathlib import Path


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode table (byte-level BPE's printable alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


@functools.lru_cache(maxsize=4)
def _hf_tokenizer(model_dir: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


def token_bytes(model_dir: str | Path, token_id: int) -> bytes:
    token = _hf_tokenizer(str(model_dir)).id_to_token(token_id) or ""
    table = _unicode_to_byte()
    if token and all(c in table for c in token):
        return bytes(table[c] for c in token)
    return token.encode("utf-8")


def show_bytes(data: bytes) -> str:
    """Text for whole characters, <0xNN> for bytes that do not make a whole character alone."""
    text = data.decode("utf-8", errors="backslashreplace")
    return re.sub(r"\\x([0-9a-f]{2})", lambda m: f"<0x{m.group(1).upper()}>", text)


def chip_pieces(model_dir: str | Path, text: str) -> list[tuple[int, str, bool]]:
    """(token id, what it shows, whether it is a partial character) for each token of `text`."""
    enc = _hf_tokenizer(str(model_dir)).encode(text, add_special_tokens=False)
    pieces = []
    for tid in enc.ids:
        data = token_bytes(model_dir, tid)
        shown = show_bytes(data)
        pieces.append((tid, shown, "<0x" in shown))
    return pieces
