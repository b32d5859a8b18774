"""Text ↔ token ids, the chat template, and detokenization that is safe to stream.

Byte-level BPE splits a Hangul syllable (3 UTF-8 bytes) or an emoji (4 bytes) across several
tokens. Decoding a token on its own can therefore yield half a character, which shows up as
U+FFFD. The IncrementalDetokenizer holds such tokens back until the character is complete.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Encoding
from tokenizers import Tokenizer as HFTokenizer

REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """Wraps the artifact's tokenizer.json (Hugging Face `tokenizers`) and its chat template."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        self._tok, self._plain = _hf_tokenizers(*_file_version(model_dir / "tokenizer.json"))
        self._byte_level = "ByteLevel" in repr(self._tok.decoder)
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        added = self._tok.get_added_tokens_decoder()
        self.special_token_ids = {i for i, t in added.items() if t.special}
        self.chat_template = config.get("chat_template")
        if self.chat_template is None and (model_dir / "chat_template.jinja").is_file():
            self.chat_template = (model_dir / "chat_template.jinja").read_text()
        self._template = _compile_template(self.chat_template) if self.chat_template else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string (e.g. a special token), None if the vocabulary lacks it."""
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def encode_plain(self, text: str) -> list[int]:
        """Encode `text` with special tokens read as ordinary text (no BOS/EOS added)."""
        return self._plain.encode(text, add_special_tokens=False).ids

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (OpenAI's logprobs `bytes`).

        A byte-level BPE token is a string over GPT-2's byte alphabet (e.g. "Ġ" is the space byte);
        mapped back, a token holding half a Hangul syllable gives its real bytes, where decoding
        the token alone would give U+FFFD. Special tokens are their text in UTF-8."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self.special_token_ids or not self._byte_level:
            return self.decode([token_id], skip_special_tokens=False).encode("utf-8")
        decoder = _gpt2_byte_decoder()
        if all(ch in decoder for ch in piece):
            return bytes(decoder[ch] for ch in piece)
        return piece.encode("utf-8")

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_pieces(self, text: str) -> list[tuple[int, str]]:
        """(token id, the exact span of `text` it covers): what chapter 02 draws as boundaries."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return [(tid, text[start:end]) for tid, (start, end) in zip(enc.ids, enc.offsets)]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True
    ) -> tuple[str, list[int]]:
        """The chat prompt as (text, token ids), where only the template makes control tokens.

        The template is rendered with a placeholder for each message's content; the template's
        own text is encoded with special tokens, each content with encode_plain. So a user who
        types "<|im_start|>system" gets those characters as text, not a forged system turn.
        (A template that filters the content, e.g. `| trim`, filters the placeholder instead: the
        content goes in as sent. The default artifact's template inserts it unchanged.)"""
        nonce = secrets.token_hex(8)
        masked = [{**m, "content": f"\ue000{nonce}:{i}\ue001"} for i, m in enumerate(messages)]
        rendered = self.apply_chat_template(masked, add_generation_prompt)
        # One pattern for every placeholder (split keeps the captured index): linear in the text
        placeholder = re.compile(f"\ue000{nonce}:(\\d+)\ue001")
        text_parts, encodings = [], []
        for i, part in enumerate(placeholder.split(rendered)):
            if i % 2:  # a placeholder's index: the client's text
                content = str(messages[int(part)].get("content") or "")
                text_parts.append(content)
                encodings.append(self._plain.encode(content, add_special_tokens=False))
            elif part:  # the template's text
                text_parts.append(part)
                encodings.append(self._tok.encode(part, add_special_tokens=False))
        if not encodings:
            encodings.append(self._tok.encode("", add_special_tokens=False))
        ids = self._tok.post_process(Encoding.merge(encodings), add_special_tokens=True).ids
        return "".join(text_parts), ids


def _file_version(path: Path) -> tuple[str, int, int]:
    """A file's resolved path, modification time and size: a cache key that a rewritten file
    (an artifact built again) does not match."""
    stat = path.stat()
    return str(path.resolve()), stat.st_mtime_ns, stat.st_size


@lru_cache(maxsize=8)
def _hf_tokenizers(path: str, mtime_ns: int, size: int) -> tuple[HFTokenizer, HFTokenizer]:
    """The tokenizer read from `path` twice: as it is, and a copy that reads special-token text
    ("<|im_start|>") as plain text, for what a client wrote, so that typed text can never become
    a control token. Read once per file and process and shared by every Tokenizer (both are only
    read after this): each engine the app builds for a page used to parse the 3.5 MB file twice,
    most of a page's opening time."""
    tok = HFTokenizer.from_file(path)
    plain = HFTokenizer.from_file(path)
    plain.encode_special_tokens = True
    return tok, plain


@lru_cache(maxsize=1)
def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte ↔ printable-character table, reversed (character → byte).

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted to 256 + n so that
    every byte has a visible, non-space character."""
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, shifted = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + shifted)
            shifted += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def _token_content(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


@lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    """Chat templates are Jinja; transformers renders them in a sandbox, and so do we."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


@dataclass
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never emitting a broken character.

    Only a short window of recent tokens is decoded at each step (from `prefix_offset`), so the
    cost per token stays constant however long the output grows. Text is released once the window
    decodes to more characters than before and does not end in U+FFFD (an incomplete byte run).
    """

    tokenizer: Tokenizer
    skip_special_tokens: bool = True
    token_ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""

    def add_token(self, token_id: int) -> str:
        """Append one token; return the new text it completes (may be "")."""
        self.token_ids.append(token_id)
        decode = lambda ids: self.tokenizer.decode(ids, self.skip_special_tokens)  # noqa: E731
        prefix_text = decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a request, release whatever is held back, even an invalid byte run."""
        full = self.tokenizer.decode(self.token_ids, self.skip_special_tokens)
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += delta
        self.read_offset = self.prefix_offset = len(self.token_ids)
        return delta
