"""A small, genuine LLM inference engine shaped like vLLM V1 (see DESIGN.md)."""

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
