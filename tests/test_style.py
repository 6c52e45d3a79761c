"""The code passes ruff's checks configured in pyproject.toml (pyflakes, import order, line length)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUFF = Path(sys.executable).parent / "ruff"


def test_the_code_passes_ruff():
    result = subprocess.run([str(RUFF), "check", "--no-cache", "blockspec", "tests", "benchmarks"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
