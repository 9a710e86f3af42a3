"""fxpipe.schedules is pure data: no torch at all (fxpipe's own __init__
imports torch, so we check the sources rather than sys.modules), and
matplotlib only inside the Gantt renderer's functions."""
import ast
import pathlib

import fxpipe.schedules

ROOT = pathlib.Path(fxpipe.schedules.__file__).parent


def imports(tree, top_level_only):
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module


def test_no_torch_and_lazy_matplotlib():
    files = sorted(ROOT.rglob("*.py"))
    assert len(files) >= 15
    for path in files:
        tree = ast.parse(path.read_text())
        assert not [m for m in imports(tree, False) if m.split(".")[0] == "torch"], path
        assert not [m for m in imports(tree, True) if m.split(".")[0] == "matplotlib"], path


def test_files_stay_small():
    for path in ROOT.rglob("*.py"):
        assert len(path.read_text().splitlines()) <= 300, path
