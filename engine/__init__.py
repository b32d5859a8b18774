"""A small, genuine LLM inference engine shaped like vLLM V1.

The layers (see docs/architecture.md and the README's layout section): the ground floor of plain
data and the control path (config, request, scheduler, kv_cache, output, ...), the data path
(models/, layers/, kernels/, worker/, spec_decode/), executor/, core.py (EngineCore) and the entry
points (entrypoints/: LLM, AsyncLLM, the server, the CLI); tools/ holds the instruments. Heavy
modules load lazily, so `import engine.scheduler` loads no torch."""

from engine.sampling_params import InvalidRequestError, SamplingParams

__all__ = ["LLM", "AsyncLLM", "EngineCore", "EngineConfig", "SamplingParams", "InvalidRequestError"]


def __getattr__(name):  # import torch-heavy modules only when they are used
    if name in ("LLM", "AsyncLLM"):
        from engine.entrypoints import llm

        return getattr(llm, name)
    if name in ("EngineCore", "EngineConfig"):
        from engine import core

        return getattr(core, name)
    raise AttributeError(name)
