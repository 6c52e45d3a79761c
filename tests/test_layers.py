"""The package's imports go down its layers only, with no cycle (scripts/check_imports.py)."""

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECK = runpy.run_path(str(ROOT / "scripts" / "check_imports.py"))


def test_imports_only_go_down_the_layers_and_never_in_a_cycle():
    assert CHECK["problems"](ROOT) == []


def test_the_check_finds_an_upward_import_and_a_cycle(tmp_path):
    package = tmp_path / "blockspec"
    for name, text in {
        "__init__.py": "",
        "errors.py": "",
        "models/__init__.py": "",
        "models/net.py": "from blockspec.decoding.step import step\n",  # upward
        "decoding/__init__.py": "",
        "decoding/step.py": "from blockspec.decoding import loop\n",
        "decoding/loop.py": "def run():\n    from blockspec.decoding.step import step\n",  # a lazy import: a cycle
        "stray.py": "",
    }.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    found = CHECK["problems"](tmp_path)
    assert "upward import: blockspec.models.net imports blockspec.decoding.step" in found
    assert "import cycle: blockspec.decoding.loop -> blockspec.decoding.step" in found
    assert any(line.startswith("blockspec.stray belongs to no layer") for line in found)
