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


def test_check_config_prints_the_resolved_example(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["check-config", "examples/dspark.yaml"]) == 0
    resolved = json.loads(capsys.readouterr().out)
    spec = resolved["speculative_config"]
    assert spec["max_draft_len"] == 4 and spec["mask_token_id"] == 511 and spec["target_layer_ids"] == [0, 2]
    assert spec["draft_is_embedded_in_target"] is False


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
