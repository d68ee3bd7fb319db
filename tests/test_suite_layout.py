"""The suite's own layout: every test that starts Ray lives in one of ``tests/conftest.py``'s RAY_FILES (they run in
one xdist worker, one after another), and a ``ray``-marked test elsewhere stops the run."""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import RAY_FILES, pytest_collection_modifyitems

ROOT = Path(__file__).resolve().parents[1]


def test_every_file_that_starts_ray_in_process_is_a_ray_file():
    """(A test whose child process starts Ray carries the ``ray`` mark, which the next test holds to the files.)"""
    starts_ray = re.compile(r"ray\.init\(|from cluster import LLM|cluster\.LLM\(")
    found = {str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")
             if path.name != "test_suite_layout.py" and starts_ray.search(path.read_text())}
    assert found and found <= set(RAY_FILES), sorted(found - set(RAY_FILES))


def test_a_ray_marked_test_outside_the_ray_files_is_a_usage_error():
    stray = SimpleNamespace(keywords={"ray": True}, nodeid="tests/test_elsewhere.py::test_x")
    with pytest.raises(pytest.UsageError, match="tests/test_elsewhere.py::test_x"):
        pytest_collection_modifyitems(None, [stray])
    inside = SimpleNamespace(keywords={"ray": True}, nodeid="tests/test_cli_ray.py::test_x", add_marker=lambda m: None)
    pytest_collection_modifyitems(None, [inside])  # accepted
