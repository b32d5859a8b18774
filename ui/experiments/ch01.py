"""Chapter 01 · 학습된 모델에서 추론 서버까지: the parameter count from config.json alone, and one
streamed HTTP request to the in-process API server (no Streamlit here)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

HTTP_PROMPT = "안녕하세요! 한 문장으로 인사해 주세요."  # the lab's default message
HTTP_MAX_TOKENS = 16

# The journey a served request leaves, in order (engine/request.py events; tokens repeat).
JOURNEY_ORDER = ["arrival", "tokenized", "queued", "scheduled", "first_token", "finished"]


def derived_param_count(c: dict) -> dict[str, int]:
    """Parameters from config.json alone (matrix shapes multiplied and summed)."""
    h, i, v, L = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    nh = c["num_attention_heads"]
    nkv = c.get("num_key_value_heads", nh)
    hd = c.get("head_dim") or h // nh
    emb = v * h * (1 if c.get("tie_word_embeddings") else 2)
    attn = L * (h * nh * hd + 2 * h * nkv * hd + nh * hd * h)
    mlp = L * 3 * h * i
    norm = L * 2 * h + h
    return {"embedding": emb, "attention": attn, "mlp": mlp, "norm": norm}


@dataclass
class HttpResult:
    """What the client saw: the status, every SSE `data:` line with its arrival time."""

    status: int
    chunks: list[dict] = field(default_factory=list)  # {"t": perf_counter, "data": str}
    start: float = 0.0
    body: dict = field(default_factory=dict)

    def payloads(self) -> list[dict]:
        return [json.loads(c["data"]) for c in self.chunks if c["data"] != "[DONE]"]

    @property
    def request_id(self) -> str | None:
        return next((p.get("id") for p in self.payloads() if p.get("id")), None)

    @property
    def text(self) -> str:
        """The streamed deltas joined (what a chat client prints)."""
        return "".join(
            (p.get("choices") or [{}])[0].get("delta", {}).get("content", "") or ""
            for p in self.payloads()
            if p.get("choices")
        )


def send_http_request(url: str, prompt: str, max_tokens: int) -> HttpResult:
    """POST /v1/chat/completions with stream=True; every SSE chunk is kept with its arrival time."""
    import httpx

    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
    }
    result = HttpResult(status=0, start=time.perf_counter(), body=body)
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            result.status = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: "):
                    result.chunks.append({"t": time.perf_counter(), "data": line[len("data: ") :]})
    return result


def journey_in_order(kinds: list[str]) -> bool:
    """Whether the journey's events include JOURNEY_ORDER's stages, each after the one before."""
    position = 0
    for kind in kinds:
        if position < len(JOURNEY_ORDER) and kind == JOURNEY_ORDER[position]:
            position += 1
    return position == len(JOURNEY_ORDER)
