"""The docs run: README's Python session is a doctest, and every `$ ` command in the docs
exits 0."""

from __future__ import annotations

import doctest
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_python_snippets_run(doc: Path) -> None:
    """Every Python snippet of the docs is a session that runs as written."""
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)
    assert all(">>> " in block for block in blocks), f"{doc.name} has a Python snippet no test runs"
    result = doctest.testfile(str(doc), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0 or not blocks


def test_the_readme_has_sessions() -> None:
    assert "```python\n>>> " in (ROOT / "README.md").read_text()


def _commands() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for line in doc.read_text().splitlines():
            match = re.match(r"\s*\$ (.+)$", line)
            if match:
                found.append((doc.name, match.group(1)))
    return found


COMMANDS = _commands()


def test_docs_show_commands() -> None:
    assert any(cmd.startswith("kvlayout ") for _, cmd in COMMANDS)


@pytest.mark.parametrize(("doc", "command"), COMMANDS, ids=[f"{d}: {c}" for d, c in COMMANDS])
def test_documented_command_runs(doc: str, command: str, tmp_path: Path) -> None:
    argv = shlex.split(command)
    if argv[0] == "kvlayout":
        argv = [sys.executable, "-m", "kvlayout", *argv[1:]]
    elif argv[0] == "python":
        argv[0] = sys.executable
    else:
        pytest.fail(f"{doc} shows a command this test cannot run: {command}")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}"}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
