"""Chapter 11 · quantization and dtype: what shrinking the numbers buys (bytes read per decode
step, measured step time) and what it costs (agreement with float32, perplexity, visible loss)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pandas as pd

from ui.experiments.common import RequestSpec, RunResult, Workload, _r

# label → EngineConfig overrides of one side of the lab
VARIANTS: dict[str, dict] = {
    "float32": {"dtype": "float32", "quantization": None},
    "bfloat16": {"dtype": "bfloat16", "quantization": None},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "int4": {"dtype": "float32", "quantization": "int4"},
    "gguf (Q4_1)": {"dtype": "float32", "quantization": "gguf"},
}
DEFAULT_SIDES = ("float32", "int8", "int4")
# The lab's default workload: one 32-token prompt, 24 greedy tokens (batch 1 is what
# weight-only quantization is for).
DEFAULT_PROMPT_LEN, DEFAULT_MAX_TOKENS, DEFAULT_BATCH = 32, 24, 1


def decode_workload(
    prompt_len: int = DEFAULT_PROMPT_LEN,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    batch: int = DEFAULT_BATCH,
) -> Workload:
    """`batch` requests arriving together: batch 1 is the case quantization is for."""
    return Workload([RequestSpec(prompt_len, max_tokens, 0.0, f"요청-{i}") for i in range(batch)])


# ---------------------------------------------------------------------------------------------
# Bytes (computed from the model's shapes)


def _matrices(cfg) -> list[tuple[str, int, int]]:
    """(name, out, in) of every matrix one decode step multiplies (per layer × layers, lm_head)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = [
        ("qkv", q + 2 * kv, cfg.hidden_size),
        ("o", cfg.hidden_size, q),
        ("gate_up", 2 * cfg.intermediate_size, cfg.hidden_size),
        ("down", cfg.hidden_size, cfg.intermediate_size),
    ]
    return [m for m in layer for _ in range(cfg.num_layers)] + [
        ("lm_head", cfg.vocab_size, cfg.hidden_size)
    ]


def format_bytes(out: int, inp: int, fmt: str, group: int = 32) -> int:
    """Stored bytes of one [out, in] matrix: float32 4/weight, bfloat16 2, int8 1 + a float32
    scale per row, int4 ½ + a float32 scale and min per group."""
    n = out * inp
    if fmt == "float32":
        return 4 * n
    if fmt == "bfloat16":
        return 2 * n
    if fmt == "int8":
        return n + 4 * out
    return n // 2 + 8 * out * (inp // group)


def bytes_table(cfg, group: int = 32) -> pd.DataFrame:
    """Per format: bits per weight and the weight bytes a batch-1 decode step reads. Quantized
    engines keep lm_head in int8 (engine/worker/quantization.py), so their total mixes two
    formats."""
    mats = _matrices(cfg)
    rows, totals = [], []
    for label, linear_fmt, head_fmt in (
        ("float32", "float32", "float32"),
        ("bfloat16", "bfloat16", "bfloat16"),
        ("int8", "int8", "int8"),
        (f"int4 (그룹 {group})", "int4", "int8"),
    ):
        linears = sum(format_bytes(o, i, linear_fmt, group) for n, o, i in mats if n != "lm_head")
        head = sum(format_bytes(o, i, head_fmt, group) for n, o, i in mats if n == "lm_head")
        params = sum(o * i for n, o, i in mats if n != "lm_head")
        totals.append(linears + head)
        rows.append(
            {
                "형식": label,
                "선형층 비트/가중치": round(8 * linears / params, 2),
                "선형층 (MB)": round(linears / 1e6, 3),
                "lm_head (MB)": round(head / 1e6, 3),
                "decode 스텝당 읽는 가중치 (MB)": round((linears + head) / 1e6, 3),
            }
        )
    df = pd.DataFrame(rows)
    df["float32 대비"] = [round(t / totals[0], 3) for t in totals]
    return df


# ---------------------------------------------------------------------------------------------
# What the lab's runs measured


def decode_summary(runs: dict[str, RunResult], weight_bytes: dict[str, int]) -> pd.DataFrame:
    """Per side: measured median decode-step time (steps that only decode), tokens/s of the whole
    run, weight bytes the engine holds, and GB/s = bytes per step ÷ step time (computed)."""
    rows = []
    base_ms = None
    for label, res in runs.items():
        steps = res.step_table()
        decode = steps[(steps["kind"] == "decode")] if len(steps) else steps
        ms = statistics.median(decode["duration_ms"]) if len(decode) else None
        if base_ms is None:
            base_ms = ms
        wb = weight_bytes.get(label)
        rows.append(
            {
                "엔진": label,
                "가중치 (MB)": _r(wb / 1e6, 3) if wb else None,
                "decode 스텝 중앙값 (ms)": _r(ms, 2),
                "첫 엔진 대비 속도": _r(base_ms / ms, 2) if ms and base_ms else None,
                "가중치 읽기 속도 (GB/s)": _r(wb / (ms / 1e3) / 1e9, 2) if wb and ms else None,
                "출력 토큰/s": _r(res.throughput),
                "decode 스텝 수": int(len(decode)),
            }
        )
    return pd.DataFrame(rows)


def greedy_agreement_table(runs: dict[str, RunResult]) -> pd.DataFrame:
    """Each side's greedy tokens against the first side's (usually float32): share of positions
    with the same token, and where the texts first part."""
    from engine.tools.quality import greedy_agreement

    labels = list(runs)
    ref = [list(r.output_token_ids) for r in runs[labels[0]].requests]
    rows = []
    for label in labels:
        ours = [list(r.output_token_ids) for r in runs[label].requests]
        g = greedy_agreement(ref, ours)
        first = [f for f in g["first_divergence"] if f is not None]
        rows.append(
            {
                "엔진": label,
                f"{labels[0]}와 같은 토큰 비율": _r(100 * (g["token_agreement"] or 0), 1),
                "처음 달라진 위치": str(min(first)) if first else "끝까지 같음",
            }
        )
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------
# Why the lab's agreement numbers come out as they do


# (label, quantization, group) of the formats whose weights the explanation compares with float32
GRIDS = (("int8 (행마다 scale)", "int8", 32), ("int4 (그룹 32)", "int4", 32))


@lru_cache(maxsize=4)
def _grid_fit_rows(model_dir: str) -> tuple[dict, ...]:
    """Per format: the linear matrices the quantized engine holds (the process's shared copy,
    engine/worker/quantization.py), unpacked and compared with the float32 engine's: the largest
    difference and the share of weights that came back bit for bit. Cached per process: the
    weights never change and the check reads 106 M numbers."""
    import torch

    from engine.kernels.quant import dequantize
    from engine.worker.quantization import LINEAR_NAMES
    from engine.worker.worker import load_model, load_quantized_model

    cpu, f32 = torch.device("cpu"), torch.float32
    base = load_model(model_dir, cpu, f32)
    keys = [f"{i}.{n}" for i in range(base.cfg.num_layers) for n in LINEAR_NAMES]
    rows = []
    for label, method, group in GRIDS:
        quantized = load_quantized_model(model_dir, cpu, f32, method, group)
        worst, same, total = 0.0, 0, 0
        for key in keys:
            w, back = base.w[key], dequantize(quantized.w[key]).float()
            worst = max(worst, float((back - w).abs().max()))
            same += int((back == w).sum())
            total += w.numel()
        rows.append(
            {"형식": label, "최대 절대 오차": worst, "그대로인 가중치 (%)": 100 * same / total}
        )
    return tuple(rows)


def grid_fit_table(model_dir) -> pd.DataFrame:
    """계산값: how far each quantized engine's linears lie from float32's (0 = the same)."""
    return pd.DataFrame(list(_grid_fit_rows(str(Path(model_dir).resolve()))))


def reproduces_exactly(fit: pd.DataFrame, label: str) -> bool:
    row = fit[fit["형식"] == label]
    return bool(len(row)) and float(row["최대 절대 오차"].iloc[0]) == 0.0


@dataclass
class TieReport:
    """float32's own margins along the reference run's tokens, and where each side parted."""

    margins: list[float]  # float32's top-1 minus top-2 logit at every generated position
    table: pd.DataFrame  # one row per side that parted from the reference

    @property
    def near_ties(self) -> int:
        from engine.tools.quality import TIE_MARGIN

        return sum(m < TIE_MARGIN for m in self.margins)


def _reference_margins(model, request) -> tuple[list[float], list[int]]:
    """Teacher-forced float32 logits along prompt + the reference's output: at each generated
    position, top-1 minus top-2 logit and the runner-up token."""
    from engine.tools.quality import teacher_forced_logits

    prompt, out = list(request.prompt_token_ids), list(request.output_token_ids)
    logits = teacher_forced_logits(model, prompt + out)[
        len(prompt) - 1 : len(prompt) - 1 + len(out)
    ]
    top2 = logits.topk(2, dim=-1)
    margins = (top2.values[:, 0] - top2.values[:, 1]).tolist()
    return margins, top2.indices[:, 1].tolist()


def tie_report(model_dir, runs: dict[str, RunResult]) -> TieReport:
    """측정값: float32's top-1/top-2 logit margin at every position of the first side's greedy
    tokens (teacher forced through the float32 model), and for each other side the first position
    it wrote another token, float32's margin there and whether it wrote float32's runner-up."""
    import torch

    from engine.worker.worker import load_model

    labels = list(runs)
    model = load_model(model_dir, torch.device("cpu"), torch.float32)
    per_request = [_reference_margins(model, r) for r in runs[labels[0]].requests]
    rows = []
    for label in labels[1:]:
        for i, (ref, ours) in enumerate(zip(runs[labels[0]].requests, runs[label].requests)):
            a, b = list(ref.output_token_ids), list(ours.output_token_ids)
            pos = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), None)
            if pos is None:
                continue
            margins, runners = per_request[i]
            rows.append(
                {
                    "엔진": label,
                    "요청": ref.request_id,
                    "처음 달라진 위치": pos,
                    "그 위치의 float32 1·2순위 로짓 차": round(margins[pos], 3),
                    "float32의 2순위를 골랐나": "예" if b[pos] == runners[pos] else "아니오",
                }
            )
    margins = [m for ms, _ in per_request for m in ms]
    columns = ["엔진", "요청", "처음 달라진 위치", "그 위치의 float32 1·2순위 로짓 차"]
    return TieReport(margins, pd.DataFrame(rows, columns=columns + ["float32의 2순위를 골랐나"]))


def agreement_explanation(fit: pd.DataFrame, ties: TieReport) -> list[str]:
    """The reasons behind the agreement table, in Korean, each stated only when the numbers
    above it (fit: 계산값, ties: 측정값) show it."""
    from engine.tools.quality import TIE_MARGIN

    out = []
    int8 = fit[fit["형식"] == GRIDS[0][0]]
    if reproduces_exactly(fit, GRIDS[1][0]):
        out.append(
            "이 모델의 float32 가중치는 처음부터 4비트 격자 위에 있습니다. 아티팩트가 GGUF의 "
            "Q4_1(32개 묶음마다 scale과 min)을 펼쳐 만든 것이라, int4(그룹 32) 엔진의 선형층 "
            "가중치는 float32와 하나도 다르지 않습니다(최대 절대 오차 0). int4 엔진이 float32와 "
            "다른 것은 lm_head(양자화 엔진은 둘 다 int8)와 더하는 순서뿐이라, 대개 같은 토큰을 "
            "씁니다. int4가 int8보다 좋은 형식이라서가 아닙니다."
        )
    if len(int8) and float(int8["최대 절대 오차"].iloc[0]) > 0:
        out.append(
            f"int8(행마다 scale)은 그 격자를 모르는 다른 눈금이라, 선형층 가중치의 "
            f"{float(int8['그대로인 가중치 (%)'].iloc[0]):.1f}%만 그대로 두고 나머지를 최대 "
            f"{float(int8['최대 절대 오차'].iloc[0]):.3g}만큼 옮깁니다."
        )
    if ties.margins:
        out.append(
            f"135M 모델은 자주 망설입니다: float32 자신도 이 실행의 {len(ties.margins)}개 위치 "
            f"가운데 {ties.near_ties}곳에서 1순위와 2순위 로짓 차가 {TIE_MARGIN}보다 작았습니다"
            "(동점에 가까운 위치)."
        )
    for row in ties.table.to_dict("records"):
        margin = row["그 위치의 float32 1·2순위 로짓 차"]
        near = "동점에 가까운 곳" if margin < TIE_MARGIN else "동점이 아닌 곳"
        runner = (
            " float32의 2순위 토큰을 골랐습니다." if row["float32의 2순위를 골랐나"] == "예" else ""
        )
        out.append(
            f"{row['엔진']}는 {row['요청']}의 위치 {row['처음 달라진 위치']}에서 처음 달라졌고, "
            f"그곳의 float32 로짓 차는 {margin}로 {near}입니다.{runner} 한 번 다른 토큰을 쓰면 "
            "그 뒤 문장은 다른 길을 가므로, 같은 토큰 비율은 그 위치에서부터 크게 떨어집니다."
        )
    if len(ties.table) > 0:
        out.append(
            "그러니 이 표의 비율은 형식의 품질보다 '처음 갈라진 동점이 어디였나'를 더 많이 "
            "말합니다. 품질은 아래의 teacher forcing 측정(위치마다 따로 비교)으로 읽으세요."
        )
    return out


# ---------------------------------------------------------------------------------------------
# Quality beyond one run, and where quantization visibly loses


def quality_table(model_dir, variant_names: list[str], text_tokens: int = 128) -> pd.DataFrame:
    """Teacher-forced on README.md: top-1 agreement with float32, perplexity, mean KL
    (engine/tools/quality.py; greedy generation left to the lab's own runs)."""
    from engine.tools import quality

    result = quality.evaluate(
        model_dir,
        [quality.Variant.parse(v) for v in variant_names],
        text_tokens=text_tokens,
        greedy=False,
    )
    return pd.DataFrame(
        [
            {
                "변형": r["variant"],
                "스텝당 가중치 (MB)": round(r["weight_bytes_per_step"] / 1e6, 1),
                "top-1 일치 (%)": round(100 * r["top1_agreement"], 1),
                "동점 제외 일치 (%)": round(100 * r["top1_agreement_outside_ties"], 1),
                "동점에 가까운 위치": r["near_ties"],
                "perplexity": round(r["perplexity"], 2),
                "KL 평균": round(r["kl_mean"], 4),
            }
            for r in result["rows"]
        ]
    )


def outlier_table(seed: int = 0) -> pd.DataFrame:
    """engine.tools.quality.outlier_demo as a table: RMS rounding error of ordinary weights."""
    from engine.tools.quality import outlier_demo

    d = outlier_demo(seed=seed)
    rows = []
    for fmt in ("int8", "int4/32"):
        e = d[fmt]
        rows.append(
            {
                "형식": "int8 (행마다 scale)" if fmt == "int8" else "int4 (32개 묶음마다)",
                "비트/가중치": round(e["bits_per_weight"], 2),
                "이상치 없는 행": f"{e['rms_clean_rows']:.2e}",
                "이상치 행, 같은 묶음": f"{e['rms_near_outlier']:.2e}",
                "이상치 행, 먼 곳": f"{e['rms_far_from_outlier']:.2e}",
            }
        )
    return pd.DataFrame(rows)


def kernel_rows(results: dict | None) -> pd.DataFrame | None:
    """The bench's kernel table (section 6) if a full bench ran: ms at 1 row and 32 rows."""
    lin = ((results or {}).get("kernels") or {}).get("linear")
    if not lin:
        return None
    return pd.DataFrame(
        [
            {
                "커널": name,
                "가중치 (MB)": round(e["weight_bytes"] / 1e6, 1),
                "1행 (ms)": round(e["ms_1"], 2),
                "1행 GB/s": round(e["gb_s_1"], 1),
                "32행 (ms)": round(e["ms_32"], 2),
                "32행 GFLOP/s": round(e["gflop_s_32"], 1),
            }
            for name, e in lin["kernels"].items()
        ]
    )


def _peer_setting(peer: dict) -> str:
    """Which llama.cpp ran, when it was not its default (its extra buffers crashed it on
    prompts longer than one token: engine/tools/peers/llama_cpp.py)."""
    if peer.get("extra_buffers") is False:
        return " · AMX 등 확장 버퍼 없이"
    if peer.get("prompt_lengths") == [1]:
        return " · AMX 등 확장 버퍼, 1토큰 프롬프트"
    return ""


def peer_rows(results: dict | None) -> pd.DataFrame | None:
    """Batch-1 decode of the bench's section 10 (each dtype / quantization of the engine) next to
    llama.cpp on the same GGUF file, if that run had the peer; else None."""
    results = results or {}
    peer, variants = results.get("llama_cpp") or {}, (results.get("variants") or {}).get("rows")
    if not variants or "decode_tokens_per_s" not in peer:
        return None
    base = peer["decode_tokens_per_s"]
    rows = [
        {
            "엔진": f"우리 엔진 · {v['name']}",
            "스텝당 MB": round(v["weight_bytes_per_step"] / 1e6, 1),
            "decode 토큰/s": round(v["decode_tokens_per_s"], 1),
            "스텝 ms": round(v.get("decode_step_ms", 1e3 / v["decode_tokens_per_s"]), 2),
            "÷ llama.cpp": round(v["decode_tokens_per_s"] / base, 2),
        }
        for v in variants
        if "decode_tokens_per_s" in v  # a row the run could not measure has no speed
    ]
    rows.append(
        {
            "엔진": f"llama.cpp {peer.get('version', '')} · Q4_1" + _peer_setting(peer),
            "스텝당 MB": None,
            "decode 토큰/s": round(base, 1),
            "스텝 ms": round(peer.get("decode_step_ms", 1e3 / base), 2),
            "÷ llama.cpp": 1.0,
        }
    )
    return pd.DataFrame(rows)
