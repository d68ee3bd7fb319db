"""The engine: requests in, steps run, outputs out (``core.Engine``), its offline and asyncio front ends (``llm.LLM``, ``async_engine.AsyncEngine``), the executor protocol, outputs and metrics."""
