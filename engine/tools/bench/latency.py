"""Section 5: latency under load. Poisson arrivals at a few rates through the in-process
AsyncLLM; TTFT, TPOT and E2E percentiles and the throughput reached."""

from __future__ import annotations

import asyncio
import time

from engine.tools.bench.offline import greedy_params
from engine.tools.workload import WorkItem, percentiles, poisson_arrivals


async def _poisson_run(async_llm, workload: list[WorkItem], rate: float, seed: int) -> dict:
    offsets = poisson_arrivals(len(workload), rate, seed)
    t0 = time.perf_counter()

    async def one(item: WorkItem, offset: float):
        await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
        final = None
        async for output in async_llm.generate(
            None, greedy_params(item), prompt_token_ids=item.prompt_token_ids
        ):
            final = output
        return final

    finals = await asyncio.gather(*(one(w, o) for w, o in zip(workload, offsets)))
    metrics = [f.metrics for f in finals]
    first_arrival = min(m.arrival_time for m in metrics)
    last_finish = max(m.finish_time for m in metrics)
    output_tokens = sum(m.num_output_tokens for m in metrics)
    return {
        "rate_req_s": rate,
        "requests": len(metrics),
        "ttft_s": percentiles([m.ttft for m in metrics]),
        "tpot_s": percentiles([m.tpot for m in metrics if m.tpot is not None]),
        "e2e_s": percentiles([m.e2e for m in metrics]),
        "output_tokens_per_s": output_tokens / (last_finish - first_arrival),
        "requests_per_s": len(metrics) / (last_finish - first_arrival),
        "duration_s": last_finish - first_arrival,
    }


def run_latency(engine, workload: list[WorkItem], rates: list[float], seed: int) -> list[dict]:
    from engine.entrypoints.llm import AsyncLLM

    results = []
    for i, rate in enumerate(rates):
        async_llm = AsyncLLM(engine=engine)
        try:
            results.append(asyncio.run(_poisson_run(async_llm, workload, rate, seed + i)))
        finally:
            async_llm.shutdown()
    return results
