"""AsyncLLM: concurrent streams over asyncio, early exits and cancellation abort and free the KV
blocks, bad requests fail at once, a failing step listener does not stop the engine (tiny model)."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine import LLM, InvalidRequestError, SamplingParams
from engine.entrypoints.llm import AsyncLLM

PROMPTS = {
    "en": "The quick brown fox",
    "ko": "안녕하세요, 오늘 날씨는",
    "code": "def add(a, b):\n",
    "mixed": "KV cache 블록은 16 tokens",
}
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
ENGINE = dict(device="cpu", num_kv_blocks=64, max_model_len=256, block_size=16)


@pytest.fixture(scope="module")
def async_llm(tiny_model_dir):
    llm = AsyncLLM(model=str(tiny_model_dir), **ENGINE)
    yield llm
    llm.shutdown()
    assert not llm._thread.is_alive()


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), **ENGINE)
    outputs = llm.generate(list(PROMPTS.values()), GREEDY, use_tqdm=False)
    return dict(zip(PROMPTS, outputs))


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


async def await_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return predicate()


def no_blocks_used(llm: AsyncLLM) -> bool:
    kv = llm.engine.kv_cache_manager
    return kv.num_free_blocks == kv.num_blocks and not kv.req_to_blocks


def test_concurrent_streams_equal_offline_greedy(async_llm, offline):
    async def consume(name):
        deltas, outputs = [], []
        async for out in async_llm.generate(PROMPTS[name], GREEDY, request_id=f"stream-{name}"):
            deltas.append(out.delta_text)
            outputs.append(out)
        return deltas, outputs

    async def main():
        return dict(zip(PROMPTS, await asyncio.gather(*(consume(n) for n in PROMPTS))))

    results = asyncio.run(main())
    for name, (deltas, outputs) in results.items():
        final = outputs[-1]
        assert final.finished and all(not o.finished for o in outputs[:-1])
        assert "".join(deltas) == final.text == offline[name].text
        assert final.token_ids == offline[name].token_ids and len(final.token_ids) == 16
        assert final.finish_reason == "length"
        assert sum(len(o.delta_token_ids) for o in outputs) == 16
    # the four requests really ran side by side in the engine
    steps = {}
    for name in PROMPTS:
        request = async_llm.engine.get_request(f"stream-{name}")
        steps[name] = {e.step for e in request.journey if e.kind in ("first_token", "token")}
    assert set.intersection(*steps.values())
    assert wait_until(lambda: no_blocks_used(async_llm))


def test_breaking_out_of_the_stream_aborts_and_frees_blocks(async_llm):
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def main():
        received = 0
        async for out in async_llm.generate(
            "Tell me a very long story", params, request_id="leaver"
        ):
            received += 1
            if received == 3:
                break
        # the generator is finalised by the event loop: its `finally` sends the abort
        return received, await await_until(lambda: no_blocks_used(async_llm))

    received, freed = asyncio.run(main())
    assert received == 3 and freed
    request = async_llm.engine.get_request("leaver")
    assert request.finish_reason == "abort" and request.num_output_tokens < 200


def test_aclose_aborts_and_frees_blocks(async_llm):
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def main():
        stream = async_llm.generate("Another long story", params, request_id="closer")
        first = await stream.__anext__()
        used = (
            async_llm.engine.kv_cache_manager.num_free_blocks
            < async_llm.engine.kv_cache_manager.num_blocks
        )
        await stream.aclose()
        return first, used, await await_until(lambda: no_blocks_used(async_llm))

    first, used_while_running, freed = asyncio.run(main())
    assert not first.finished and used_while_running and freed
    assert async_llm.engine.get_request("closer").finish_reason == "abort"


def test_cancelling_the_task_aborts_and_frees_blocks(async_llm):
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def main():
        started = asyncio.Event()

        async def consume():
            async for _ in async_llm.generate(
                "A story that never ends", params, request_id="cancelled"
            ):
                started.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), timeout=10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await await_until(lambda: no_blocks_used(async_llm))

    assert asyncio.run(main())
    request = async_llm.engine.get_request("cancelled")
    assert request.finish_reason == "abort" and request.num_output_tokens < 200


def test_bad_requests_fail_at_once(async_llm):
    async def first_item(*args, **kwargs):
        async for out in async_llm.generate(*args, **kwargs):
            return out

    with pytest.raises(InvalidRequestError) as err:
        asyncio.run(first_item("hello", SamplingParams(max_tokens=1000)))
    assert "256" in str(err.value) and err.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError):
        asyncio.run(first_item("", GREEDY))
    # the engine is still serving afterwards
    out = asyncio.run(first_item("still alive", SamplingParams(max_tokens=1, temperature=0.0)))
    assert out.finished and len(out.token_ids) == 1


def test_duplicate_live_request_id_is_refused_without_hurting_the_first(async_llm):
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)

    async def main():
        first = async_llm.generate("one", params, request_id="twin")
        outputs = [await first.__anext__()]
        with pytest.raises(InvalidRequestError):
            async for _ in async_llm.generate("two", GREEDY, request_id="twin"):
                pass
        await asyncio.sleep(0.3)
        assert async_llm.engine.get_request("twin").finish_reason != "abort", (
            "the first caller's request was aborted"
        )
        try:
            async for out in first:  # the first caller's stream goes on to the end
                outputs.append(out)
        finally:
            await first.aclose()
            await await_until(lambda: no_blocks_used(async_llm))
        return outputs

    outputs = asyncio.run(asyncio.wait_for(main(), timeout=20))
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    assert len(outputs[-1].token_ids) == 30


def test_step_listeners_see_every_step_and_cannot_break_the_loop(async_llm):
    seen = []

    def good(record):
        seen.append(record.step)

    def bad(record):
        raise RuntimeError("observer bug")

    async_llm.step_listeners[:] = [bad, good]
    try:

        async def main():
            return [out async for out in async_llm.generate("listen", GREEDY)]

        outputs = asyncio.run(main())
        # listeners run after the step's outputs are handed over: the last call may come a moment
        # later
        assert wait_until(lambda: len(seen) >= 16)
    finally:
        async_llm.step_listeners[:] = []
    assert outputs[-1].finished and len(outputs[-1].token_ids) == 16
    assert seen == sorted(seen) and len(set(seen)) == len(seen)
    assert async_llm.errored is None


def test_is_running_tells_a_live_loop_from_a_dead_or_stopped_one(tiny_model_dir):
    """The server's /health and `serve`'s exit status read this flag."""
    llm = AsyncLLM(model=str(tiny_model_dir), **ENGINE)
    assert llm.is_running and llm.errored is None

    def explode():
        raise RuntimeError("the loop dies")

    llm.engine.has_unfinished_requests, llm.engine.step = (lambda: True), explode
    assert wait_until(lambda: not llm.is_running)
    assert isinstance(llm.errored, RuntimeError)
    with pytest.raises(RuntimeError):
        llm.generate("hi", GREEDY)
    llm.shutdown()
    stopped = AsyncLLM(model=str(tiny_model_dir), **ENGINE)
    stopped.shutdown()
    assert not stopped.is_running and stopped.errored is None
