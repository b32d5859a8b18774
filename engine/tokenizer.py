"""Text ↔ token ids, the chat template, and detokenization that is safe to stream.

Byte-level BPE splits a Hangul syllable (3 UTF-8 bytes) or an emoji (4 bytes) across several
tokens. Decoding a token on its own can therefore yield half a character, which shows up as
U+FFFD. The IncrementalDetokenizer holds such tokens back until the character is complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """Wraps the artifact's tokenizer.json (Hugging Face `tokenizers`) and its chat template."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        self._tok = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.special_token_ids = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
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


def _token_content(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _compile_template(source: str) -> jinja2.Template:
    """Chat templates are Jinja; transformers renders them in a sandbox, and so do we."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
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
