"""Disaggregated prefill/decode at scale: N prefill and M decode instances on one virtual clock.

Each instance is a simulated engine (engine/tools/simulator.py): the real EngineCore, Scheduler
and KVCacheManager, with step times from the cost model. A least-loaded router sends each
arriving request to a prefill instance with max_tokens=1 (as vLLM's disaggregation proxy does);
when it finishes there, its prompt's K/V cross a link preset (engine/tools/presets/links/), a
delay of bytes ÷ one-way bandwidth + latency on the virtual clock, and the router hands it to a
decode instance. The decode instance's KV connector (`TransferredPromptConnector`, a simulated
consumer in the shape of vLLM's KVConnectorBase_V1) reports the transferred prompt tokens as
computed outside the device cache, so its real scheduler admits the request with blocks for them
and computes only the last prompt token (which gives the first output token) — as vLLM's consumer
does. The colocated deployment it is compared with runs the same router over N + M instances that
each do both.

    run = simulate_cluster("llama-3.1-8b", "h100-sxm", num_prefill=1, num_decode=3, link="ib")
    run.summary["goodput"]                     # share and rate of requests meeting both SLOs
    compare_colocated(...)                     # split vs colocated, same GPUs (rows: plain data)
    sweep_pd_ratio(..., total_gpus=4)          # every split P:D, the best one named

What the model leaves out: the link has no queueing (each transfer has the link to itself, as if
every prefill/decode pair had its own), transfers do not slow the steps on either side, and the
router sees each instance as of its last step's end.
"""

from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass, field, fields

from engine.kv_connector import KVConnectorBase_V1, KVConnectorMetadata, KVTransferConfig
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.tools.cost_model import Efficiency
from engine.tools.presets import LinkPreset, ModelPreset, load_link_preset, load_model_preset
from engine.tools.simulator import _resolve, make_simulated_engine
from engine.tools.workload import SimRequest, percentiles, poisson_workload

# Assumed targets for a chat service, not from a source (DistServe sets its own per model and
# application); pass your own.
DEFAULT_SLO_TTFT_S = 2.0
DEFAULT_SLO_TPOT_S = 0.1


@dataclass(frozen=True)
class SLO:
    """Latency targets a request must meet BOTH of to count towards goodput (DistServe)."""

    ttft_s: float = DEFAULT_SLO_TTFT_S
    tpot_s: float = DEFAULT_SLO_TPOT_S

    def __post_init__(self):
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLO targets must be positive seconds, got {self}")


@dataclass
class Transfer:
    """One request's prompt K/V crossing the link (computed: bytes ÷ bandwidth + latency)."""

    request_id: str
    num_tokens: int
    num_bytes: int
    seconds: float
    start: float  # the prefill instance's finish (engine clock)
    prefill_instance: int
    decode_instance: int | None = None  # chosen when it arrives

    @property
    def ready(self) -> float:
        return self.start + self.seconds


# ---------------------------------------------------------------------------------------------
# The event loop: arrivals, steps and transfers in time order


def load_of(engine) -> int:
    """What the least-loaded router compares: requests waiting or running on the instance."""
    return len(engine.scheduler.waiting) + len(engine.scheduler.running)


def least_loaded(engines: list) -> int:
    """The instance with the fewest waiting + running requests (ties: the lowest index)."""
    return min(range(len(engines)), key=lambda i: (load_of(engines[i]), i))


def _params(item: SimRequest, max_tokens: int | None = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens or item.max_tokens or item.output_len,
        temperature=0.0,
        ignore_eos=item.ignore_eos,
    )


def _deliver(engine, request_id: str, item: SimRequest, at: float, max_tokens=None) -> Request:
    """Queue a request on an instance at engine time `at` (an idle instance's clock jumps there;
    a busy one is mid-step and sees it at its next step). Its arrival stays the workload's."""
    if not engine.has_unfinished_requests():
        engine.clock.advance_to(at)
    return engine.add_request(
        prompt_token_ids=item.prompt_token_ids,
        sampling_params=_params(item, max_tokens),
        request_id=request_id,
        engine_arrival_time=item.arrival,
    )


class Cluster:
    """`front` instances take arriving requests; with `back` (decode) instances, a request that
    finishes on the front (its prefill, max_tokens=1) crosses `link` and decodes on the back.
    Without `back` the front instances are colocated: each request runs there to its end.

    The loop keeps one timeline: before an instance steps, every arrival and transfer due by its
    clock is delivered; the instance whose clock is earliest steps next."""

    def __init__(self, front: list, back: list, link: LinkPreset | None, preset: ModelPreset):
        if not front or (back and link is None):
            raise ValueError("a cluster needs front instances, and a link when it has back ones")
        self.front, self.back, self.link, self.preset = front, back, link, preset
        self.engines = front + back
        self.transfers: dict[str, Transfer] = {}
        self.final: dict[str, Request] = {}  # request id → the request that produces its output
        self.routed: dict[str, list[int]] = {}  # request id → [front index, back index]
        self._in_prefill: list[dict[str, Request]] = [{} for _ in front]
        self._due: list[tuple[float, int, str]] = []  # (ready time, seq, request id) transfers
        self.steps = 0
        for engine in self.engines:
            engine.emit_outputs = False  # no per-step RequestOutput: metrics come from journeys

    def run(self, workload: list[SimRequest]) -> None:
        """Feed the workload and step until every request has finished its decode."""
        order = sorted(range(len(workload)), key=lambda i: workload[i].arrival)
        self._workload, nxt = workload, 0
        while (
            nxt < len(order) or self._due or any(e.has_unfinished_requests() for e in self.engines)
        ):
            busy = [e for e in self.engines if e.has_unfinished_requests()]
            step_at = min((e.clock.now() for e in busy), default=float("inf"))
            arrival_at = workload[order[nxt]].arrival if nxt < len(order) else float("inf")
            transfer_at = self._due[0][0] if self._due else float("inf")
            if min(arrival_at, transfer_at) <= step_at:
                if arrival_at <= transfer_at:
                    self._arrive(order[nxt])
                    nxt += 1
                else:
                    self._hand_over(heapq.heappop(self._due)[2])
                continue
            engine = min(busy, key=lambda e: e.clock.now())
            engine.step()
            self.steps += 1
            front = next((i for i, e in enumerate(self.front) if e is engine), None)
            if self.back and front is not None:
                self._collect_prefills(front)

    def _arrive(self, index: int) -> None:
        item, request_id = self._workload[index], f"sim-{index}"
        i = least_loaded(self.front)
        self.routed[request_id] = [i]
        if not self.back:
            self.final[request_id] = _deliver(self.front[i], request_id, item, item.arrival)
            return
        self._in_prefill[i][request_id] = _deliver(
            self.front[i], request_id, item, item.arrival, max_tokens=1
        )

    def _collect_prefills(self, i: int) -> None:
        """Prefills that finished in this step start their transfer at the step's end."""
        done = [rid for rid, r in self._in_prefill[i].items() if r.is_finished]
        now = self.front[i].clock.now()
        for request_id in done:
            request = self._in_prefill[i].pop(request_id)
            tokens = request.num_prompt_tokens
            num_bytes = self.preset.kv_bytes(tokens, self.front[i].config.dtype)
            seconds = self.link.transfer_seconds(num_bytes)
            self.transfers[request_id] = Transfer(request_id, tokens, num_bytes, seconds, now, i)
            heapq.heappush(self._due, (now + seconds, len(self.transfers), request_id))

    def _hand_over(self, request_id: str) -> None:
        """The K/V have arrived: the least-loaded decode instance queues the request, its
        prompt's K/V waiting for its connector (`kv_transfer_params`)."""
        transfer = self.transfers[request_id]
        j = least_loaded(self.back)
        transfer.decode_instance = j
        self.routed[request_id].append(j)
        item = self._workload[int(request_id.removeprefix("sim-"))]
        request = _deliver(self.back[j], request_id, item, transfer.ready)
        request.kv_transfer_params = {
            "remote_request_id": request_id,
            "num_tokens": transfer.num_tokens,
        }
        self.final[request_id] = request


# ---------------------------------------------------------------------------------------------
# Results: TTFT, TPOT, ITL and goodput under the SLOs


@dataclass
class ClusterResult:
    """One deployment's run: per-request rows and the summary (engine clock, seconds)."""

    mode: str  # "disaggregated" or "colocated"
    num_prefill: int  # colocated: the number of instances
    num_decode: int  # colocated: 0
    link: str | None
    slo: SLO
    rows: list[dict]  # one per request, workload order
    summary: dict
    conditions: dict = field(default_factory=dict)
    cluster: Cluster | None = field(default=None, repr=False)  # its engines, requests, transfers

    def to_dict(self) -> dict:
        """Plain data (JSON): everything but the engines."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "cluster"}
        return {**out, "slo": asdict(self.slo)}


def request_row(request_id: str, request: Request, transfer: Transfer | None, slo: SLO) -> dict:
    """A request's latencies on the engine clock and whether it met each SLO. A request with
    one output token has no TPOT and meets that target trivially."""
    m = request.metrics(clock="engine")
    meets_ttft = m.ttft is not None and m.ttft <= slo.ttft_s
    meets_tpot = m.ttft is not None and (m.tpot is None or m.tpot <= slo.tpot_s)
    return {
        "request_id": request_id,
        "arrival_s": m.arrival_time,
        "prompt_tokens": m.num_prompt_tokens,
        "output_tokens": m.num_output_tokens,
        "ttft_s": m.ttft,
        "tpot_s": m.tpot,
        "e2e_s": m.e2e,
        "itl_s": list(m.itl),
        "preemptions": m.num_preemptions,
        "prefill_done_s": transfer.start if transfer else None,
        "kv_bytes": transfer.num_bytes if transfer else 0,
        "transfer_s": transfer.seconds if transfer else 0.0,
        "prefill_instance": transfer.prefill_instance if transfer else None,
        "decode_instance": transfer.decode_instance if transfer else None,
        "meets_ttft": meets_ttft,
        "meets_tpot": meets_tpot,
        "meets_slo": meets_ttft and meets_tpot,
    }


def summarize_rows(rows: list[dict], num_gpus: int) -> dict:
    """Percentiles of TTFT, TPOT and ITL (every gap of every request), and goodput: the share
    of requests meeting BOTH SLOs, and their rate over the run (requests/s, and per GPU)."""
    first = min(r["arrival_s"] for r in rows)
    last = max(r["arrival_s"] + r["e2e_s"] for r in rows if r["e2e_s"] is not None)
    span = last - first
    good = sum(r["meets_slo"] for r in rows)
    itl = [gap for r in rows for gap in r["itl_s"]]
    transfers = [r["transfer_s"] for r in rows if r["kv_bytes"]]
    return {
        "requests": len(rows),
        "ttft_s": percentiles(r["ttft_s"] for r in rows if r["ttft_s"] is not None),
        "tpot_s": percentiles(r["tpot_s"] for r in rows if r["tpot_s"] is not None),
        "itl_s": percentiles(itl),
        "transfer_s": percentiles(transfers),
        "kv_bytes_total": sum(r["kv_bytes"] for r in rows),
        "duration_s": span,
        "output_tokens_per_s": sum(r["output_tokens"] for r in rows) / span if span else None,
        "meets_ttft": sum(r["meets_ttft"] for r in rows) / len(rows),
        "meets_tpot": sum(r["meets_tpot"] for r in rows) / len(rows),
        "goodput": {
            "share": good / len(rows),
            "requests_per_s": good / span if span else None,
            "requests_per_s_per_gpu": good / span / num_gpus if span else None,
        },
        "preemptions": sum(r["preemptions"] for r in rows),
    }


# ---------------------------------------------------------------------------------------------
# Building and running the deployments


def _instances(preset, hw, count: int, efficiency, targets, role: str, engine_config) -> list:
    engines = []
    for _ in range(count):
        engine = make_simulated_engine(preset, hw, 1, efficiency, targets.get, **engine_config)
        if role == "decode":
            attach_transfer_connector(engine)
        engines.append(engine)
    return engines


def simulate_cluster(
    model_preset: str | ModelPreset = "llama-3.1-8b",
    hardware="h100-sxm",
    num_prefill: int = 1,
    num_decode: int = 1,
    link: str | LinkPreset | None = "nvlink",
    slo: SLO | None = None,
    rate: float | None = 4.0,
    num_requests: int = 200,
    prompt_len: tuple[int, int] = (32, 1024),
    output_len: tuple[int, int] = (32, 512),
    seed: int = 0,
    workload: list[SimRequest] | None = None,
    efficiency: Efficiency | None = None,
    **engine_config,
) -> ClusterResult:
    """One deployment on one GPU preset, one GPU per instance: `num_prefill` prefill and
    `num_decode` decode instances with the K/V crossing `link`, or, with num_decode=0,
    `num_prefill` colocated instances (each prefills and decodes; no link). Poisson arrivals at
    `rate` (None: all at once), or the caller's `workload` (e.g. a trace's, trace_readers.py).
    `engine_config`: EngineConfig fields every instance gets (max_num_seqs, ...)."""
    preset, hw = _resolve(model_preset, hardware)
    if num_prefill < 1 or num_decode < 0:
        raise ValueError(
            f"need ≥ 1 prefill and ≥ 0 decode instances, got {num_prefill}:{num_decode}"
        )
    link = load_link_preset(link) if isinstance(link, str) else link
    slo = slo or SLO()
    if workload is None:
        specials = {preset.bos_token_id, preset.eos_token_id} - {None}
        workload = poisson_workload(
            num_requests, rate, prompt_len, output_len, preset.config.vocab_size, seed, specials
        )
    targets = {f"sim-{i}": w.output_len for i, w in enumerate(workload)}
    engine_config.setdefault("long_prefill_token_threshold", 0)  # vLLM's GPU default: no cap
    front = _instances(preset, hw, num_prefill, efficiency, targets, "prefill", engine_config)
    back = _instances(preset, hw, num_decode, efficiency, targets, "decode", engine_config)
    cluster = Cluster(front, back, link if back else None, preset)
    cluster.run(workload)
    rows = [
        request_row(rid, cluster.final[rid], cluster.transfers.get(rid), slo)
        for rid in (f"sim-{i}" for i in range(len(workload)))
    ]
    return ClusterResult(
        "disaggregated" if back else "colocated",
        num_prefill,
        num_decode,
        link.key if back else None,
        slo,
        rows,
        summarize_rows(rows, num_prefill + num_decode),
        _conditions(preset, hw, link if back else None, front[0], workload, rate, cluster.steps),
        cluster,
    )


def _conditions(preset, hw, link, engine, workload, rate, steps) -> dict:
    """What the numbers rest on (each with its evidence)."""
    return {
        "model": preset.name,
        "hardware": {"name": hw.name, "evidence": hw.evidence, "source": hw.source},
        "link": None if link is None else {**asdict(link), "transfer_formula": TRANSFER_FORMULA},
        "kv_bytes_per_token": preset.kv_bytes(1, engine.config.dtype),
        "kv_bytes_formula": KV_BYTES_FORMULA,
        "kv_blocks_per_instance": engine.num_blocks,
        "engine": {
            "max_num_seqs": engine.config.max_num_seqs,
            "max_num_batched_tokens": engine.config.max_num_batched_tokens,
            "long_prefill_token_threshold": engine.config.long_prefill_token_threshold,
        },
        "workload": {"num_requests": len(workload), "rate_req_s": rate},
        "router": "least-loaded (fewest waiting + running requests; ties: lowest index)",
        "steps": steps,
        "evidence": "computed by the cost model on the virtual clock, not measured",
    }


KV_BYTES_FORMULA = "layers × 2 × KV heads × head_dim × dtype bytes × prompt tokens"
TRANSFER_FORMULA = "KV bytes ÷ the link's one-way bandwidth + its per-transfer latency"


# ---------------------------------------------------------------------------------------------
# The decode instance's side: a simulated KV connector (consumer)


class TransferredPromptConnector(KVConnectorBase_V1):
    """A decode instance's connector in the simulator (kv_role "kv_consumer"): a request whose
    `kv_transfer_params` say its prompt's K/V have arrived ({"remote_request_id", "num_tokens"},
    what InProcessConnector's producer hands on) is reported as having them outside the device
    cache, so the real scheduler allocates blocks for them and computes only the last prompt
    token (the model must run on it for the first output token's logits), as vLLM's consumer
    does. It plans no copies: the simulated executor has no tensors, and the transfer's time was
    spent on the link before the request reached this instance.

    Once per request: after a recompute preemption its blocks are gone and so is the transfer,
    and it prefills like any other request (vLLM's consumer does the same)."""

    def __init__(self, block_size: int, bytes_per_block: int):
        config = KVTransferConfig("TransferredPromptConnector", kv_role="kv_consumer")
        super().__init__(config, block_size, bytes_per_block)
        self._loaded: set[str] = set()
        self.stats = {"loads": 0, "load_tokens": 0}

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        params = request.kv_transfer_params
        if not params or "remote_request_id" not in params or request.request_id in self._loaded:
            return 0
        available = min(int(params.get("num_tokens", 0)), request.num_tokens - 1)
        return max(available - num_computed_tokens, 0)

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        if num_external_tokens > 0:
            self._loaded.add(request.request_id)
            self.stats["loads"] += 1
            self.stats["load_tokens"] += num_external_tokens

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._loaded.discard(request.request_id)
        return False, None


def attach_transfer_connector(engine) -> TransferredPromptConnector:
    """Give a simulated engine's scheduler the consumer connector (the simulator's engines are
    built without a kv_transfer_config: the connector is the simulator's own, not a registered
    one that moves tensors)."""
    memory = engine.executor.memory
    connector = TransferredPromptConnector(engine.config.block_size, memory.bytes_per_block)
    connector.hash_fn = engine.kv_cache_manager.hash_fn
    engine.scheduler.kv_connector = connector
    return connector


# ---------------------------------------------------------------------------------------------
# What the lab and the CLI call: split vs colocated, and the P:D sweep


def summary_row(result: ClusterResult) -> dict:
    """One flat row per deployment (a DataFrame row: `pandas.DataFrame(rows)`), seconds."""
    s = result.summary
    split = f"{result.num_prefill}:{result.num_decode}" if result.num_decode else "colocated"
    return {
        "deployment": split,
        "gpus": result.num_prefill + result.num_decode,
        "prefill_gpus": result.num_prefill if result.num_decode else None,
        "decode_gpus": result.num_decode or None,
        "link": result.link,
        "ttft_p50_s": s["ttft_s"]["p50"],
        "ttft_p99_s": s["ttft_s"]["p99"],
        "tpot_p50_s": s["tpot_s"]["p50"],
        "tpot_p99_s": s["tpot_s"]["p99"],
        "itl_p50_s": s["itl_s"]["p50"],
        "itl_p99_s": s["itl_s"]["p99"],
        "transfer_p50_s": s["transfer_s"]["p50"],
        "meets_ttft": s["meets_ttft"],
        "meets_tpot": s["meets_tpot"],
        "goodput_share": s["goodput"]["share"],
        "goodput_req_s": s["goodput"]["requests_per_s"],
        "output_tokens_per_s": s["output_tokens_per_s"],
        "preemptions": s["preemptions"],
    }


def _shared_workload(model_preset, rate, num_requests, prompt_len, output_len, seed, workload):
    """One workload for every deployment compared (the same requests at the same times)."""
    if workload is not None:
        return workload
    preset = load_model_preset(model_preset) if isinstance(model_preset, str) else model_preset
    specials = {preset.bos_token_id, preset.eos_token_id} - {None}
    return poisson_workload(
        num_requests, rate, prompt_len, output_len, preset.config.vocab_size, seed, specials
    )


@dataclass
class PDSweep:
    """Every split P:D of `total_gpus` (P ≥ 1, D ≥ 1) and the colocated reference, on one
    workload; `best` is the split with the highest goodput (requests/s meeting both SLOs; ties:
    the higher share, then fewer prefill GPUs), `rows` one flat dict per deployment."""

    total_gpus: int
    slo: SLO
    link: str
    results: list[ClusterResult]  # splits by P ascending, then colocated
    best: str  # "P:D"
    rows: list[dict]

    def to_dict(self) -> dict:
        return {
            "total_gpus": self.total_gpus,
            "slo": asdict(self.slo),
            "link": self.link,
            "best": self.best,
            "rows": self.rows,
            "conditions": self.results[0].conditions,
        }


def compare_colocated(
    model_preset="llama-3.1-8b",
    hardware="h100-sxm",
    num_prefill: int = 1,
    num_decode: int = 1,
    link="nvlink",
    slo: SLO | None = None,
    rate: float | None = 4.0,
    num_requests: int = 200,
    prompt_len: tuple[int, int] = (32, 1024),
    output_len: tuple[int, int] = (32, 512),
    seed: int = 0,
    workload: list[SimRequest] | None = None,
    **engine_config,
) -> tuple[ClusterResult, ClusterResult]:
    """(split P:D, colocated on P + D GPUs): the same requests at the same times through both,
    behind the same least-loaded router. `summary_row(r)` of each is a DataFrame row; each
    result's `rows` hold every request's TTFT, TPOT, ITL gaps and whether it met the SLOs."""
    workload = _shared_workload(
        model_preset, rate, num_requests, prompt_len, output_len, seed, workload
    )
    common = dict(slo=slo, rate=rate, workload=workload, **engine_config)
    split = simulate_cluster(model_preset, hardware, num_prefill, num_decode, link, **common)
    colocated = simulate_cluster(
        model_preset, hardware, num_prefill + num_decode, 0, None, **common
    )
    return split, colocated


def sweep_pd_ratio(
    model_preset="llama-3.1-8b",
    hardware="h100-sxm",
    total_gpus: int = 4,
    link="nvlink",
    slo: SLO | None = None,
    rate: float | None = 4.0,
    num_requests: int = 200,
    prompt_len: tuple[int, int] = (32, 1024),
    output_len: tuple[int, int] = (32, 512),
    seed: int = 0,
    workload: list[SimRequest] | None = None,
    **engine_config,
) -> PDSweep:
    """ "How many prefill GPUs for this workload and SLO?": every split P:D with P + D =
    `total_gpus`, plus the colocated deployment on the same GPUs, the same workload through
    each. Returns a PDSweep (`rows` → `pandas.DataFrame(sweep.rows)`, `best` → "P:D")."""
    if total_gpus < 2:
        raise ValueError(f"a P:D split needs at least 2 GPUs, got {total_gpus}")
    slo = slo or SLO()
    workload = _shared_workload(
        model_preset, rate, num_requests, prompt_len, output_len, seed, workload
    )
    common = dict(slo=slo, rate=rate, workload=workload, **engine_config)
    results = [
        simulate_cluster(model_preset, hardware, p, total_gpus - p, link, **common)
        for p in range(1, total_gpus)
    ]
    results.append(simulate_cluster(model_preset, hardware, total_gpus, 0, None, **common))
    best = max(
        results[:-1],
        key=lambda r: (
            r.summary["goodput"]["requests_per_s"] or 0.0,
            r.summary["goodput"]["share"],
            -r.num_prefill,
        ),
    )
    link_key = results[0].link
    rows = [summary_row(r) for r in results]
    return PDSweep(
        total_gpus, slo, link_key, results, f"{best.num_prefill}:{best.num_decode}", rows
    )


# ---------------------------------------------------------------------------------------------
# Text for the command line


def parse_split(text: str) -> tuple[int, int]:
    """ "P:D" → (P, D), both ≥ 1."""
    try:
        p, d = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--disaggregate wants P:D, e.g. 1:3, got {text!r}") from None
    if p < 1 or d < 1:
        raise ValueError(f"a split needs ≥ 1 prefill and ≥ 1 decode GPU, got {text!r}")
    return p, d


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{1000 * value:,.1f}"


def format_rows(rows: list[dict], slo: SLO, best: str | None = None) -> list[str]:
    """A table of deployments: latencies (ms, p50 / p99) and goodput under the SLOs."""
    lines = [
        f"  {'deployment':<11} {'TTFT p50/p99':>17} {'TPOT p50/p99':>15} {'ITL p99':>8} "
        f"{'transfer p50':>12} {'goodput':>8} {'req/s':>7}",
    ]
    for r in rows:
        mark = "  ← best split" if best and r["deployment"] == best else ""
        lines.append(
            f"  {r['deployment']:<11} "
            f"{_ms(r['ttft_p50_s']):>8}/{_ms(r['ttft_p99_s']):<8} "
            f"{_ms(r['tpot_p50_s']):>7}/{_ms(r['tpot_p99_s']):<7} {_ms(r['itl_p99_s']):>8} "
            f"{_ms(r['transfer_p50_s']):>12} {100 * r['goodput_share']:>7.1f}% "
            f"{r['goodput_req_s'] or 0:>7.2f}{mark}"
        )
    lines.append(
        f"  goodput: requests meeting BOTH TTFT ≤ {_ms(slo.ttft_s)} ms and TPOT ≤ "
        f"{_ms(slo.tpot_s)} ms (share, and their rate over the run)"
    )
    return lines


def format_header(result: ClusterResult, what: str) -> list[str]:
    c = result.conditions
    lines = [
        f"Simulated {what}: {c['model']} on {c['hardware']['name']}, "
        f"{c['workload']['num_requests']} requests, "
        + (
            f"Poisson {c['workload']['rate_req_s']:g}/s"
            if c["workload"]["rate_req_s"]
            else "arrivals given"
        ),
        f"  KV per prompt token (computed: {KV_BYTES_FORMULA}): "
        f"{c['kv_bytes_per_token']:,} bytes; {c['kv_blocks_per_instance']:,} KV blocks per GPU",
    ]
    if c["link"]:
        link = c["link"]
        lines.append(
            f"  link {link['key']}: {link['name']}, {link['one_way_bandwidth'] / 1e9:,.1f} GB/s "
            f"one way ({link['evidence']}: {link['source']}); "
            f"+{1e6 * link['latency_s']:.0f} µs per transfer ({link['latency_evidence']})"
        )
    return lines


def format_comparison(split: ClusterResult, colocated: ClusterResult) -> str:
    lines = format_header(split, f"{split.num_prefill}:{split.num_decode} split vs colocated")
    lines += format_rows([summary_row(split), summary_row(colocated)], split.slo)
    lines.append(FOOTNOTE)
    return "\n".join(lines)


def format_sweep(sweep: PDSweep) -> str:
    lines = format_header(sweep.results[0], f"P:D sweep over {sweep.total_gpus} GPUs")
    lines += format_rows(sweep.rows, sweep.slo, sweep.best)
    lines.append(f"  best split for this workload and SLO: {sweep.best} (prefill:decode GPUs)")
    lines.append(FOOTNOTE)
    return "\n".join(lines)


FOOTNOTE = (
    "  all latencies are computed by the cost model on the virtual clock, not measured; the "
    "link has no queueing (each transfer has it to itself)"
)


def run_cli(args, engine_config: dict, trace=None) -> dict:
    """`python -m engine simulate --disaggregate P:D` or `--pd-sweep N` (argparse's args; `trace`
    a trace_readers.Trace for --trace-file): prints the table and returns the JSON-ready data."""
    data = _run_cli(args, engine_config, trace.requests if trace else None)
    if trace is not None:
        from engine.tools.trace_readers import describe

        data["conditions"]["workload"].update(trace.conditions)
        print(describe(trace))
    return data


def _run_cli(args, engine_config: dict, workload: list[SimRequest] | None) -> dict:
    slo = SLO(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
    common = dict(
        slo=slo,
        rate=None if workload else args.rate,
        num_requests=args.num_requests,
        prompt_len=tuple(args.prompt_len),
        output_len=tuple(args.output_len),
        seed=args.seed,
        workload=workload,
        **engine_config,
    )
    if args.pd_sweep:
        sweep = sweep_pd_ratio(args.model_preset, args.hardware, args.pd_sweep, args.link, **common)
        print(format_sweep(sweep))
        return sweep.to_dict()
    p, d = parse_split(args.disaggregate)
    split, colocated = compare_colocated(
        args.model_preset, args.hardware, p, d, args.link, **common
    )
    print(format_comparison(split, colocated))
    return {
        "slo": asdict(slo),
        "rows": [summary_row(split), summary_row(colocated)],
        "conditions": split.conditions,
        "requests": {"split": split.rows, "colocated": colocated.rows},
    }
