"""The model runner: turns a scheduler decision into tensors, runs the model, samples.

This is where the control path becomes the data path. The scheduler said "request A: 64 prompt
tokens from position 128, request B: 1 token"; the runner builds one flat batch of input ids and
positions, the slot of every new token in the paged cache, each request's block table, and the
row of each request's last token, then calls the model once and samples the next tokens.

With speculative decoding a decoding request brings draft tokens: the runner asks the model for
the logits of all its positions (its last token and each draft), and the rejection sampler
decides how many drafts the model agrees with. One forward thus verifies every draft of every
request, alongside the prefills and plain decodes of the others.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from engine.kv_connector import KVConnectorMetadata, KVTransferRecord
from engine.layers.attention import AttentionMetadata, build_attention_metadata, int_tensor
from engine.layers.ops import ArgMax
from engine.models.llama import LlamaModel
from engine.sample.rejection_sampler import RejectionSampler
from engine.sample.sampler import Sampler, SampleResult, apply_grammar_bitmask
from engine.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.trace import MaskReport
from engine.worker.kv_connector import KVConnectorWorker

logger = logging.getLogger(__name__)


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_meta: AttentionMetadata
    logits_indices: torch.Tensor  # per sampling request its last row (all if it speculates)


@dataclass
class ModelRunnerOutput:
    # Only requests whose scheduled tokens reached their end: the new tokens, in order. One for a
    # plain decode or prefill; with drafts, the accepted drafts and then the model's own token.
    sampled: dict[str, list[SampleResult]]
    # seconds: prepare_inputs, forward, sample (and swap)
    timings: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # request_id → why it could not be sampled
    simulated_duration: float | None = None  # a simulated executor's computed step time (seconds)
    # multi-process executor: one dict per worker rank (compute vs communication seconds,
    # all-reduce count and bytes; engine/executor/multiproc.py)
    workers: list[dict] = field(default_factory=list)
    # KV connector: the step's copies, measured (engine/worker/kv_connector.py), and the requests
    # whose load failed: left out of this forward, the scheduler sends them back to recompute
    kv_transfers: list[KVTransferRecord] = field(default_factory=list)
    failed_kv_loads: list[str] = field(default_factory=list)
    # requests that asked (SamplingParams.report_top_tokens): their row before and after the mask
    mask_reports: dict[str, MaskReport] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self, model: LlamaModel, kv_caches: list, block_size: int, swap_caches: list | None = None
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.swap_caches = swap_caches or []  # per layer (K, V) blocks in host memory
        self.block_size = block_size
        self.device = model.device
        self.sampler = Sampler(ArgMax(model.kernels, torch.float32, model.device))  # float logits
        self.rejection_sampler = RejectionSampler()
        self.cuda_graphs = None  # a CudaGraphRunner once enable_cuda_graphs() is called
        self.kv_connector: KVConnectorWorker | None = None  # set by the worker when configured

    def enable_cuda_graphs(
        self, enabled: bool = True, max_model_len: int | None = None, **graph_args
    ) -> None:
        """Decode-only steps replay captured CUDA graphs (engine/worker/cuda_graphs.py); others stay
        eager. `graph_args` go to CudaGraphRunner (tests pass an eager `capture_fn` on a CPU)."""
        from engine.worker.cuda_graphs import CudaGraphRunner

        self.cuda_graphs = None
        if enabled:
            if self.device.type != "cuda" and "capture_fn" not in graph_args:
                raise ValueError("CUDA graphs need a CUDA device")
            self.cuda_graphs = CudaGraphRunner(
                self.model, self.kv_caches, self.block_size, max_model_len, **graph_args
            )

    def swap_blocks(self, sched: SchedulerOutput) -> float:
        """Copy preempted requests' blocks out to the swap space, and resumed ones back in.
        Outs first: a block given up by a swap-out may be handed to someone in this same step."""
        if not sched.blocks_to_swap_out and not sched.blocks_to_swap_in:
            return 0.0
        start = time.perf_counter()
        for pairs, src_of, dst_of in (
            (sched.blocks_to_swap_out, 0, 1),
            (sched.blocks_to_swap_in, 1, 0),
        ):
            if not pairs:
                continue
            src_ids = torch.tensor([p[0] for p in pairs])
            dst_ids = torch.tensor([p[1] for p in pairs])
            for device_kv, swap_kv in zip(self.kv_caches, self.swap_caches):
                caches = (device_kv, swap_kv)
                for k_or_v in (0, 1):
                    src, dst = caches[src_of][k_or_v], caches[dst_of][k_or_v]
                    # Into host memory the copy must be finished before the assignment reads it
                    # (a non-blocking GPU → CPU copy returns at once); towards the GPU it queues.
                    dst[dst_ids.to(dst.device)] = src[src_ids.to(src.device)].to(
                        dst.device, non_blocking=dst.device.type != "cpu"
                    )
        self._sync()
        return time.perf_counter() - start

    def prepare_inputs(self, sched: SchedulerOutput) -> ModelInputs:
        # Row order of the flat batch: decode tokens first, shortest context first, then prefill
        # chunks. Attention takes decodes of similar length together, and adjacent rows are a slice.
        batch = sorted(sched.scheduled, key=lambda s: (s.phase != "decode", s.num_computed_tokens))
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: dict[str, list[int]] = {}
        for s in batch:
            input_ids += s.token_ids
            positions += range(s.num_computed_tokens, s.num_computed_tokens + s.num_tokens)
            num_rows = 1 + len(s.draft_token_ids)  # the last token, and each draft
            sample_rows[s.request_id] = list(range(len(input_ids) - num_rows, len(input_ids)))
        meta = build_attention_metadata(
            query_lens=[s.num_tokens for s in batch],
            num_computed=[s.num_computed_tokens for s in batch],
            block_tables=[s.block_ids for s in batch],
            block_size=self.block_size,
            device=self.device,
            for_kernel=self.model.kernel_path == "cpu",
        )
        # Logits only for the requests that sample this step, in the scheduler's order. A prefill
        # chunk that stops before the end of the prompt has no next token: no lm_head row for it.
        logits_rows = [
            row for s in sched.scheduled if s.produces_token for row in sample_rows[s.request_id]
        ]
        to_device = self._to_device
        return ModelInputs(to_device(input_ids), to_device(positions), meta, to_device(logits_rows))

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in sched.finished_ids:
            self.sampler.forget(request_id)
            self.rejection_sampler.forget(request_id)
        sched, swap_seconds, kv = self._copy_before_forward(sched)
        if sched.is_empty:
            return self._finish_kv(ModelRunnerOutput({}, {"swap": swap_seconds}), kv)
        t0 = time.perf_counter()
        graph = self.cuda_graphs.prepare(sched) if self.cuda_graphs is not None else None
        inputs = self.prepare_inputs(sched) if graph is None else None
        t1 = time.perf_counter()
        if graph is not None:  # decode-only step: one graph replay, rows in the scheduler's order
            logits = self.cuda_graphs.run(graph, len(sched.scheduled))
        else:
            logits = self.model.forward(
                inputs.input_ids,
                inputs.positions,
                self.kv_caches,
                inputs.attn_meta,
                inputs.logits_indices,
            )
        self._sync()
        t2 = time.perf_counter()
        producing = [s for s in sched.scheduled if s.produces_token]
        # No logits on a rank that does not sample (tensor / pipeline parallel peers).
        sampled, failed = {}, {}
        if logits is not None:
            sampled, failed = self.sample_and_verify(logits, producing, sched.grammar_bitmask)
        t3 = time.perf_counter()
        reports = mask_reports(logits, producing, sched.grammar_bitmask) if producing else {}
        timings = {
            "prepare_inputs": t1 - t0,
            "forward": t2 - t1,
            "sample": t3 - t2,
            "swap": swap_seconds,
        }
        output = ModelRunnerOutput(sampled, timings, failed, mask_reports=reports)
        return self._finish_kv(output, kv)

    def _copy_before_forward(self, sched: SchedulerOutput) -> tuple:
        """The KV connector's stores (to its host tier), the swaps, then its loads, in that
        order (an evicted or swapped-out block may be handed out and written in this step). A
        request whose load failed leaves the step: its blocks hold no valid K/V. Returns the
        step to run, the swap seconds and the connector's part: (metadata, records, failed)."""
        meta = sched.kv_connector_metadata
        if self.kv_connector is None and meta is not None and not meta.is_empty:
            raise RuntimeError(
                "the scheduler planned KV copies but this worker has no KV connector (build its "
                "Worker with the engine's kv_transfer_config); running the step anyway would "
                "decode from K/V that was never copied"
            )
        if self.kv_connector is None or meta is None:
            return sched, self.swap_blocks(sched), None
        stored = self.kv_connector.store_kv(meta)
        swap_seconds = self.swap_blocks(sched)
        loaded, failed = self.kv_connector.start_load_kv(meta)
        if failed:
            kept = [s for s in sched.scheduled if s.request_id not in failed]
            sched = dataclasses.replace(sched, scheduled=kept)
        return sched, swap_seconds, (meta, stored + loaded, failed)

    def _finish_kv(
        self,
        output: ModelRunnerOutput,
        kv: tuple[KVConnectorMetadata, list[KVTransferRecord], set[str]] | None,
    ) -> ModelRunnerOutput:
        """After the forward: the connector's saves; every copy of the step into the output."""
        if kv is None:
            return output
        meta, records, failed = kv
        records = records + self.kv_connector.save_kv(meta, skip=failed)
        output.kv_transfers, output.failed_kv_loads = records, sorted(failed)
        for direction in ("store", "load", "save"):
            seconds = sum(r.seconds for r in records if r.direction == direction)
            output.timings[f"kv_{direction}"] = seconds
        return output

    def sample_and_verify(
        self,
        logits: torch.Tensor,
        producing: list[ScheduledRequest],
        grammar_bitmask: dict[str, bytes] | None = None,
    ) -> tuple[dict[str, list[SampleResult]], dict[str, str]]:
        """Split the logits rows (1 per plain request, 1 + d per speculating one, in order):
        plain requests are sampled together (under their grammar masks, if any), speculating ones
        verified one by one (a request with a grammar never speculates: EngineCore drafts none)."""
        plain_rows, plain, row = [], [], 0
        speculating: list[tuple[ScheduledRequest, torch.Tensor]] = []
        for s in producing:
            num_rows = 1 + len(s.draft_token_ids)
            if s.draft_token_ids:
                speculating.append((s, logits[row : row + num_rows]))
            else:
                plain_rows.append(row)
                plain.append(s)
            row += num_rows
        plain_logits = logits if not speculating else logits[plain_rows]
        results, failed = self.sample(plain_logits, plain, grammar_bitmask) if plain else ({}, {})
        sampled = {request_id: [result] for request_id, result in results.items()}
        for s, rows in speculating:
            try:
                tokens = self.rejection_sampler(
                    rows, s.draft_token_ids, s.sampling_params, s.request_id
                )
                sampled[s.request_id] = with_logprobs(rows, tokens, s.sampling_params.logprobs)
            except Exception as error:  # noqa: BLE001 — fail this request only
                logger.exception("request %s: verification failed", s.request_id)
                failed[s.request_id] = f"verification failed ({type(error).__name__})"
        return sampled, failed

    def sample(
        self, logits: torch.Tensor, producing: list, grammar_bitmask: dict[str, bytes] | None = None
    ) -> tuple[dict[str, SampleResult], dict[str, str]]:
        """Sample the whole batch at once; if that fails, row by row, so only the bad request
        fails."""
        ids, params = [s.request_id for s in producing], [s.sampling_params for s in producing]
        masks = [grammar_bitmask.get(i) for i in ids] if grammar_bitmask else None
        with_masks = {} if masks is None else {"bitmasks": masks}  # masks only when there are
        try:
            return dict(zip(ids, self.sampler(logits, ids, params, **with_masks))), {}
        except Exception:  # noqa: BLE001 — find the row that fails, keep the others
            sampled, failed = {}, {}
            for row, (request_id, p) in enumerate(zip(ids, params)):
                mask = {} if masks is None else {"bitmasks": [masks[row]]}
                try:
                    sampled[request_id] = self.sampler(
                        logits[row : row + 1], [request_id], [p], **mask
                    )[0]
                except Exception as error:  # noqa: BLE001
                    logger.exception("request %s: sampling failed", request_id)
                    failed[request_id] = f"sampling failed ({type(error).__name__})"
            return sampled, failed

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """A step input on the device. On CUDA it goes through pinned (page-locked) host memory
        with a non-blocking copy: the copy is queued behind the work already on the GPU instead
        of making the CPU wait for it. (PyTorch caches pinned blocks, so pinning is cheap.)"""
        host = int_tensor(values)
        if self.device.type == "cpu":
            return host
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def with_logprobs(
    rows: torch.Tensor, token_ids: list[int], num_logprobs: int | None
) -> list[SampleResult]:
    """SampleResults for tokens verified from consecutive logits rows (token i from row i), with
    the logprobs the request asked for, under the unmodified distribution as the sampler does."""
    if num_logprobs is None:
        return [SampleResult(token) for token in token_ids]
    logprobs = torch.log_softmax(rows[: len(token_ids)].float(), dim=-1)
    results = []
    for row, token in zip(logprobs, token_ids):
        top = row.topk(num_logprobs) if num_logprobs > 0 else None
        top_logprobs = {} if top is None else dict(zip(top.indices.tolist(), top.values.tolist()))
        results.append(SampleResult(token, row[token].item(), top_logprobs))
    return results


def mask_reports(
    logits: torch.Tensor | None,
    producing: list[ScheduledRequest],
    grammar_bitmask: dict[str, bytes] | None,
) -> dict[str, MaskReport]:
    """The requests that asked for it (report_top_tokens > 0) and sampled one row: their row
    before and after the grammar mask. Outside the timed sample phase, and nothing is computed
    for a request that did not ask."""
    wanted = [s for s in producing if s.sampling_params.report_top_tokens and not s.draft_token_ids]
    if logits is None or not wanted:
        return {}
    rows = {}
    row = 0
    for s in producing:
        rows[s.request_id] = row
        row += 1 + len(s.draft_token_ids)
    masks = grammar_bitmask or {}
    return {
        s.request_id: mask_report(
            logits[rows[s.request_id]],
            masks.get(s.request_id),
            s.sampling_params.report_top_tokens,
        )
        for s in wanted
    }


def mask_report(row: torch.Tensor, mask: bytes | None, top: int) -> MaskReport:
    """One row's `top` tokens before and after its mask, and the probability mass it removed."""
    raw = row.float().unsqueeze(0)
    masked = apply_grammar_bitmask(raw, [mask])[0]
    probs = torch.softmax(raw[0], dim=-1)
    allowed = torch.isfinite(masked)
    num_allowed = int(allowed.sum())
    before = probs.topk(min(top, probs.numel()))
    pairs_before = list(zip(before.indices.tolist(), before.values.tolist()))
    if num_allowed == 0:
        return MaskReport(pairs_before, [], 1.0, 0)
    masked_probs = torch.softmax(masked, dim=-1)
    after = masked_probs.topk(min(top, num_allowed))
    removed = max(0.0, 1.0 - float(probs[allowed].sum()))
    pairs_after = list(zip(after.indices.tolist(), after.values.tolist()))
    return MaskReport(pairs_before, pairs_after, removed, num_allowed)
