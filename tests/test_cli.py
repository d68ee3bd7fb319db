"""The dspark command line: help, config checks, clear errors for bad input."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    assert "check-config" in capsys.readouterr().out


def test_every_commands_help_renders(capsys):
    """Each command's --help, whose flags' texts come from the config fields' descriptions (a '%' in one is text)."""
    from cluster.cli import build_parser

    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    for name in commands:
        with pytest.raises(SystemExit) as exit_:
            main([name, "--help"])
        assert exit_.value.code == 0, name
    assert "60% of what the device has" in " ".join(capsys.readouterr().out.split())


def test_version(capsys):
    import importlib.metadata

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"dspark {importlib.metadata.version('dspark')}"


def test_check_config_prints_the_resolved_examples(capsys, monkeypatch):
    """Both examples validate as shipped; the drafter named smollm2-dspark fills its fields from the checkpoint."""
    monkeypatch.chdir(ROOT)
    assert main(["check-config", "examples/dspark.yaml"]) == 0
    resolved = json.loads(capsys.readouterr().out)
    spec = resolved["speculative_config"]
    assert spec["max_draft_len"] == 7 and spec["mask_token_id"] == 16 and spec["target_layer_ids"] == [1, 8, 14, 21, 27]
    assert spec["draft_is_embedded_in_target"] is False and spec["speculative_model"].endswith("smollm2-dspark")
    assert main(["check-config", "examples/serve.yaml"]) == 0
    served = json.loads(capsys.readouterr().out)
    assert served["deployment"]["max_waiting_requests"] == 32 and served["parallel"]["ray_address"] == "local"


def test_bad_config_exits_2_naming_the_field(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("model: m\nmax_num_seqs: 0\n")
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "max_num_seqs" in err and "greater than 0" in err


def test_unknown_subcommand_fails_cleanly():
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "serve-forever"], capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


# ---- regenerate (in process) -------------------------------------------------------------------

DATASET_ROWS = [{"prompt_ids": [5, 6, 7]}, {"prompt": "def main():"},
                {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "old answer"}]}]


def test_regenerate_answers_a_datasets_prompts_as_plain_greedy_decoding(qwen3_target, tmp_path, capsys):
    from transformers import AutoTokenizer

    from runtime import LLM, SamplingParams

    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "answers.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in DATASET_ROWS))
    assert main(["regenerate", "--target", str(qwen3_target), "--out", str(out), "--prompts", str(prompts),
                 "--max-tokens", "6", "--device", "cpu", "--dtype", "float32"]) == 0
    assert json.loads(capsys.readouterr().out) == {"rows": 3, "out": str(out)}
    tok = AutoTokenizer.from_pretrained(str(qwen3_target))
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    expected_prompts = [[5, 6, 7], tok("def main():")["input_ids"], tok(chat, add_special_tokens=False)["input_ids"]]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt_ids"] for r in rows] == expected_prompts  # the old assistant turn is not in the prompt
    plain = LLM(str(qwen3_target), dtype="float32", device="cpu").generate(
        expected_prompts, SamplingParams(max_tokens=6, temperature=0.0))
    assert [r["response_ids"] for r in rows] == [o.token_ids for o in plain]


@pytest.mark.parametrize("row, flags, message", [
    ({"question": "x"}, [], "prompts.jsonl:1: each row needs 'prompt_ids'"),
    ({"prompt_ids": []}, [], "'prompt_ids' must be a non-empty list"),
    ({"messages": [{"role": "assistant", "content": "a"}]}, [], "no turn before the assistant's"),
    ({"prompt": "x"}, ["--prompt-tokens", "8"], "do not go with --prompts"),
    ({"prompt": "x"}, ["--num-prompts", "0"], "argument --num-prompts: wants an integer >= 1, got '0'"),
    ({"prompt": "x"}, ["--max-num-seqs", "0"], "max_num_seqs"),
    ({"prompt": "x"}, ["--max-tokens", "0"], "SamplingParams.max_tokens"),
])
def test_regenerate_refuses_bad_prompts_and_flags(qwen3_target, tmp_path, capsys, row, flags, message):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(row) + "\n")
    try:
        code = main(["regenerate", "--target", str(qwen3_target), "--out", str(tmp_path / "o.jsonl"), "--prompts",
                     str(prompts), "--device", "cpu", *flags])
    except SystemExit as exc:  # argparse refuses a flag's value before any handler runs
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize("argv,needle", [
    (["serve", "--model", "/nonexistent"], "--model: '/nonexistent' is neither a local directory or file, a known name"),
    (["generate", "hi", "--model", "/nonexistent"], "--model: '/nonexistent' is neither a local directory or file"),
    (["train-drafter", "--target", "t", "--data", "d", "--out", "o", "--block-size", "0"], "block_size"),
    (["train-target", "--out", "o", "--vocab-size", "10"], "vocab_size"),
    (["train-target", "--out", "o", "--num-workers", "0"], "argument --num-workers: wants an integer >= 1"),
    (["bench", "--model-shape", "tiny", "--concurrency", "1,0"], "--concurrency wants integers >= 1"),
    (["bench", "--model", "m"], "--model needs --speculative-model"),
    (["bench", "--model-shape", "tiny", "--steps", "0"], "argument --steps: wants an integer >= 1, got '0'"),
    (["bench", "--model-shape", "tiny", "--mixed-rate", "nan"], "argument --mixed-rate: wants a number >= 0"),
    (["bench", "--model-shape", "tiny", "--mixed-requests", "0"], "argument --mixed-requests: wants an integer >= 1"),
    (["bench", "--model-shape", "tiny", "--kv-cache-memory", "0"], "argument --kv-cache-memory: wants a size of at "
     "least 1 byte"),
    (["bench", "--model-shape", "tiny", "--kv-cache-memory", "lots"], "wants bytes, or a number with a unit"),
    (["bench", "--model-shape", "tiny", "--kv-cache-gib", "0"], "argument --kv-cache-gib: wants a number > 0"),
    (["bench", "--model-shape", "tiny", "--device", "gpu"], "argument --device: wants one of auto, cpu, cuda, cuda:N"),
    (["serve", "--moe-backend", "CUTLASS"], "argument --moe-backend: CUTLASS: FlashInfer's CUTLASS fused MoE is not "
     "wired"),
    (["bench", "--model-shape", "tiny", "--moe-backend", "FAST"], "wants one of AUTO, VANILLA, DENSEGEMM, TRITON"),
    (["serve", "--gpu-memory-utilization", "1.5"], "argument --gpu-memory-utilization: wants a fraction in (0, 1]"),
    (["serve", "--gpu-memory-utilization", "0.5", "--kv-cache-memory", "1GiB"], "not allowed with argument"),
    (["serve", "--gpu-memory-utilization", "0.5", "--device", "cpu"], "gpu_memory_utilization needs a CUDA device"),
    (["serve", "--device", "tpu"], "argument --device: wants one of auto, cpu, cuda, cuda:N"),
    (["bench", "--model-shape", "tiny", "--e2e-prompts", "-1"], "argument --e2e-prompts: wants an integer >= 0"),
    (["serve", "--port", "70000"], "argument --port: wants an integer in [1, 65535], got '70000'"),
    (["serve", "--drain-timeout", "-1"], "argument --drain-timeout: wants a number >= 0, got '-1'"),
    # without --model the demo pair (smollm2 and its drafter): every other value is checked before it is loaded
    (["serve", "--max-num-seqs", "0"], "engine.max_num_seqs"),
    (["serve", "--num-replicas", "0"], "deployment.num_replicas"),
    (["generate", "hi", "--max-tokens", "0"], "SamplingParams.max_tokens"),
    (["generate", "hi", "--temperature", "-1"], "SamplingParams.temperature"),
    (["serve", "smollm2", "--model", "other"], "the model is given twice: MODEL 'smollm2' and --model 'other'"),
    (["serve", "/nonexistent.gguf"], "--model: '/nonexistent.gguf' is neither a local directory or file"),
    (["regenerate", "--target", "/nonexistent", "--out", "o.jsonl"],
     "--target: /nonexistent is not a Hugging Face checkpoint directory (no config.json)"),
])
def test_bad_serve_and_generate_input(capsys, monkeypatch, argv, needle):
    def no_resolution(*args):
        raise AssertionError("a bad flag must fail before any checkpoint is resolved")

    if "--model" not in argv and not any(a.endswith(".gguf") for a in argv):
        monkeypatch.setattr("runtime.models.hub.resolve_hub_ids", no_resolution)
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse refuses a flag's value before any handler runs
        code = exc.code
    assert code == 2
    assert needle in capsys.readouterr().err


def test_every_flag_is_documented():
    from cluster.cli import build_parser

    parser = build_parser()
    for action in parser._subparsers._group_actions[0].choices.values():
        for flag in action._actions:
            assert flag.help, f"{action.prog} {flag.option_strings or flag.dest} has no help"


def test_the_api_key_comes_from_a_flag_a_file_or_the_environment(qwen3_target, tmp_path, monkeypatch):
    from cluster.cli import MODEL_FLAGS, SERVE_FLAGS, build_parser, serve_args

    def key(*argv):
        args = build_parser().parse_args(["serve", "--model", str(qwen3_target), *argv])
        return serve_args(args, {**MODEL_FLAGS, **SERVE_FLAGS}).api_key

    keyfile = tmp_path / "key"
    keyfile.write_text("from-file\n")
    monkeypatch.delenv("DSPARK_API_KEY", raising=False)
    assert key() is None and key("--api-key", "flag") == "flag" and key("--api-key-file", str(keyfile)) == "from-file"
    monkeypatch.setenv("DSPARK_API_KEY", "from-env")
    assert key() == "from-env" and key("--api-key", "flag") == "flag" and key("--api-key-file", str(keyfile)) == \
        "from-file"
    with pytest.raises(SystemExit):  # one source of the key on the command line
        key("--api-key", "a", "--api-key-file", str(keyfile))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SystemExit, match="is empty"):
        key("--api-key-file", str(tmp_path / "empty"))


def test_the_tool_call_parser_comes_from_the_flag_or_the_config(qwen3_target, tmp_path):
    from cluster.cli import MODEL_FLAGS, SERVE_FLAGS, build_parser, serve_args
    from configs import ConfigError, ServeArgs, validate

    def parser(*argv):
        args = build_parser().parse_args(["serve", "--model", str(qwen3_target), *argv])
        return serve_args(args, {**MODEL_FLAGS, **SERVE_FLAGS}).tool_call_parser

    config = tmp_path / "serve.yaml"
    config.write_text("tool_call_parser: hermes\n")
    assert parser() is None and parser("--tool-call-parser", "hermes") == "hermes"
    assert parser("--config", str(config)) == "hermes"
    with pytest.raises(SystemExit):  # argparse names the choices
        parser("--tool-call-parser", "mistral")
    with pytest.raises(ConfigError, match="tool_call_parser"):
        validate(ServeArgs, {"engine": {"model": "m"}, "tool_call_parser": "mistral"}, "args")


def test_a_429_that_could_never_be_sent_is_refused():
    from configs import ConfigError, ServeArgs, validate

    with pytest.raises(ConfigError, match="max_waiting_requests .* must be below max_ongoing_requests"):
        validate(ServeArgs, {"engine": {"model": "m"}, "deployment": {"max_ongoing_requests": 64,
                                                                       "max_waiting_requests": 64}}, "args")


def test_prefill_apart_and_piecewise_graphs_are_serve_flags(qwen3_target):
    from cluster.cli import MODEL_FLAGS, SERVE_FLAGS, build_parser, serve_args

    def engine(*argv):
        args = build_parser().parse_args(["serve", "--model", str(qwen3_target), *argv])
        return serve_args(args, {**MODEL_FLAGS, **SERVE_FLAGS}).engine

    assert engine().enable_mixed_prefill and not engine("--no-enable-mixed-prefill").enable_mixed_prefill
    assert engine().piecewise_cuda_graphs and not engine("--no-piecewise-cuda-graphs").piecewise_cuda_graphs
    assert engine().generation_config == "auto" and engine("--generation-config", "none").generation_config == "none"


def test_idle_parking_is_a_serve_flag(qwen3_target, capsys):
    from cluster.cli import MODEL_FLAGS, SERVE_FLAGS, build_parser, serve_args

    def parallel(*argv):
        args = build_parser().parse_args(["serve", "--model", str(qwen3_target), *argv])
        return serve_args(args, {**MODEL_FLAGS, **SERVE_FLAGS}).parallel

    assert parallel().idle_park_s == 2.0 and parallel("--idle-park-s", "0.5").idle_park_s == 0.5
    assert parallel("--idle-park-s", "never").idle_park_s is None
    for bad in ("0", "soon"):
        with pytest.raises(SystemExit):
            parallel("--idle-park-s", bad)
        assert "argument --idle-park-s: wants a number > 0" in capsys.readouterr().err


@pytest.mark.parametrize("text,size", [("1073741824", 1 << 30), ("16GiB", 16 << 30), ("512MiB", 512 << 20),
                                       ("0.5GB", 500_000_000), ("50MiB", 50 << 20), ("2g", 2_000_000_000)])
def test_memory_sizes_take_bytes_or_a_unit(text, size):
    from cluster.arg_types import memory_size

    assert memory_size(text) == size


def test_the_memory_flags_reach_the_engine_config():
    from cluster.cli import MODEL_FLAGS, SERVE_FLAGS, build_parser, serve_args

    args = build_parser().parse_args(["serve", "--kv-cache-memory", "2GiB", "--device", "cpu"])
    assert serve_args(args, {**MODEL_FLAGS, **SERVE_FLAGS}).engine.kv_cache_memory == 2 << 30
    args = build_parser().parse_args(["serve", "--gpu-memory-utilization", "0.8"])
    assert serve_args(args, {**MODEL_FLAGS, **SERVE_FLAGS}).engine.gpu_memory_utilization == 0.8


AVX512_BF16_CPU = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 avx512_vnni\n"
AMX_CPU = "processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile\n"
ARM_BF16_CPU = "processor\t: 0\nFeatures\t: fp asimd sve i8mm bf16\n"
AVX512_CPU = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni\n"


def test_the_cpus_bfloat16_instructions_are_read_from_cpuinfo():
    from runtime.worker.devices import cpu_bfloat16_flag

    assert cpu_bfloat16_flag(AVX512_BF16_CPU) == "avx512_bf16"
    assert cpu_bfloat16_flag(AMX_CPU) == "amx_bf16"
    assert cpu_bfloat16_flag(ARM_BF16_CPU) == "bf16"
    assert cpu_bfloat16_flag(AVX512_CPU) is None
    assert cpu_bfloat16_flag("") is None


def test_the_demo_runs_in_bfloat16_on_a_cpu_that_multiplies_it_natively(qwen3_target, monkeypatch, capsys):
    """Without a model (the demo) and without --dtype, a CPU with bfloat16 instructions serves in bfloat16 and says
    so; any other CPU, a GPU, a given --dtype or a given model keep auto's choice."""
    from cluster.cli import MODEL_FLAGS, SERVE_FLAGS, build_parser, serve_args
    from runtime.worker import devices

    monkeypatch.setattr("runtime.models.hub.resolve_hub_ids", lambda engine, flags: engine)  # (names stay names)
    read = devices.cpu_bfloat16_flag

    def dtype(cpuinfo, *argv, cuda=False):
        monkeypatch.setattr(devices, "cpu_bfloat16_flag", lambda: read(cpuinfo))
        monkeypatch.setattr("torch.cuda.is_available", lambda: cuda)
        args = build_parser().parse_args(["serve", *argv])
        return serve_args(args, {**MODEL_FLAGS, **SERVE_FLAGS}).engine.dtype

    assert dtype(AVX512_BF16_CPU) == "bfloat16"
    assert "the demo runs in bfloat16, which this CPU multiplies natively (avx512_bf16)" in capsys.readouterr().err
    assert dtype(ARM_BF16_CPU, "--device", "cpu") == "bfloat16" and "natively (bf16)" in capsys.readouterr().err
    assert dtype(AVX512_CPU) == "auto" and dtype(AVX512_CPU, "--device", "cpu") == "auto"
    assert dtype(AVX512_BF16_CPU, cuda=True) == "auto"  # (a GPU: auto is bfloat16 there)
    assert dtype(AVX512_BF16_CPU, "--dtype", "float32") == "float32"
    assert dtype(AVX512_BF16_CPU, "--model", str(qwen3_target)) == "auto"
    assert "bfloat16" not in capsys.readouterr().err


def test_generate_sends_the_prompt_as_it_is_or_as_a_chat_turn(qwen3_target, tmp_path):
    from transformers import AutoTokenizer

    from cluster.cli import build_parser, generate_prompt

    tok = AutoTokenizer.from_pretrained(str(qwen3_target))
    assert generate_prompt(tok, "def main():", chat=False) == "def main():"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert generate_prompt(tok, "hi", chat=True) == tok(chat, add_special_tokens=False)["input_ids"]
    assert build_parser().parse_args(["generate", "hi", "--chat"]).chat
    tok.chat_template = None
    with pytest.raises(ValueError, match="this model has no chat template"):
        generate_prompt(tok, "hi", chat=True)
