"""Single-process DSpark engine (torch; never ray).

``LLM`` generates offline; ``Engine`` is the steppable core a driver wraps; ``SamplingParams``
configures a request.
"""

from runtime.engine import Engine
from runtime.llm import LLM
from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams, StructuredOutputs

__all__ = ["LLM", "Engine", "RequestOutput", "SamplingParams", "StructuredOutputs"]
