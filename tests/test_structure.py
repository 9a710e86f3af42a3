"""The structure, read from the sources (cheap: ast and grimp, no capture): folders are
layers with no import cycle between modules; the compiler/runtime boundary.

One compiled artifact crosses it (``fxpipe/ir/artifact.py``): the runtime imports no pass
and no compile pipeline; pass results are typed Program fields, not string keys; one
definition per concept (schedule enum, partition-method check, shard contract)."""
import ast
import dataclasses
import functools
import inspect
import pathlib

import fxpipe
import grimp
import networkx as nx

ROOT = pathlib.Path(fxpipe.__file__).parent


@functools.lru_cache(maxsize=None)
def _tree(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text())


def _imports(path: pathlib.Path):
    """Every module ``path`` imports, at any depth (function-level imports included)."""
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.level == 0:
                yield node.module
            else:  # a relative import, resolved against the file's package
                package = path.relative_to(ROOT.parent).with_suffix("").parts[:-node.level]
                yield ".".join((*package, node.module))


def _classes(name: str) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in sorted(ROOT.rglob("*.py"))
            for n in ast.walk(_tree(p)) if isinstance(n, ast.ClassDef) and n.name == name]


def test_runtime_imports_no_pass_and_no_compiler():
    runtime = sorted((ROOT / "runtime").glob("*.py"))
    assert len(runtime) >= 15
    bad = {str(p.relative_to(ROOT)): m for p in runtime for m in _imports(p)
           if m.startswith(("fxpipe.passes", "fxpipe.compiler.pipeline"))}
    assert not bad, f"runtime modules importing the compiler: {bad}"


def test_pass_results_are_typed_fields_not_string_keys():
    from fxpipe.ir.program import Program

    fields = {f.name for f in dataclasses.fields(Program)}
    assert "extra" not in fields
    assert {"tensor_parallel", "matmul_splits", "loss_splits", "partition", "partition_config",
            "model_stats", "token_inputs"} <= fields
    # And nothing reads one back by its old key.
    readers = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
               if any(isinstance(n, ast.Attribute) and n.attr == "extra"
                      and isinstance(n.value, ast.Name) and n.value.id in ("program", "prog", "plan", "out")
                      for n in ast.walk(_tree(p)))]
    assert not readers


def test_one_definition_per_concept():
    assert _classes("ScheduleKind") == ["schedules/registry.py"]
    assert _classes("ShardSpec") == ["ir/shard_spec.py"]
    assert _classes("CompiledPipeline") == ["ir/artifact.py"]
    from fxpipe.ir.parallel_config import ScheduleKind as layout_kind
    from fxpipe.planner import ScheduleKind as planner_kind
    from fxpipe.schedules import ScheduleKind
    assert layout_kind is planner_kind is ScheduleKind
    # The partition method's name is checked in one function, Method.parse (NamedEnum.parse).
    checks = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
              if '"partition method"' in p.read_text() or "unknown partition method" in p.read_text()]
    assert checks == ["partition/result.py"]


def test_compiled_pipeline_is_frozen_and_parallelize_is_short():
    from fxpipe.ir.artifact import CompiledPipeline
    from fxpipe.parallel import parallelize

    assert CompiledPipeline.__dataclass_params__.frozen
    assert {"plan", "actions", "schedule", "config", "timings"} <= {f.name for f in dataclasses.fields(CompiledPipeline)}
    lines = inspect.getsource(parallelize).splitlines()
    assert len(lines) <= 60, len(lines)
    body = "\n".join(lines)
    assert "compile_pipeline(" in body and "build_runtime(" in body


def test_microbatches_keyword_is_the_num_microbatches_field():
    from fxpipe.ir.parallel_config import ParallelConfig

    config = ParallelConfig(microbatches=4, costs="model")
    assert config.num_microbatches == 4
    assert dataclasses.replace(config, microbatches=8).num_microbatches == 8
    assert dataclasses.replace(config, tp=2).num_microbatches == 4
    assert not hasattr(config, "microbatches")  # one name inside


@functools.lru_cache(maxsize=None)
def _import_graph() -> nx.DiGraph:
    """Every import between fxpipe's modules, as grimp reads them: at module level, inside
    functions and under TYPE_CHECKING (the same graph `lint-imports` checks layers on)."""
    graph = grimp.build_graph("fxpipe", exclude_type_checking_imports=False)
    g = nx.DiGraph()
    for module in graph.modules:
        g.add_node(module)
        g.add_edges_from((module, m) for m in graph.find_modules_directly_imported_by(module))
    return g


def test_no_import_cycle_between_modules():
    g = _import_graph()
    assert g.number_of_nodes() > 150 and g.number_of_edges() > 500  # the graph was read
    cycles = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    assert not cycles, f"modules importing each other, directly or around a circle: {cycles}"


def test_no_import_cycle_between_folders():
    def folder(m: str) -> str:
        return m.split(".")[1] if m.count(".") >= 1 else m
    g = nx.DiGraph()
    g.add_edges_from((folder(a), folder(b)) for a, b in _import_graph().edges
                     if folder(a) != folder(b) and "." in a and "." in b)
    assert not list(nx.simple_cycles(g))


def test_the_layer_contract_is_declared_once_and_covers_every_folder():
    import tomllib

    pyproject = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())
    (contract,) = pyproject["tool"]["importlinter"]["contracts"]
    named = {name.strip() for layer in contract["layers"] for name in layer.split("|")}
    folders = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    top = {p.stem for p in ROOT.glob("*.py")} - {"__init__", "__main__"}
    assert named == folders | top
    assert len(top) <= 10, sorted(top)


def test_lazy_imports_say_why():
    """An import inside a function stays only for an optional or heavy dependency, or a
    deliberate late load, and says so beside it (a comment on the line or just above)."""
    unexplained = []
    for path in sorted(ROOT.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(_tree(path)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom) and (inner.module or "").startswith("fxpipe") or (
                        isinstance(inner, ast.Import) and any(a.name.startswith("fxpipe") for a in inner.names)):
                    i = inner.lineno - 1  # the reason: on the line, or above its group of imports
                    while i > 0 and lines[i - 1].strip().startswith(("from ", "import ")):
                        i -= 1
                    if "#" not in lines[inner.lineno - 1] and not lines[i - 1].strip().startswith("#"):
                        unexplained.append(f"{path.relative_to(ROOT)}:{inner.lineno}")
    assert not unexplained, f"fxpipe imports inside functions without a reason beside them: {unexplained}"
