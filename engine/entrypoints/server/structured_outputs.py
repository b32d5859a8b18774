"""Structured outputs at the API: which constraint a body asks for (OpenAI's `response_format`
or vLLM's `structured_outputs`), and its compilation off the event loop, bounded in time."""

from __future__ import annotations

import asyncio
import concurrent.futures

from engine.entrypoints.server.protocol import SamplingFields, bad_request
from engine.sampling_params import InvalidRequestError, SamplingParams, StructuredOutputsParams

# A grammar is compiled on its own threads, never on the event loop, and a compilation that takes
# longer than this is answered with a 400 (llguidance's own fuel limits end it soon after; the
# cached result serves the next identical request).
GRAMMAR_COMPILE_TIMEOUT_S = 5.0
GRAMMAR_COMPILE_THREADS = 2


def structured_outputs_of(body: SamplingFields) -> tuple[StructuredOutputsParams | None, str]:
    """The request's constraint and the field it came from (for an error's `param`):
    `response_format` (OpenAI) or `structured_outputs` (vLLM), never both."""
    rf, so = body.response_format, body.structured_outputs
    if rf is not None and rf.type != "text" and so is not None:
        raise InvalidRequestError(
            "send either response_format or structured_outputs, not both", "response_format"
        )
    if so is not None:
        return StructuredOutputsParams(**so.model_dump(by_alias=True)), "structured_outputs"
    if rf is None or rf.type == "text":
        return None, "response_format"
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True), "response_format"
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise InvalidRequestError(
            "response_format of type json_schema needs json_schema.schema", "response_format"
        )
    return StructuredOutputsParams(json=rf.json_schema.schema_), "response_format"


class GrammarCompiler:
    """Compiles requests' constraints into the engine's cache before the engine sees them."""

    def __init__(self, engine):
        self.manager = engine.structured_output_manager
        self.pool = concurrent.futures.ThreadPoolExecutor(
            GRAMMAR_COMPILE_THREADS, thread_name_prefix="grammar-compile"
        )

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def compile(self, body: SamplingFields, params: SamplingParams) -> None:
        """A schema, regex or grammar the backend refuses (or that takes too long) gets a 400
        naming the problem, while other clients are served."""
        constraint = params.structured_outputs
        if constraint is None:
            return
        param = "structured_outputs" if body.structured_outputs is not None else "response_format"
        future = asyncio.get_running_loop().run_in_executor(
            self.pool, self.manager.compile, constraint
        )
        try:
            await asyncio.wait_for(future, GRAMMAR_COMPILE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise bad_request(
                f"the {constraint.kind} could not be compiled within "
                f"{GRAMMAR_COMPILE_TIMEOUT_S:g} s; simplify it",
                param,
            ) from None
        except InvalidRequestError as exc:
            raise bad_request(str(exc), param) from None
