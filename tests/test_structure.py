"""The compiler/runtime boundary, read from the sources (cheap: ast, no capture).

One compiled artifact crosses it (``fxpipe/ir/artifact.py``): the runtime imports no pass
and no compile pipeline; pass results are typed Program fields, not string keys; one
definition per concept (schedule enum, partition-method check, shard contract)."""
import ast
import dataclasses
import functools
import inspect
import pathlib

import fxpipe

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
    assert len(runtime) >= 20
    bad = {str(p.relative_to(ROOT)): m for p in runtime for m in _imports(p)
           if m.startswith(("fxpipe.passes", "fxpipe.compiler.pipeline"))}
    assert not bad, f"runtime modules importing the compiler: {bad}"


def test_pass_results_are_typed_fields_not_string_keys():
    from fxpipe.ir.program import Program

    fields = {f.name for f in dataclasses.fields(Program)}
    assert "extra" not in fields
    assert {"tensor_parallel", "matmul_splits", "loss_splits", "partition", "partition_config",
            "model_stats", "token_inputs", "recompute_regions"} <= fields
    # And nothing reads one back by its old key.
    readers = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
               if any(isinstance(n, ast.Attribute) and n.attr == "extra"
                      and isinstance(n.value, ast.Name) and n.value.id in ("program", "prog", "plan", "out")
                      for n in ast.walk(_tree(p)))]
    assert not readers


def test_one_definition_per_concept():
    assert _classes("ScheduleKind") == ["schedules/registry.py"]
    assert _classes("ShardSpec") == ["sharding.py"]
    assert _classes("CompiledPipeline") == ["artifact.py"]
    from fxpipe.ir.parallel_config import ScheduleKind as layout_kind
    from fxpipe.planner import ScheduleKind as planner_kind
    from fxpipe.schedules import ScheduleKind
    assert layout_kind is planner_kind is ScheduleKind
    # The partition method's name is checked in one function, Method.parse.
    checks = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
              if "unknown partition method" in p.read_text()]
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
