"""Single-process DSpark engine (torch; never ray).

``LLM`` generates offline; ``Engine`` is the steppable core a driver wraps; ``SamplingParams``
configures a request.
"""

from runtime.engine.core import Engine
from runtime.engine.llm import LLM
from runtime.engine.outputs import RequestOutput
from runtime.sampling.sampling_params import SamplingParams, StructuredOutputs

__all__ = ["LLM", "Engine", "RequestOutput", "SamplingParams", "StructuredOutputs"]
