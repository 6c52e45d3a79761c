"""The README's quick start runs as written (commands eagerly, to keep it cheap), and its links resolve."""

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
#: Commands that take --compile: run eagerly here (compiling is the fast path's own tests' business).
COMPILING = {"generate", "bench"}


def quick_start_blocks(language: str) -> list[str]:
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


def quick_start_commands() -> list[list[str]]:
    (block,) = quick_start_blocks("bash")
    commands = []
    for line in block.splitlines():
        argv = shlex.split(line, comments=True)
        assert argv and argv[0] == "blockspec", line
        commands.append(argv[1:] + (["--compile", "off"] if argv[1] in COMPILING else []))
    return commands


def test_the_quick_start_has_commands_and_python():
    assert len(quick_start_commands()) >= 3 and len(quick_start_blocks("python")) == 1


@pytest.mark.real_model
@pytest.mark.parametrize("argv", quick_start_commands(), ids=lambda argv: " ".join(argv[:2]))
def test_each_quick_start_command_runs(argv, tmp_path, monkeypatch, capsys):
    from blockspec.cli import main

    monkeypatch.chdir(tmp_path)  # whatever a command writes lands here
    assert main(argv) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip()


@pytest.mark.real_model
def test_the_quick_start_python_runs(capsys):
    (code,) = quick_start_blocks("python")
    exec(compile(code, "README.md quick start", "exec"), {})
    printed = capsys.readouterr().out.strip()
    assert printed and float(printed.rsplit(maxsplit=1)[-1]) >= 1.0  # the answer, then tau


def test_every_local_link_of_the_readme_and_docs_resolves():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith(("http://", "https://")):
                assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"
