"""Imports flow one way: configs <- runtime.kernels <- runtime <- bench <- cluster."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_import_linter_contracts_hold():
    from importlinter.cli import lint_imports

    assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), cache_dir=None) == 0


def test_kernels_import_nothing_from_the_rest_of_runtime_or_above():
    for path in (ROOT / "runtime" / "kernels").rglob("*.py"):
        for name in imported_modules(path):
            top = name.split(".")[0]
            assert top != "cluster", f"{path}: imports {name}"
            assert top != "runtime" or name.startswith("runtime.kernels"), f"{path}: imports {name}"


def run_isolated(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_configs_loads_without_torch_or_ray():
    run_isolated("import sys, configs, configs.files; "
                 "bad = {'torch', 'ray', 'transformers'} & {m.split('.')[0] for m in sys.modules}; "
                 "assert not bad, bad")


def test_runtime_imports_without_ray_flashinfer_or_triton():
    blocker = ("import sys\n"
               "class Block:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] in ('ray', 'flashinfer', 'triton'):\n"
               "            raise ImportError('blocked ' + name)\n"
               "sys.meta_path.insert(0, Block())\n")
    run_isolated(blocker + "import runtime, runtime.kernels\n")
