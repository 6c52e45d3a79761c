"""The package's imports go down its layers only, with no cycle: import-linter's contracts in pyproject.toml."""

import os
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(project: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo"], cwd=project,
                          env=dict(os.environ, PYTHONPATH=str(project)),
                          capture_output=True, text=True, timeout=120)


def test_imports_only_go_down_the_layers_and_never_in_a_cycle():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def layer_modules(config: dict) -> list[str]:
    (layers,) = [contract["layers"] for contract in config["contracts"] if contract["type"] == "layers"]
    return [name.strip() for layer in layers for name in layer.split(":")]


def test_the_contracts_refuse_an_upward_import_a_cycle_and_a_module_in_no_layer(tmp_path):
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    section = (ROOT / "pyproject.toml").read_text().split("[tool.importlinter]")[1]
    (tmp_path / "pyproject.toml").write_text("[tool.importlinter]" + section)
    packages = ("models", "decoding")
    files = {f"blockspec/{name}.py": "" for name in layer_modules(config) if name not in packages}
    files.update({
        "blockspec/__init__.py": "",
        "blockspec/models/__init__.py": "",
        "blockspec/models/net.py": "from blockspec.decoding.step import step\n",  # upward
        "blockspec/decoding/__init__.py": "",
        "blockspec/decoding/step.py": "from blockspec.decoding import loop\n",
        # a lazy import: a cycle
        "blockspec/decoding/loop.py": "def run():\n    from blockspec.decoding.step import step\n",
        "blockspec/stray.py": "",
    })
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    result = lint_imports(tmp_path)
    assert result.returncode == 1
    assert "blockspec.models.net -> blockspec.decoding.step" in result.stdout
    assert "No cycles are allowed in blockspec.decoding" in result.stdout
    assert "- blockspec.stray" in result.stdout
