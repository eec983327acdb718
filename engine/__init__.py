"""The process users start: engine loop, request lifecycle, tokenizer, CLI, and the Python API.

    from engine import LLM, SamplingParams
"""

from scheduler.types import InvalidRequest, SamplingParams

from engine.llm import LLM, GenerateResult

__all__ = ["LLM", "SamplingParams", "GenerateResult", "InvalidRequest"]
