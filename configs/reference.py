"""The configuration reference in Markdown, rendered from the models themselves (``docs/configuration.md`` holds
it between two markers; ``python -m configs.reference --write docs/configuration.md`` renders it again, and a test
fails when the file and the models differ)."""

from __future__ import annotations

import argparse
import enum
import sys
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from configs.cluster import ParallelConfig
from configs.engine import LLMConfig
from configs.serve import AutoscalingOptions, DeploymentOptions, ServeArgs
from configs.speculative import DSparkDecodingConfig
from configs.training import DrafterTrainConfig, TargetTrainConfig

BEGIN = "<!-- reference: rendered by `python -m configs.reference --write docs/configuration.md` -->"
END = "<!-- end of reference -->"

# (heading, model, where it is used)
SECTIONS: list[tuple[str, type[BaseModel], str]] = [
    ("Engine: `configs.LLMConfig`", LLMConfig,
     "`runtime.LLM(...)` / `cluster.LLM(...)` keywords, an engine config file, `dspark serve` flags"),
    ("Speculation: `configs.DSparkDecodingConfig`", DSparkDecodingConfig,
     "`speculative_config` of the engine config (TensorRT-LLM's API page, field by field, plus extensions)"),
    ("Replica layout: `configs.ParallelConfig`", ParallelConfig,
     "`cluster.LLM(...)` keywords, `parallel` in ServeArgs"),
    ("Server: `configs.ServeArgs`", ServeArgs, "`dspark serve --config FILE` (flags override it)"),
    ("Serve deployment: `configs.DeploymentOptions`", DeploymentOptions, "`deployment` in ServeArgs"),
    ("Autoscaling: `configs.serve.AutoscalingOptions`", AutoscalingOptions, "`deployment.autoscaling_config`"),
    ("Drafter training: `configs.training.DrafterTrainConfig`", DrafterTrainConfig, "`dspark train-drafter`"),
    ("Target training: `configs.training.TargetTrainConfig`", TargetTrainConfig, "`dspark train-target`"),
]


def type_name(annotation) -> str:
    """A field's type as a reader writes it (``int | None``, ``'a' | 'b'``, ``dict[int, int]``)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is not None:
        inner = ", ".join(type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " | ".join(repr(m.value) for m in annotation)
    return getattr(annotation, "__name__", str(annotation))


def default_text(field) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, BaseModel):
        return "(its defaults)"
    return f"`{value!r}`"


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    """Every model's fields: name, type, default, description."""
    out = [BEGIN, ""]
    for heading, model, used in SECTIONS:
        out += [f"### {heading}", "", f"Used by: {used}.", "", "| field | type | default | description |",
                "| --- | --- | --- | --- |"]
        for name, field in model.model_fields.items():
            if field.exclude:
                continue
            out.append(f"| `{name}` | {cell(type_name(field.annotation))} | {cell(default_text(field))} | "
                       f"{cell(field.description or '')} |")
        out.append("")
    out.append(END)
    return "\n".join(out)


def splice(document: str) -> str:
    """``document`` with the text between the markers replaced by ``render()``."""
    start, stop = document.index(BEGIN), document.index(END) + len(END)
    return document[:start] + render() + document[stop:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", type=Path, help="rewrite the reference inside this Markdown file")
    args = parser.parse_args(argv)
    if args.write is None:
        print(render())
    else:
        args.write.write_text(splice(args.write.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
