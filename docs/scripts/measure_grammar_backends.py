"""Compile time and mask time per step: xgrammar vs llguidance, on our tokenizer (49,152 tokens).

The measurement behind docs/structured_outputs.md's choice. It needs both wheels in a scratch
folder (xgrammar is not a dependency of this project: it pulls torch, triton and transformers),
see that file for the commands:
    PYTHONPATH=/tmp/so_scratch .venv/bin/python docs/scripts/measure_grammar_backends.py llguidance
"""

from __future__ import annotations

import importlib
import json
import statistics
import sys
import time
from pathlib import Path

MODEL = Path.home() / ".cache/llm-inference-lab/SmolLM2-135M-Instruct"
ADDRESS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
    "required": ["city"],
}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}},
        "address": ADDRESS,
    },
    "required": ["name", "age", "tags", "address"],
}
TEXT_JSON = json.dumps(
    {"name": "Alice", "age": 31, "tags": ["a", "c"], "address": {"city": "Seoul", "zip": "04524"}}
)
REGEX, TEXT_REGEX = r"\d{3}-\d{4}-\d{4}", "010-1234-5678"
LARK = 'start: expr\nexpr: term (("+"|"-") term)*\nterm: NUMBER | "(" expr ")"\nNUMBER: /[0-9]+/\n'
GBNF = 'root ::= expr\nexpr ::= term (("+"|"-") term)*\nterm ::= num | "(" expr ")"\n'
GBNF += "num ::= [0-9]+\n"
TEXT_GRAMMAR = "(12+3)-45+(6-(7+8))"


def timed(fn):
    """(fn(), milliseconds it took)."""
    start = time.perf_counter()
    result = fn()
    return result, (time.perf_counter() - start) * 1000


def mask_times(ids, fill_mask, accept) -> tuple[float, float]:
    """Median and max milliseconds of one mask, feeding the token ids one at a time."""
    times = []
    for token in ids:
        times.append(timed(fill_mask)[1])
        assert accept(token), token
    return statistics.median(times), max(times)


def run_llguidance() -> list[tuple]:
    import llguidance

    tok, t_tok = timed(lambda: llguidance.LLTokenizer(str(MODEL / "tokenizer.json")))
    rows = [("tokenizer", t_tok, None, None)]
    for name, grammar, text in [
        ("json_schema", llguidance.LLMatcher.grammar_from_json_schema(SCHEMA), TEXT_JSON),
        ("regex", llguidance.LLMatcher.grammar_from_regex(REGEX), TEXT_REGEX),
        ("grammar", llguidance.LLMatcher.grammar_from_lark(LARK), TEXT_GRAMMAR),
    ]:
        matcher, t_compile = timed(lambda g=grammar: llguidance.LLMatcher(tok, g, log_level=0))
        assert not matcher.is_error(), matcher.get_error()
        ids = tok.tokenize_str(text)
        rows.append(
            (name, t_compile, *mask_times(ids, matcher.compute_bitmask, matcher.consume_token))
        )
    return rows


def run_xgrammar() -> list[tuple]:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(MODEL / "tokenizer.json"))
    info, t_tok = timed(lambda: xgr.TokenizerInfo.from_huggingface(hf, vocab_size=49152))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    rows = [("tokenizer", t_tok, None, None)]
    for name, compile_fn, text in [
        ("json_schema", lambda: compiler.compile_json_schema(json.dumps(SCHEMA)), TEXT_JSON),
        ("regex", lambda: compiler.compile_regex(REGEX), TEXT_REGEX),
        ("grammar", lambda: compiler.compile_grammar(GBNF), TEXT_GRAMMAR),
    ]:
        compiled, t_compile = timed(compile_fn)
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
        ids = hf.encode(text, add_special_tokens=False)
        fill = lambda m=matcher: m.fill_next_token_bitmask(bitmask)  # noqa: E731
        rows.append((name, t_compile, *mask_times(ids, fill, matcher.accept_token)))
    return rows


def main(backend: str) -> None:
    _, t_import = timed(lambda: importlib.import_module(backend))
    print(f"{backend}: import {t_import:.0f} ms")
    for name, compile_ms, med, worst in (
        run_llguidance() if backend == "llguidance" else run_xgrammar()
    ):
        extra = "" if med is None else f"  mask per step median {med:.3f} ms, max {worst:.3f} ms"
        print(f"  {name:12s} compile {compile_ms:8.1f} ms{extra}")


if __name__ == "__main__":
    main(sys.argv[1])
