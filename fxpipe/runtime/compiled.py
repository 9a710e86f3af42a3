"""Compile pipeline stages with TorchInductor (``parallelize(compile=True)``, ``fxpipe run --compile``).

Each stage's GraphModule is already an ATen graph with static shapes (the plan fixes
every microbatch shape), so it goes straight to AOTAutograd + Inductor
(``torch._inductor.compile_fx.compile_fx``) — no Dynamo, no guards, no graph breaks:
the whole stage becomes one compiled forward and one compiled backward, wrapped in one
``autograd.Function``. The StageRunner calls it like the GraphModule and gets outputs
with a normal ``grad_fn``, so B, and the zero-bubble I and W halves
(``runtime/backward_split.py``), work unchanged. The whole compiled backward is one
autograd node, though, so it is the boundary between I and W: W runs it again for the
weight gradients and I + W costs about 2 B compiled (eager: 1.0–1.05 B).

Compilation happens once per stage before the first step; nothing runs (Inductor traces
with fake tensors), so no collective, RNG draw or gradient happens at compile time. The
backward is lowered eagerly too where AOTAutograd offers it
(``force_non_lazy_backward_lowering``), so the first step pays no compile. Inductor's
on-disk caches (``TORCHINDUCTOR_CACHE_DIR``, default ``/tmp/torchinductor_$USER``) make
a second run's compile much faster.

What needs care:

- Tensor-parallel collectives (``torch.ops.fxpipe_tp.*``) are custom ops with fake
  kernels; their backward rules are themselves fxpipe_tp ops (``fxpipe/tp/ops.py``), so
  they appear in both compiled graphs as opaque calls that read the TP context when they
  run. Every TP rank compiles the same graph the same way, so collectives keep one order.
- Recompute regions (``passes/recompute.py``) call ``torch.utils.checkpoint`` from a
  submodule, which AOTAutograd cannot trace as a recompute. They are inlined and their
  nodes tagged ``MUST_RECOMPUTE`` with one ``ac_graph_id`` per region — the tags the
  partitioner honours for ``torch.compile``'d checkpoints — so the saved set is the
  same as eager's. Random ops in a region (dropout masks) are tagged ``MUST_SAVE``:
  eager replays them from a rewound RNG; compiled code keeps the mask instead (same
  gradients, one mask more of memory per region).
- Anything Inductor rejects falls back to the eager GraphModule for that stage only,
  with one warning naming the reason; a run never fails because of ``compile=True``.
"""
from __future__ import annotations

import copy
import operator
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.fx as fx

from fxpipe.passes.recompute import CheckpointedRegion


class CompileFallbackWarning(UserWarning):
    """A stage could not be compiled and runs eagerly."""


@dataclass(frozen=True)
class StageCompile:
    """What happened to one stage under ``compile=True``."""
    stage: int
    compiled: bool
    seconds: float
    """Wall time of the compile attempt (forward and backward)."""
    reason: str | None = None
    """Why the stage runs eagerly (``compiled`` False)."""

    def line(self) -> str:
        if self.compiled:
            return f"stage {self.stage}: compiled with Inductor in {self.seconds:.1f} s"
        return f"stage {self.stage}: eager ({self.reason})"


def _is_random(node: fx.Node) -> bool:
    target = node.target
    if getattr(target, "_qualname", "") in ("fxpipe_tp::dropout_mask", "fxpipe_tp::dropout"):
        return True
    tags = getattr(target, "tags", ())
    name = str(target)
    return torch.Tag.nondeterministic_seeded in tags or "dropout" in name or "bernoulli" in name


def inline_recompute_regions(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` with every ``CheckpointedRegion`` call replaced by its body, the
    body's nodes tagged for AOTAutograd's partitioner (see the module docstring)."""
    from torch.utils.checkpoint import CheckpointPolicy

    out = copy.deepcopy(gm)
    calls = [n for n in out.graph.nodes if n.op == "call_module"
             and isinstance(out.get_submodule(n.target), CheckpointedRegion)]
    for region_id, call in enumerate(calls):
        body: fx.GraphModule = out.get_submodule(call.target).body
        env: dict[fx.Node, object] = {}
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        for ph, arg in zip(placeholders, call.args):
            env[ph] = arg
        results: tuple = ()
        with out.graph.inserting_before(call):
            for n in body.graph.nodes:
                if n.op == "placeholder":
                    continue
                if n.op == "output":
                    results = tuple(fx.map_arg(n.args[0], lambda a: env[a]))
                    continue
                if n.op == "get_attr":  # a constant of the body: move it to the parent
                    attr = f"{call.target}_{n.target}"
                    setattr(out, attr, getattr(body, n.target))
                    new = out.graph.get_attr(attr)
                    new.meta = dict(n.meta)
                else:
                    new = out.graph.node_copy(n, lambda a: env[a])
                    new.meta["recompute"] = (CheckpointPolicy.MUST_SAVE if _is_random(n)
                                             else CheckpointPolicy.MUST_RECOMPUTE)
                    new.meta["ac_graph_id"] = region_id
                env[n] = new
        for user in list(call.users):
            assert user.target is operator.getitem, user
            user.replace_all_uses_with(results[user.args[1]])
            out.graph.erase_node(user)
        out.graph.erase_node(call)
        out.delete_submodule(call.target)
    out.graph.lint()
    out.recompile()
    return out


def _first_line(exc: BaseException) -> str:
    """The exception's type and first sentence: the warning must stay one line."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else ""
    if len(text) > 160 and ". " in text:
        text = text[:text.index(". ") + 1]
    return f"{type(exc).__name__}: {text[:240]}".rstrip(": ")


def _inductor(gm: fx.GraphModule, example_args: Sequence[torch.Tensor]) -> Callable:
    """AOTAutograd + Inductor on an ATen graph; nothing is executed."""
    import torch._functorch.config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    # Donated buffers let the compiled backward overwrite saved tensors, which forbids
    # retain_graph — and the zero-bubble I half keeps the graph for W. AOTAutograd checks
    # this flag again at every backward, so it is turned off for the process, not only
    # while compiling (it costs some memory reuse in compiled backwards, nothing else).
    functorch_config.donated_buffer = False
    patch = {}
    if hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        patch["force_non_lazy_backward_lowering"] = True  # compile backward now, not at step 1
    with torch.enable_grad(), functorch_config.patch(**patch):
        return compile_fx(gm, list(example_args))


def compile_stage(gm: fx.GraphModule, example_args: Sequence[torch.Tensor], *,
                  compiler: Callable | None = None) -> tuple[Callable, str | None]:
    """``(fn, None)`` with ``fn(*args)`` the compiled stage, or ``(gm, reason)`` when it
    cannot be compiled. ``example_args`` are in the GraphModule's placeholder order with
    the shapes, dtypes, devices and ``requires_grad`` of the real calls (their values are
    never read). ``compiler`` replaces Inductor (tests)."""
    compiler = compiler or _inductor
    try:
        fn = compiler(inline_recompute_regions(gm), example_args)
    except Exception as exc:  # any failure: this stage stays eager, the run goes on
        return gm, _first_line(exc)
    # The compiled code asserts the input strides it was specialised for; activations
    # and batch slices arrive contiguous except when handed over locally (interleaved
    # stages on one rank), where an output may be a strided view.
    strides = [a.stride() if isinstance(a, torch.Tensor) else None for a in example_args]

    def run(*args: torch.Tensor) -> list:
        fixed = [a.contiguous() if s is not None and a.stride() != s else a
                 for a, s in zip(args, strides)]
        return fn(*fixed)

    return run, None


def compile_stages(stages: dict[int, tuple[fx.GraphModule, Sequence[torch.Tensor]]], *,
                   context: Callable,
                   agree: Callable[[dict[int, bool]], dict[int, bool]] = lambda ok: ok,
                   log: Callable[[str], None] | None = print,
                   compiler: Callable | None = None) -> tuple[dict[int, Callable], list[StageCompile]]:
    """Compile each ``stage index -> (graph_module, example_args)``; return the callables
    (the compiled function, or the GraphModule itself when it fell back) and a record per
    stage. ``context`` is entered while tracing (TP ops save their group in forward).
    ``agree({stage: compiled})`` returns, per stage, whether every rank running that
    stage compiled it: the ranks of a TP group must not mix compiled and eager code,
    which may order independent collectives differently. ``log`` prints one progress
    line per stage (None: silent)."""
    fns, records, reasons, seconds = {}, [], {}, {}
    for index, (gm, args) in stages.items():
        start = time.perf_counter()
        with context():
            fns[index], reasons[index] = compile_stage(gm, args, compiler=compiler)
        seconds[index] = time.perf_counter() - start
        if log is not None and reasons[index] is None:
            log(f"fxpipe compile: {StageCompile(index, True, seconds[index]).line()}")
    agreed = agree({i: r is None for i, r in reasons.items()})
    for index, (gm, _) in stages.items():
        reason = reasons[index]
        if reason is None and not agreed[index]:
            fns[index], reason = gm, "another rank running it could not compile it"
        record = StageCompile(index, reason is None, seconds[index], reason)
        if reason is not None:
            warnings.warn(CompileFallbackWarning(f"fxpipe compile: {record.line()}; running it eagerly"),
                          stacklevel=2)
        records.append(record)
    return fns, records


def example_args(plan, stage, state, device: torch.device) -> list[torch.Tensor]:
    """Placeholder-ordered stand-ins for one microbatch's call of ``stage``: the real
    parameters, and empty contiguous tensors of the plan's batch and received shapes."""
    canonical = plan.canonical
    args = [state[canonical[p]] for p in stage.params]
    specs = plan.program.input_specs
    for i in stage.batch_inputs:
        args.append(torch.zeros(specs[i].shape, dtype=specs[i].dtype, device=device))
    for name in stage.inputs:
        value = plan.values[name]
        t = torch.zeros(value.spec.shape, dtype=value.spec.dtype, device=device)
        args.append(t.requires_grad_(value.requires_grad))
    return args
