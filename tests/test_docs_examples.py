"""The README's examples run as written, so the docs cannot drift from the code.

- Every ```python block of README.md, in order, is one script run verbatim under
  torchrun with the process count the README names (``torchrun --nproc-per-node N``).
  Blocks of docs/*.md whose info string is ``python run`` are run the same way, one
  process each.
- Every ``fxpipe`` command in a shell block of the README, docs/cli.md or docs/training.md
  (``$ fxpipe ...``, ``.venv/bin/fxpipe ...``, ``fxpipe ...``) must parse with the real argument parser; the quick ones (``viz``,
  ``compile``) are also executed. Scripts named by ``bash X`` must exist.
"""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fxpipe.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.S | re.M)


def _blocks(path: Path) -> list[tuple[str, str]]:
    return [(m.group(1).strip(), m.group(2)) for m in FENCE.finditer(path.read_text())]


def _fxpipe_commands(text: str, prompted_only: bool) -> list[list[str]]:
    """argv (after ``fxpipe``) of every fxpipe command line in a shell block; in a block
    that mixes commands and their output, only the ``$ `` lines are commands."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if prompted_only and not line.startswith("$ "):
            continue
        line = line.removeprefix("$ ")
        for part in line.split("&&"):
            part = part.strip()
            if not part.startswith(("fxpipe ", ".venv/bin/fxpipe", "bash ")):
                continue  # command output, or another program
            words = shlex.split(part)
            if words[0] == "bash":
                assert (ROOT / words[1]).is_file(), f"README runs {words[1]}, which does not exist"
            else:
                out.append(words[1:])
    return out


COMMAND_PAGES = ("README.md", "docs/cli.md", "docs/training.md")


def _readme_commands() -> list[list[str]]:
    """Each command once, in the order the pages show them."""
    seen: dict[tuple[str, ...], list[str]] = {}
    for page in COMMAND_PAGES:
        for info, text in _blocks(ROOT / page):
            if info in ("", "bash", "sh", "console"):
                for argv in _fxpipe_commands(text, prompted_only=info in ("", "console")):
                    seen.setdefault(tuple(argv), argv)
    return list(seen.values())


def test_readme_has_examples():
    commands = _readme_commands()
    assert any(argv[:1] == ["run"] for argv in commands)
    assert sum(info == "python" for info, _ in _blocks(ROOT / "README.md")) >= 1


@pytest.mark.parametrize("argv", _readme_commands(), ids=lambda a: " ".join(a)[:60])
def test_readme_command_parses(argv):
    args = build_parser().parse_args(argv)  # SystemExit on an unknown flag or a bad value
    assert args.command == argv[0]


@pytest.mark.parametrize("argv", [a for a in _readme_commands() if a[0] in ("viz", "compile")],
                         ids=lambda a: " ".join(a)[:60])
def test_readme_quick_commands_run(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outputs such as docs/img/x.png land in tmp
    for i, word in enumerate(argv):
        if i and argv[i - 1] in ("-o", "--output"):
            (tmp_path / word).parent.mkdir(parents=True, exist_ok=True)
    assert main(list(argv)) == 0


def _readme_script() -> tuple[str, int]:
    text = (ROOT / "README.md").read_text()
    nproc = re.search(r"torchrun --nproc-per-node (\d+) script\.py", text)
    assert nproc, "the README says how to launch its Python example"
    code = "\n".join(body for info, body in _blocks(ROOT / "README.md") if info == "python")
    return code, int(nproc.group(1))


@pytest.mark.slow
def test_readme_python_example_runs_under_torchrun(tmp_path):
    code, nproc = _readme_script()
    script = tmp_path / "script.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                           str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1",
                               "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-4000:]


def _docs_runnable() -> list[tuple[str, str]]:
    return [(f"{p.name}:{i}", body) for p in sorted((ROOT / "docs").glob("*.md"))
            for i, (info, body) in enumerate(_blocks(p)) if info == "python run"]


@pytest.mark.parametrize("name,code", _docs_runnable() or [pytest.param("", "", marks=pytest.mark.skip)])
def test_docs_runnable_blocks(name, code, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
