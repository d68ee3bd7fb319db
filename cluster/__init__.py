"""The Ray layer: actors, placement, the driver loop, the Serve app and the ``dspark`` CLI.

``from cluster import LLM`` gives the Ray-backed engine (imported on first use, so the CLI's
``--help`` does not pay for importing Ray).
"""


def __getattr__(name: str):
    if name in ("LLM", "ReplicaFailure"):
        from cluster import executor, llm

        return {"LLM": llm.LLM, "ReplicaFailure": executor.ReplicaFailure}[name]
    raise AttributeError(f"module 'cluster' has no attribute {name!r}")


__all__ = ["LLM", "ReplicaFailure"]
