"""Compile pipeline stages with TorchInductor (``parallelize(inductor=True)``, ``fxpipe run --inductor``).

Each stage's GraphModule is already an ATen graph with static shapes (the plan fixes
every microbatch shape), so it goes straight to AOTAutograd + Inductor
(``torch._inductor.compile_fx.compile_fx``) — no Dynamo, no guards, no graph breaks:
the whole stage becomes one compiled forward and one compiled backward, wrapped in one
``autograd.Function``. The StageRunner calls it like the GraphModule and gets outputs
with a normal ``grad_fn``, so B works unchanged.

Zero-bubble schedules (zb-h1, zb-v) run B as I (input gradients) and W (weight
gradients; Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §2). The eager
split (``base/backward_split.py``) cannot cut the one autograd node of a compiled
backward — W would re-run all of it, I + W ≈ 2 B. So for the stages such a schedule
splits, the backward graph AOTAutograd produces is itself cut into an I graph and a W
graph, each compiled by Inductor (``runtime/compiled_split.py``): every node runs in
exactly one of them, and I + W does B's work once (measured on CPU, HF GPT-2 stage:
(I + W)/B 0.9–1.16 compiled, was 1.95–2.46). A backward that cannot be cut safely
(a mutation or side effect in it) is compiled whole, with the reason in the stage's
``StageCompile`` record, and W re-runs it as before. Other schedules keep one compiled
backward.

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
  run. Every TP rank compiles the same graph the same way, so collectives keep one order;
  the I/W cut is made by graph structure alone, so it is the same on every TP rank too
  (and the ranks check it: a stage split on one rank and not another runs eagerly).
- Recompute regions (``passes/recompute.py``) run as a custom autograd node from a
  submodule (``ir/recompute_region.py``), which AOTAutograd cannot trace as a recompute. They are inlined and their
  nodes tagged ``MUST_RECOMPUTE`` with one ``ac_graph_id`` per region — the tags the
  partitioner honours for ``torch.compile``'d checkpoints — so the saved set is the
  same as eager's. Random ops in a region (dropout masks) are tagged ``MUST_SAVE``:
  eager replays them from a rewound RNG; compiled code keeps the mask instead (same
  gradients, one mask more of memory per region).
- Anything Inductor rejects falls back to the eager GraphModule for that stage only,
  with one warning naming the reason; a run never fails because of ``inductor=True``.
"""
from __future__ import annotations

import copy
import operator
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
import torch.fx as fx

from fxpipe.ir.recompute_region import CheckpointedRegion
from fxpipe.runtime.compiled_split import GraphSplit, Splitter, WeightQueue


class CompileFallbackWarning(UserWarning):
    """A stage could not be compiled and runs eagerly."""


@dataclass(frozen=True)
class StageCompile:
    """What happened to one stage under ``inductor=True``."""
    stage: int
    compiled: bool
    seconds: float
    """Wall time of the compile attempt (forward and backward)."""
    split: bool = False
    """Its backward is compiled as separate I and W graphs (zero-bubble schedules)."""
    split_reason: str | None = None
    """Why a compiled stage's backward is compiled whole (W then re-runs it, ~2 B)."""
    reason: str | None = None
    """Why the stage runs eagerly (``compiled`` False)."""

    def line(self) -> str:
        if not self.compiled:
            return f"stage {self.stage}: eager ({self.reason})"
        backward = "; backward split into I and W" if self.split else \
            f"; backward whole ({self.split_reason})" if self.split_reason else ""
        return f"stage {self.stage}: compiled with Inductor in {self.seconds:.1f} s{backward}"


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


def _inductor(gm: fx.GraphModule, example_args: Sequence[torch.Tensor], *,
              inner: Callable | None = None) -> Callable:
    """AOTAutograd + Inductor on an ATen graph; nothing is executed. ``inner`` replaces
    Inductor's per-graph compiler ``compile_fx_inner`` (the zero-bubble ``Splitter``)."""
    import torch._functorch.config as functorch_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    # Donated buffers let the compiled backward overwrite saved tensors, which forbids
    # retain_graph — and the zero-bubble I half keeps the graph for W. AOTAutograd checks
    # this flag again at every backward, so it is turned off for the process, not only
    # while compiling (it costs some memory reuse in compiled backwards, nothing else).
    functorch_config.donated_buffer = False
    patch = {}
    if hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        patch["force_non_lazy_backward_lowering"] = True  # compile backward now, not at step 1
    if inner is not None:
        # A hit in AOTAutograd's cache would return a backward compiled whole, without
        # calling ``inner``; each half still hits Inductor's own per-graph cache.
        patch["enable_autograd_cache"] = False
    with torch.enable_grad(), functorch_config.patch(**patch):
        return compile_fx(gm, list(example_args), inner_compile=inner or compile_fx_inner)


class CompiledStage:
    """The compiled stage, called like its GraphModule. ``weights`` is the queue its
    backward leaves W in when that backward is split into I and W (None: compiled whole,
    ``split_reason`` says why)."""

    def __init__(self, fn: Callable, example_args: Sequence[torch.Tensor],
                 weights: WeightQueue | None = None, split_reason: str | None = None,
                 split: GraphSplit | None = None) -> None:
        self.fn, self.weights, self.split_reason = fn, weights, split_reason
        self.split = split
        """The I and W graphs (as Inductor left them) and the backward they came from."""
        # The compiled code asserts the input strides it was specialised for; activations
        # and batch slices arrive contiguous except when handed over locally (interleaved
        # stages on one rank), where an output may be a strided view.
        self.strides = [a.stride() if isinstance(a, torch.Tensor) else None for a in example_args]

    def __call__(self, *args: torch.Tensor) -> list:
        fixed = [a.contiguous() if s is not None and a.stride() != s else a
                 for a, s in zip(args, self.strides)]
        return self.fn(*fixed)


_NO_SPLIT = "the schedule does not split B"


def _split_reason(example_args: Sequence[torch.Tensor], split_inputs: int) -> str | None:
    """Why a stage's backward is not worth splitting, before compiling it."""
    received = list(example_args)[len(example_args) - split_inputs:]
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in received):
        return "no input gradients: W is the whole backward"
    return None


def compile_stage(gm: fx.GraphModule, example_args: Sequence[torch.Tensor], *,
                  compiler: Callable | None = None, split_inputs: int | None = None,
                  inner: Callable | None = None) -> tuple[Callable, str | None]:
    """``(fn, None)`` with ``fn(*args)`` the compiled stage (a ``CompiledStage``), or
    ``(gm, reason)`` when it cannot be compiled. ``example_args`` are in the GraphModule's
    placeholder order with the shapes, dtypes, devices and ``requires_grad`` of the real
    calls (their values are never read). ``split_inputs`` not None: the stage runs under
    a zero-bubble schedule and its last ``split_inputs`` arguments are received
    activations; the backward is compiled as I and W (``compiled_split.py``) where it can
    be. ``compiler`` replaces AOTAutograd + Inductor, ``inner`` Inductor's per-graph
    compiler (tests)."""
    flat = inline_recompute_regions(gm)
    skip = _split_reason(example_args, split_inputs) if split_inputs is not None else _NO_SPLIT
    splitter = None
    if compiler is None and skip is None:
        from torch._inductor.compile_fx import compile_fx_inner
        splitter = Splitter(split_inputs, inner or compile_fx_inner)
    try:
        if compiler is not None:
            fn = compiler(flat, example_args)
        else:
            fn = _inductor(flat, example_args, inner=splitter or inner)
    except Exception as exc:  # any failure: this stage stays eager, the run goes on
        return gm, _first_line(exc)
    if splitter is None:
        return CompiledStage(fn, example_args, split_reason=skip), None
    splitter.enabled = False  # a lazily compiled backward (older torch) stays whole
    if splitter.reason is not None:
        return CompiledStage(fn, example_args, split_reason=splitter.reason), None
    return CompiledStage(fn, example_args, splitter.queue, None, splitter.parts), None


def _split_of(fn: Callable) -> tuple[bool, str | None]:
    """(split, why not) of a compile_stage result, for the record; the reason is only
    worth reporting where the schedule wanted the split."""
    if not isinstance(fn, CompiledStage):
        return False, None
    reason = fn.split_reason if fn.split_reason != _NO_SPLIT else None
    return fn.weights is not None, reason


def compile_stages(stages: dict[int, tuple[fx.GraphModule, Sequence[torch.Tensor]]], *,
                   context: Callable,
                   agree: Callable[[dict], dict] = lambda ok: ok,
                   log: Callable[[str], None] | None = print,
                   compiler: Callable | None = None,
                   split: Mapping[int, int] | None = None) -> tuple[dict[int, Callable], list[StageCompile]]:
    """Compile each ``stage index -> (graph_module, example_args)``; return the callables
    (the compiled function, or the GraphModule itself when it fell back) and a record per
    stage. ``context`` is entered while tracing (TP ops save their group in forward).
    ``agree({key: ok})`` returns, per key, whether every rank running that stage said ok:
    the ranks of a TP group must not mix compiled and eager code, nor split and whole
    backwards, which may order independent collectives differently. ``split`` maps the
    stages a zero-bubble schedule runs as I and W to their number of received inputs
    (``compile_stage``). ``log`` prints one progress line per stage (None: silent)."""
    fns, records, reasons, seconds = {}, [], {}, {}
    for index, (gm, args) in stages.items():
        start = time.perf_counter()
        with context():
            fns[index], reasons[index] = compile_stage(gm, args, compiler=compiler,
                                                       split_inputs=(split or {}).get(index))
        seconds[index] = time.perf_counter() - start
        if log is not None and reasons[index] is None:
            did, why = _split_of(fns[index])
            log(f"fxpipe compile: {StageCompile(index, True, seconds[index], did, why).line()}")
    # Split or whole must agree too ("all split" and "all whole" both false: mixed).
    agreed = agree({**{i: r is None for i, r in reasons.items()},
                    **{("split", i): _split_of(fns[i])[0] for i in stages},
                    **{("whole", i): not _split_of(fns[i])[0] for i in stages}})
    for index, (gm, _) in stages.items():
        reason = reasons[index]
        if reason is None and not agreed[index]:
            fns[index], reason = gm, "another rank running it could not compile it"
        elif reason is None and not (agreed.get(("split", index), True) or agreed.get(("whole", index), True)):
            # Structural, so never expected; but a split I on one TP rank against a whole
            # backward on another would order their collectives differently.
            fns[index], reason = gm, "another rank running it split its backward differently"
        record = StageCompile(index, reason is None, seconds[index], *_split_of(fns[index]), reason=reason)
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
    specs_of = {lk.name: lk.spec for lk in plan.lookups}
    for name in stage.lookups:  # the summed lookups of row-split tables (runtime/lookup_exchange.py)
        spec = specs_of[name]
        args.append(torch.zeros(spec.shape, dtype=spec.dtype, device=device).requires_grad_(True))
    return args
