"""Chapter 12 · executor and workers: the same workload on tp 1, tp N and pp M worker layouts.

Plain functions returning data (no Streamlit): what each worker holds (shard shapes, bytes),
per step and per rank compute vs communication (measured in the workers), the all-reduce count
per step measured beside the derived 2 per layer, and the speed-up against tp 1 measured on this
machine (where the workers share the same CPU cores, so it is no "N devices = N× faster").
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from engine.core import EngineCore
from ui.experiments.common import ConfigLike, RunResult, Workload, _r, make_config, run_workload

MB = 1e6
# The lab's default workload: 2 requests of 32 prompt tokens, 12 greedy output tokens each, on
# tp 1 beside tp 3 (the default model's 9 query / 3 KV heads divide by 3).
PROMPT_LEN, DEFAULT_REQUESTS, DEFAULT_OUT, DEFAULT_TP = 32, 2, 12, 3


def lab_workload(num: int = DEFAULT_REQUESTS, out: int = DEFAULT_OUT) -> Workload:
    return Workload.uniform(num, PROMPT_LEN, out)


def shard_table(layout: list[dict]) -> pd.DataFrame:
    """One row per rank: which layers and heads it holds, the shapes of its first layer's
    matrices, and its bytes (from executor.layout(), measured on the workers' tensors)."""
    rows = []
    for r in layout:
        shapes = r["shapes"]
        rows.append(
            {
                "rank": r["rank"],
                "tp rank": r["tp_rank"],
                "pp stage": r["pp_rank"],
                "층": f"{r['layers'][0]}–{r['layers'][1] - 1}",
                "query 헤드": f"{r['q_heads'][0]}–{r['q_heads'][1] - 1}",
                "KV 헤드": f"{r['kv_heads'][0]}–{r['kv_heads'][1] - 1}",
                **{k: " × ".join(map(str, shapes[k])) for k in ("qkv", "o", "gate_up", "down")},
                "가중치 (MB)": _r(r["weight_bytes"] / MB, 2),
                "중복 보관 (MB)": _r(r["replicated_bytes"] / MB, 2),
                "KV 캐시 (MB)": None
                if r.get("kv_cache_bytes") is None
                else _r(r["kv_cache_bytes"] / MB, 2),
            }
        )
    return pd.DataFrame(rows)


def communication_table(records) -> pd.DataFrame:
    """One row per (step that ran a forward, rank): compute vs communication, measured."""
    rows = [
        {
            "step": rec.step,
            "rank": w["rank"],
            "num_tokens": rec.total_tokens,
            "compute_ms": 1000 * w["compute_s"],
            "comm_ms": 1000 * w["comm_s"],
            "all_reduce_count": w["all_reduce_count"],
            "all_reduce_kb": w["all_reduce_bytes"] / 1e3,
            "p2p_kb": w["p2p_bytes"] / 1e3,
        }
        for rec in records
        if rec.scheduled
        for w in rec.workers
    ]
    columns = ["step", "rank", "num_tokens", "compute_ms", "comm_ms", "all_reduce_count"]
    return pd.DataFrame(rows, columns=columns + ["all_reduce_kb", "p2p_kb"])


@dataclass
class ParallelRun:
    tp: int
    pp: int
    result: RunResult
    layout: list[dict]  # empty for tp 1 × pp 1 (one worker in the engine's process)
    tokens: dict[str, list[int]]
    simulated: bool = False  # engine/tools/simulator.py: layout and worker times computed


@dataclass
class ParallelComparison:
    runs: dict[str, ParallelRun]
    summary: pd.DataFrame


def warm_up(engine: EngineCore) -> None:
    """One short request before measuring: the first steps of a process pay one-off costs
    (weights paged in, kernels' first calls); measured here, a cold tp 1 run took twice as long
    as a warm one on the same requests."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request(prompt_token_ids=[5] * 16, sampling_params=params, request_id="warm-up")
    while engine.has_unfinished_requests():
        engine.step()


def run_layout(
    config: ConfigLike | None, workload: Workload, tp: int, pp: int, warm: bool = True
) -> ParallelRun:
    """Run the workload on tp × pp workers (after a warm-up request, unless `warm` is False);
    the worker processes are stopped before returning."""
    engines: list[EngineCore] = []

    def factory(cfg):
        engines.append(EngineCore(cfg))
        if warm:
            warm_up(engines[-1])
        return engines[-1]

    cfg = make_config(config, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    label = f"tp {tp} × pp {pp}"
    try:
        result = run_workload(cfg, workload, label, engine_factory=factory)
        executor = engines[0].executor
        layout = executor.layout() if hasattr(executor, "layout") else []
    finally:
        for engine in engines:
            engine.shutdown()
    tokens = {name: r.output_token_ids for name, r in zip(workload.names(), result.requests)}
    return ParallelRun(tp, pp, result, layout, tokens)


def compare_layouts(
    config: ConfigLike | None, workload: Workload, sizes=((1, 1), (3, 1), (1, 2))
) -> ParallelComparison:
    """The same workload on each (tp, pp); the first size is the baseline of the speed ratio."""
    runs = {}
    for tp, pp in sizes:
        run = run_layout(config, workload, tp, pp)
        runs[run.result.label] = run
    return ParallelComparison(runs, parallel_summary(runs))


def base_names(runs: dict[str, ParallelRun]) -> tuple[str, str]:
    """Column names of the speed ratio and the same-output check: against "tp 1" when the first
    run is tp 1 × pp 1, else against "기준" (the first run, e.g. a simulated tp 4)."""
    base = next(iter(runs.values()))
    if base.tp * base.pp == 1:
        return "tp 1 대비 속도", "tp 1과 같은 출력"
    return "기준 대비 속도", "기준과 같은 출력"


def parallel_summary(runs: dict[str, ParallelRun]) -> pd.DataFrame:
    """One row per run. For simulated runs the all-reduce count is computed (계산) and the
    same-output column is left out (a simulated sampler's tokens are placeholders)."""
    base = next(iter(runs.values()))
    speed_name, same_name = base_names(runs)
    count_name = "스텝당 all-reduce " + ("(계산)" if base.simulated else "(측정)")
    rows = []
    for label, run in runs.items():
        res = run.result
        comm = communication_table(res.records)
        steps = comm[comm["rank"] == 0]
        compute, spent = comm["compute_ms"].sum(), comm["comm_ms"].sum()
        rows.append(
            {
                "실행": label,
                "워커 수": run.tp * run.pp,
                "벽시계 시간 (s)": _r(res.wall_s, 2),
                "출력 토큰/s": _r(res.output_tokens / res.wall_s if res.wall_s else 0.0),
                speed_name: _r(base.result.wall_s / res.wall_s, 2) if res.wall_s else None,
                "통신 비율 (%)": _r(100 * spent / (compute + spent)) if compute + spent else None,
                count_name: _r(steps["all_reduce_count"].mean()) if len(steps) else 0,
                "가중치 합 (MB)": _r(sum(r["weight_bytes"] for r in run.layout) / MB, 2)
                if run.layout
                else None,
                same_name: run.tokens == base.tokens,
            }
        )
    table = pd.DataFrame(rows)
    return table.drop(columns=[same_name]) if base.simulated else table


def _meta_weights(cfg, dtype) -> dict:
    """The full model's weight dict (LlamaModel's names) as meta tensors: shapes and dtype, no
    memory, so the engine's own shard_weights can cut it without loading a byte."""
    import torch

    def t(*shape):
        return torch.empty(shape, dtype=dtype, device="meta")

    q_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    w = {"embed": t(cfg.vocab_size, cfg.hidden_size)}
    for i in range(cfg.num_layers):
        w[f"{i}.input_norm"] = t(cfg.hidden_size)
        w[f"{i}.qkv"] = t(q_rows, cfg.hidden_size)
        if cfg.attention_bias:
            w[f"{i}.qkv_bias"] = t(q_rows)
        w[f"{i}.o"] = t(cfg.hidden_size, cfg.num_heads * cfg.head_dim)
        w[f"{i}.post_norm"] = t(cfg.hidden_size)
        w[f"{i}.gate_up"] = t(2 * cfg.intermediate_size, cfg.hidden_size)
        w[f"{i}.down"] = t(cfg.hidden_size, cfg.intermediate_size)
    w["final_norm"] = t(cfg.hidden_size)
    w["lm_head"] = w["embed"] if cfg.tie_word_embeddings else t(cfg.vocab_size, cfg.hidden_size)
    return w


def _nbytes(tensors) -> int:
    """Bytes of distinct tensors (a tied lm_head is the embedding's tensor: counted once)."""
    distinct = {id(t): t for t in tensors}.values()
    return sum(t.numel() * t.element_size() for t in distinct)


def planned_layout(model_config, tp: int, pp: int, dtype=None) -> list[dict]:
    """계산값: what each of the tp × pp workers will hold, before any worker starts: the engine's
    own shard_weights (engine/models/llama.py) applied to meta tensors of the model's
    shapes. The same fields as executor.layout() (KV-cache bytes: None, decided at start-up), so
    the page draws the same figure and table; a test checks it against the workers' own count."""
    import torch

    from engine.layers.sharding import head_ranges, mlp_range, stage_layers
    from engine.models.llama import shard_weights

    dtype = dtype or torch.float32
    full = _meta_weights(model_config, dtype)
    rows = []
    for rank in range(tp * pp):
        tp_rank, pp_rank = rank % tp, rank // tp
        local, w = shard_weights(model_config, full, tp, tp_rank, pp, pp_rank)
        shared = [t for n, t in w.items() if tp > 1 and (n in ("embed", "lm_head") or "norm" in n)]
        replicated = _nbytes(shared)
        if tp > model_config.num_kv_heads:  # this rank's K and V rows live on other ranks too
            kv_rows = 2 * local.num_kv_heads * local.head_dim
            qkv = [t for n, t in w.items() if n.endswith(".qkv") or n.endswith(".qkv_bias")]
            replicated += sum(kv_rows * (t.numel() // t.shape[0]) * t.element_size() for t in qkv)
        layers = stage_layers(model_config.num_layers, pp)[pp_rank]
        q, kv = head_ranges(model_config, tp, tp_rank)
        inter = mlp_range(model_config, tp, tp_rank)
        rows.append(
            {
                "rank": rank,
                "tp_rank": tp_rank,
                "pp_rank": pp_rank,
                "layers": [layers.start, layers.stop],
                "q_heads": [q.start, q.stop],
                "kv_heads": [kv.start, kv.stop],
                "mlp_columns": [inter.start, inter.stop],
                "holds_embedding": "embed" in w,
                "holds_lm_head": "lm_head" in w,
                "weight_bytes": _nbytes(w.values()),
                "replicated_bytes": replicated,
                "shapes": {
                    n.split(".", 1)[-1]: list(t.shape)
                    for n, t in w.items()
                    if n.startswith("0.") or n in ("embed", "lm_head")
                },
                "kv_cache_bytes": None,
            }
        )
    return rows


# -- for the page's lab (runs stepped by ui/lab.py, not by run_layout) -------------------------

# Which way each matrix is cut (Megatron-LM's split): column-parallel matrices are cut along their
# output features, row-parallel ones along their input features.
MATRICES = {
    "qkv": ("열 분할 (column-parallel)", "out"),
    "o": ("행 분할 (row-parallel)", "in"),
    "gate_up": ("열 분할 (column-parallel)", "out"),
    "down": ("행 분할 (row-parallel)", "in"),
}


def full_shapes(model_config) -> dict[str, tuple[int, int]]:
    """The whole first-layer matrices as PyTorch stores them: [output features, input features]."""
    c = model_config
    return {
        "qkv": ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size),
        "o": (c.hidden_size, c.num_heads * c.head_dim),
        "gate_up": (2 * c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
    }


def matrix_cuts(model_config, layout: list[dict]) -> pd.DataFrame:
    """One row per (matrix, tp rank of the first stage): the piece that rank holds, cut from the
    whole matrix along the output (column-parallel) or input (row-parallel) features. The shard
    shapes are the workers' own tensors (layout()); tp 1 (empty layout) holds the whole matrix."""
    full = full_shapes(model_config)
    stage = [r for r in layout if r["pp_rank"] == 0] or [
        {"tp_rank": 0, "shapes": {k: list(v) for k, v in full.items()}}
    ]
    rows = []
    for name, (kind, axis) in MATRICES.items():
        start = 0
        for r in sorted(stage, key=lambda r: r["tp_rank"]):
            out_f, in_f = r["shapes"][name]
            size = out_f if axis == "out" else in_f
            rows.append(
                {
                    "행렬": name,
                    "분할": kind,
                    "tp rank": r["tp_rank"],
                    "전체 모양": " × ".join(map(str, full[name])),
                    "조각 모양": f"{out_f} × {in_f}",
                    "자른 축": "출력" if axis == "out" else "입력",
                    "시작": start,
                    "크기": size,
                    "전체 출력": full[name][0],
                    "전체 입력": full[name][1],
                }
            )
            start += size
    return pd.DataFrame(rows)


def steady_step_ms(result: RunResult) -> float | None:
    """Median duration (ms) of the decode-only steps after the first two steps of the run (the
    first steps pay one-off costs); None when there are none."""
    steps = result.step_table()
    if steps.empty:
        return None
    decode = steps[(steps["kind"] == "decode") & (steps.index >= 2)]
    return float(decode["duration_ms"].median()) if len(decode) else None


def lab_run(result: RunResult, engine: EngineCore) -> ParallelRun:
    """A ParallelRun from a lab side's finished workload (its engine still running, for layout)."""
    from ui.experiments.common import is_simulated

    cfg = engine.config
    executor = engine.executor
    layout = executor.layout() if hasattr(executor, "layout") else []
    tokens = {r.request_id: list(r.output_token_ids) for r in result.requests}
    return ParallelRun(
        cfg.tensor_parallel_size,
        cfg.pipeline_parallel_size,
        result,
        layout,
        tokens,
        simulated=is_simulated(engine),
    )


def lab_comparison(runs: dict[str, ParallelRun]) -> ParallelComparison:
    """parallel_summary for runs stepped in lockstep by the lab: one engine's wall clock there
    spans the other engines' steps too, so its time columns are replaced by the sum of its own
    step times and the median decode step (the first run is the base of the ratio)."""
    speed_name, _ = base_names(runs)
    summary = parallel_summary(runs).drop(columns=["벽시계 시간 (s)", "출력 토큰/s", speed_name])
    medians = [steady_step_ms(run.result) for run in runs.values()]
    base = medians[0]
    # a simulated step time is computed to the microsecond: more digits than a measured one
    simulated = next(iter(runs.values())).simulated
    digits = 3 if simulated else 1
    summary.insert(2, "스텝 시간 합 (s)", [
        _r(sum(r.engine_duration for r in run.result.records), 4 if simulated else 2)
        for run in runs.values()
    ])  # fmt: skip
    summary.insert(3, "decode 스텝 중앙값 (ms)", [_r(m, digits) if m else None for m in medians])
    summary.insert(4, f"{speed_name} (decode)", [
        _r(base / m, 2) if base and m else None for m in medians
    ])  # fmt: skip
    return ParallelComparison(runs, summary)


SPEED_CHOICES = ["워커 수만큼 빨라진다", "조금 빨라진다", "비슷하거나 느려진다"]


def speed_verdict(speedup: float, workers: int) -> str:
    """Which SPEED_CHOICES a measured (or, simulated, computed) speed-up (base time / this time)
    is, for `workers` times the base's workers: "as many times" only within 10 % of it (the
    simulated 70B on 8 GPUs vs 4, 1.66×, is not "twice")."""
    if speedup >= 0.9 * workers:
        return SPEED_CHOICES[0]
    if speedup >= 1.15:
        return SPEED_CHOICES[1]
    return SPEED_CHOICES[2]


# -- at scale: the same views on a simulated GPU cluster (engine/tools/simulator.py) ------------


def parallel_conditions(engine) -> dict:
    """The 계산값 conditions of a simulated engine (ui/experiments/common.py's), with the GPU
    count as tp × pp when the engine is pipeline parallel."""
    from ui.experiments.common import simulated_conditions

    cond = simulated_conditions(engine)
    ex = engine.executor
    if getattr(ex, "pp", 1) > 1:
        hw = ex.hardware
        cond["하드웨어"] = f"{hw.name} × {ex.tp * ex.pp} (tp {ex.tp} × pp {ex.pp}, {hw.evidence})"
    return cond


def simulated_sizes(tp: int) -> list[tuple[int, int]]:
    """The layouts a simulated lab compares for `tp` GPUs: half as many GPUs as tp (the base),
    all of them as tp, and (optional third side) all of them as tp/2 × pp 2. One GPU: nothing to
    compare (an empty list)."""
    if tp < 2:
        return []
    return [(tp // 2, 1), (tp, 1), (tp // 2, 2)]


def simulated_fit_error(
    model_preset: str,
    hardware: str,
    tp: int,
    pp: int,
    max_model_len: int,
    block_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    utilization: float | None = None,
) -> str | None:
    """Why this preset cannot be simulated on tp × pp GPUs of this hardware (None: it can):
    a size that does not divide the model, weights that do not fit, or a KV cache too small for
    one request of max_model_len (chapter 05's budget, engine/tools/simulator.py's plan_memory)."""
    from engine.config import DEFAULT_GPU_MEMORY_UTILIZATION
    from engine.layers.sharding import valid_tensor_parallel_sizes
    from engine.tools.presets import PresetError, load_hardware_preset, load_model_preset
    from engine.tools.simulator import plan_memory
    from engine.utils import cdiv

    preset, hw = load_model_preset(model_preset), load_hardware_preset(hardware)
    valid = valid_tensor_parallel_sizes(preset.config)
    if tp not in valid:
        return (
            f"{preset.name}은(는) GPU {tp}장으로 나눌 수 없습니다 (query 헤드 "
            f"{preset.config.num_heads}개, KV 헤드 {preset.config.num_kv_heads}개): 가능한 tp "
            f"{', '.join(map(str, valid))}"
        )
    try:
        plan = plan_memory(
            preset,
            hw,
            tp,
            block_size,
            utilization or DEFAULT_GPU_MEMORY_UTILIZATION,
            max_num_batched_tokens,
            max_num_seqs,
            pp,
        )
    except PresetError as error:
        return str(error)
    needed = cdiv(max_model_len, block_size)
    if plan.num_blocks < needed:
        return (
            f"{preset.name} on {hw.name} × {tp * pp}: KV cache of {plan.num_blocks} blocks "
            f"holds fewer than one {max_model_len}-token request ({needed} blocks)"
        )
    return None


def tp_scaling(
    model_preset: str,
    hardware: str,
    sizes=(1, 2, 4, 8),
    batch: int = 32,
    context: int = 1024,
    prefill_tokens: int = 2048,
    efficiency=None,
) -> pd.DataFrame:
    """계산값: one decode step (`batch` requests, `context` tokens cached each) and one prefill
    step (`prefill_tokens` new tokens of one request) on tp = each size, from the cost model
    (engine/tools/cost_model.py, the same one the simulated engine uses). Per row: the step's
    time and its parts, the all-reduce share of the step, the speed-up against the smallest size in
    the table that fits in memory and the ideal one (the ratio of GPU counts), whether the
    weights fit, and what the KV cache gets of each GPU once weights and activations are placed
    (chapter 05's budget; a size that barely fits leaves room for few tokens). Sizes the
    model's heads cannot be cut into are left out."""
    from engine.config import DEFAULT_GPU_MEMORY_UTILIZATION
    from engine.layers.sharding import valid_tensor_parallel_sizes
    from engine.tools.cost_model import CostModel
    from engine.tools.presets import (
        DTYPE_BYTES,
        PresetError,
        load_hardware_preset,
        load_model_preset,
    )
    from engine.tools.simulator import plan_memory

    preset, hw = load_model_preset(model_preset), load_hardware_preset(hardware)
    valid = set(valid_tensor_parallel_sizes(preset.config))
    hw_bytes = DTYPE_BYTES[hw.dtype]
    rows = []
    phases = {
        "decode": ([(1, context)] * batch, batch),
        "prefill": ([(prefill_tokens, 0)], 1),
    }
    for phase, (step_batch, sampled) in phases.items():
        base = None
        for tp in [s for s in sizes if s in valid]:
            cost = CostModel(preset.config, hw, tp, efficiency).step_cost(step_batch, sampled)
            try:
                plan = plan_memory(
                    preset, hw, tp, 16, DEFAULT_GPU_MEMORY_UTILIZATION, prefill_tokens, batch
                )
            except PresetError:
                plan = None
            fits = plan is not None
            if fits and base is None:  # the speed-ups are against the smallest size that fits
                base = (tp, cost.total_s)
            rows.append(
                {
                    "단계": phase,
                    "GPU 수 (tp)": tp,
                    "스텝 (ms)": _r(1000 * cost.total_s, 2),
                    "계산 (ms)": _r(1000 * (cost.linear_s + cost.attention_s), 2),
                    "all-reduce (ms)": _r(1000 * cost.allreduce_s, 2),
                    "고정 비용 (ms)": _r(1000 * cost.overhead_s, 2),
                    "통신 비율 (%)": _r(100 * cost.allreduce_s / cost.total_s),
                    "속도 (가장 작은 tp 대비)": _r(base[1] / cost.total_s, 2) if fits else None,
                    "이상적 속도": _r(tp / base[0], 2) if fits else None,
                    "메모리에 들어감": fits,
                    "GPU당 가중치 (GB)": _r(preset.num_parameters() * hw_bytes / tp / 1e9, 1),
                    "GPU당 KV 캐시 자리 (GB)": _r(plan.kv_budget_bytes / 1e9, 2) if fits else None,
                    "KV 캐시에 들어가는 토큰": plan.num_blocks * 16 if fits else None,
                }
            )
    return pd.DataFrame(rows)
