"""Readable summaries of a compiled Program (what ``fxpipe compile`` prints)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from fxpipe.ir.artifact import PassTiming
from fxpipe.ir.op_tables import VIEW_OPS
from fxpipe.ir.program import ParamKind, Program
from fxpipe.ir.sizes import describe_hints, unbacked_symbols


def human(n: float, unit: str = "") -> str:
    """1234567 -> '1.23M'; bytes get binary prefixes."""
    if unit == "B":
        for prefix in ("", "Ki", "Mi", "Gi", "Ti", "Pi"):
            if abs(n) < 1024 or prefix == "Pi":
                return f"{n:.0f} B" if prefix == "" else f"{n:.2f} {prefix}B"
            n /= 1024
    for prefix in ("", "K", "M", "G", "T", "P", "E"):
        if abs(n) < 1000 or prefix == "E":
            return f"{n:.0f}{unit}" if prefix == "" else f"{n:.2f}{prefix}{unit}"
        n /= 1000
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class LayerRow:
    """One row of the per-layer table: a repeated layer, or the nodes outside them."""
    label: str
    nodes: int
    params: int
    fwd_flops: int
    bwd_flops: int
    act_bytes: int
    """Output bytes of the row's compute nodes (views excluded): activations per microbatch."""


def layer_rows(program: Program) -> list[LayerRow]:
    """Rows: nodes before the first layer, each layer, nodes after the last layer."""
    numel = {p.node: p.numel for p in program.params if p.kind is ParamKind.PARAMETER}
    first_layer = min(program.layers.values(), default=None)
    acc: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
    seen_params: set[str] = set()
    order: list[str] = []
    before = True
    for node in program.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        layer = program.layers.get(node.name)
        if layer is not None:
            before = False
            label = f"layer {layer}"
        else:
            label = "before layers" if before and first_layer is not None else "outside layers" \
                if first_layer is None else "after layers"
        if label not in acc:
            order.append(label)
        row = acc[label]
        row[0] += 1
        for arg in node.all_input_nodes:
            if arg.name in numel and arg.name not in seen_params:
                seen_params.add(arg.name)
                row[1] += numel[arg.name]
        cost = program.costs.get(node.name)
        if cost is not None:
            row[2] += cost.fwd_flops
            row[3] += cost.bwd_flops
            if node.target not in VIEW_OPS:
                row[4] += cost.out_bytes
    return [LayerRow(label, *acc[label]) for label in order]


def compile_summary(program: Program, timings: list[PassTiming] | None = None,
                    max_layer_rows: int = 12) -> str:
    lines = []
    n_call = len(program.call_nodes())
    trainable = program.trainable()
    param_bytes = sum(p.nbytes for p in trainable)
    lines.append(f"model        {program.source}")
    lines.append(f"batch inputs " + ", ".join(f"{n}{list(s.shape)}:{str(s.dtype).replace('torch.', '')}"
                                             for n, s in zip(program.inputs, program.input_specs)))
    lines.append(f"graph        {len(program.graph.nodes)} nodes ({n_call} ATen ops)")
    tp = program.tensor_parallel
    where = f" per tp rank (tp={tp.config.tp})" if tp is not None else ""
    lines.append(f"parameters   {human(program.num_parameters())} in {len(trainable)} tensors "
                 f"({human(param_bytes, 'B')}){where}")
    for canonical, names in program.tied_groups.items():
        lines.append(f"tied group   {' = '.join(names)}")
    dynamic = unbacked_symbols(program.graph_module)
    if dynamic:
        lines.append(f"data-dependent {describe_hints(dynamic, program.size_hints)}")
    n_layers = len(set(program.layers.values()))
    lines.append(f"layers       {n_layers} repeated layers in '{program.layer_container}'"
                 if n_layers else "layers       none found (no indexed layer container); "
                                  "passes treat the graph as one block")
    if program.costs:
        fwd = sum(c.fwd_flops for c in program.costs.values())
        bwd = sum(c.bwd_flops for c in program.costs.values())
        lines.append(f"FLOPs/step   {human(fwd + bwd)} (forward {human(fwd)}, backward {human(bwd)}; "
                     f"matmuls, per batch{where})")
        rows = layer_rows(program)
        lines.append("")
        lines.append(f"{'block':<16}{'nodes':>7}{'params':>10}{'fwd FLOPs':>12}{'bwd FLOPs':>12}"
                     f"{'activations':>14}")
        shown = rows if len(rows) <= max_layer_rows else rows[:max_layer_rows // 2] + [None] + \
            rows[-max_layer_rows // 2:]
        for r in shown:
            if r is None:
                lines.append(f"{'...':<16}")
                continue
            lines.append(f"{r.label:<16}{r.nodes:>7}{human(r.params):>10}{human(r.fwd_flops):>12}"
                         f"{human(r.bwd_flops):>12}{human(r.act_bytes, 'B'):>14}")
    if timings:
        lines.append("")
        lines.append("passes       " + ", ".join(f"{t.name} {t.seconds * 1e3:.0f} ms" for t in timings))
    return "\n".join(lines)


def _layer_span(layers: tuple[int, ...]) -> str:
    if not layers:
        return "-"
    return f"{layers[0]}" if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"


def stage_rows(program: Program, assignment: dict[str, int], result) -> list[dict]:
    """One dict per stage: what the stage table prints and ``--json`` writes."""
    flops = [0] * result.num_stages
    nodes = [0] * result.num_stages
    for name, k in assignment.items():
        c = program.costs.get(name)
        if c is not None:
            flops[k] += c.fwd_flops + c.bwd_flops
        nodes[k] += 1
    rows = []
    for c in result.stages:
        rows.append(dict(stage=c.stage, rank=c.rank, layers=list(c.layers), nodes=nodes[c.stage],
                         params=c.params, flops=flops[c.stage], fwd_ms=c.fwd_s * 1e3,
                         bwd_ms=c.bwd_s * 1e3, comm_ms=c.comm_s * 1e3,
                         act_bytes_per_mb=c.act_bytes, inflight=c.inflight,
                         memory_bytes=c.memory_bytes, send_bytes=c.send_bytes))
    return rows


def stage_table(program: Program, assignment: dict[str, int], result, hardware_name: str) -> str:
    rows = stage_rows(program, assignment, result)
    lines = [f"partition    {result.method.value}: bottleneck {result.bottleneck_s * 1e3:.3f} ms/microbatch, "
             f"balance {result.balance_ratio:.3f} (max/mean), optimality gap {result.gap:.2%} "
             f"({result.status.value}), {result.wall_time_s:.2f} s; times on '{hardware_name}'",
             "",
             f"{'stage':>5}{'rank':>5}{'layers':>8}{'nodes':>7}{'params':>9}{'FLOPs':>10}{'F ms':>9}"
             f"{'B ms':>9}{'comm ms':>9}{'act/mb':>11}{'x inflt':>8}{'memory':>11}{'send':>11}"]
    for r in rows:
        lines.append(f"{r['stage']:>5}{r['rank']:>5}{_layer_span(tuple(r['layers'])):>8}{r['nodes']:>7}"
                     f"{human(r['params']):>9}{human(r['flops']):>10}{r['fwd_ms']:>9.3f}{r['bwd_ms']:>9.3f}"
                     f"{r['comm_ms']:>9.3f}{human(r['act_bytes_per_mb'], 'B'):>11}{r['inflight']:>8}"
                     f"{human(r['memory_bytes'], 'B'):>11}{human(r['send_bytes'], 'B'):>11}")
    mem = ", ".join(human(b, "B") for b in result.rank_memory_bytes)
    lines.append(f"memory per rank: {mem}" + (f" (limit {human(result.memory_limit_bytes, 'B')})"
                                             if result.memory_limit_bytes else ""))
    share = result.rank_param_share
    lines.append(f"parameter share per pipeline rank: {', '.join(f'{x:.2f}' for x in share)} "
                 f"(largest {max(share):.2f}, ideal {1 / len(share):.2f})")
    return "\n".join(lines)
