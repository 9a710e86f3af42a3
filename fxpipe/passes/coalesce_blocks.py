"""After partitioning: merge the blocks of a split matmul that one stage runs into one.

``split_matmul_pass`` cuts a heavy matmul into many output-feature blocks so the
partitioner can balance stages finely, but every block reads its own slice of the
weight, and the backward of a slice builds a zero gradient of the *whole* weight and
adds its block into it: k blocks on a stage cost k weight-sized passes (measured on
GPT-2's 50257×256 head: 10 blocks took the profile from 576 to 743 ms per
microbatch). Once the stages are known, neighbouring blocks on the same stage are one
slice again: blocks i..j (contiguous in output features, all on stage s) become one
matmul of features [startᵢ, endⱼ) — and, where ``split_loss_pass`` rewrote the
cross-entropy, one logsumexp and one target pick over them. The result is the same
computation as before the merge (the cat / stacks take the merged pieces in order), so
the partition's balance is kept and each stage does one weight-slice backward per
run of blocks instead of one per block.
"""
from __future__ import annotations

import copy
import dataclasses

import torch
import torch.fx as fx

from fxpipe.ir.compile_context import CompileContext
from fxpipe.ir.program import Program
from fxpipe.passes.cost import cost_pass
from fxpipe.passes.split import side_values
from fxpipe.passes.split_loss import BlockwiseLoss, build_loss_block
from fxpipe.passes.split_matmul import MatmulSplit, block_key, build_block, fake

aten = torch.ops.aten


def _runs(split: MatmulSplit, loss: BlockwiseLoss | None, stages) -> list[tuple[int, int, int | None]]:
    """(first, last, stage) of each maximal run of neighbouring blocks whose nodes all
    sit on one stage (stage None: a block spread over stages, never merged)."""
    per = []
    for i, block in enumerate(split.blocks):
        names = [*block.nodes, *(loss.blocks[i].nodes if loss is not None else ())]
        on = {stages[n] for n in names if n in stages}
        per.append(on.pop() if len(on) == 1 else None)
    runs: list[tuple[int, int, int | None]] = []
    for i, s in enumerate(per):
        if runs and s is not None and runs[-1][2] == s:
            runs[-1] = (runs[-1][0], i, s)
        else:
            runs.append((i, i, s))
    return runs


def _replace_run(node: fx.Node, old: list[fx.Node], new: fx.Node) -> None:
    """In the cat ``node``'s list argument, put ``new`` where the run ``old`` was."""
    parts = list(node.args[0])
    i = parts.index(old[0])
    assert parts[i:i + len(old)] == old
    node.args = (parts[:i] + [new] + parts[i + len(old):], *node.args[1:])
    fake(node, lambda ps, *rest: node.target(ps, *rest), *node.args)


def split_block_keys(program: Program) -> dict[str, str]:
    """Node -> the key of the split it belongs to, for every block node (matmul and loss
    share). Measured costs time all blocks of a split in one probe group, coalesced as
    they will run, so each block's measured time carries 1/k of one weight-slice
    backward instead of a whole one (docs/costs.md)."""
    keys = {}
    losses = {b.logits: loss for loss in program.loss_splits for b in loss.blocks}
    for split in program.matmul_splits:
        loss = losses.get(split.blocks[0].output)
        for i, block in enumerate(split.blocks):
            for n in (*block.nodes, *(loss.blocks[i].nodes if loss is not None else ())):
                keys[n] = split.key
    return keys


def coalesce_blocks_pass(program: Program, ctx: CompileContext | None = None) -> Program:
    """Merge the split-matmul blocks (and their loss blocks) each stage holds in a
    contiguous run into one (module docstring). Needs ``program.stages``; returns the
    rewritten Program with its assignment, records and costs updated."""
    splits = program.matmul_splits
    if not splits:
        return program  # nothing was split: nothing to merge
    losses = {b.logits: loss for loss in program.loss_splits for b in loss.blocks}
    if not program.stages:
        raise ValueError("coalesce_blocks_pass needs a partitioned Program (run the partition pass first)")
    stages = dict(program.stages)
    plans = [(split, losses.get(split.blocks[0].output)) for split in splits]
    plans = [(split, loss, _runs(split, loss, stages)) for split, loss in plans]
    if all(first == last for _, _, runs in plans for first, last, _ in runs):
        return program
    gm = copy.deepcopy(program.graph_module)
    graph = gm.graph
    paths, layers = dict(program.module_paths), dict(program.layers)
    new_splits, new_losses, built = [], {}, {}
    for split, loss, runs in plans:
        blocks, loss_blocks = [], []
        for first, last, stage in runs:
            if first == last:
                blocks.append(split.blocks[first])
                if loss is not None:
                    loss_blocks.append(loss.blocks[first])
                continue
            by_name = {n.name: n for n in graph.nodes}
            run = split.blocks[first:last + 1]
            key = block_key(split, first, last)
            with graph.inserting_before(by_name[run[0].nodes[0]]):
                merged = build_block(graph, split, run[0].start, run[-1].end)
            blocks.append(merged)
            new = list(merged.nodes)
            by_name = {n.name: n for n in graph.nodes}
            old_out = [by_name[b.output] for b in run]
            for user in list(old_out[0].users):
                if user.target is aten.cat.default:
                    _replace_run(user, old_out, by_name[merged.output])
            dead = [n for b in run for n in b.nodes]
            if loss is not None:
                old = loss.blocks[first:last + 1]
                # Right after the run's old shares: below the running (lse, pick) it folds
                # into, above the next block's share that reads it.
                last_acc = by_name[old[-1].acc]
                with graph.inserting_before(last_acc.next):
                    lb = build_loss_block(graph, by_name[merged.output], by_name[loss.target],
                                          run[0].start, run[-1].end, loss.chain,
                                          by_name[loss_blocks[-1].acc] if loss_blocks else None)
                loss_blocks.append(lb)
                new += lb.nodes
                by_name = {n.name: n for n in graph.nodes}
                last_acc.replace_all_uses_with(by_name[lb.acc])
                dead += [n for b in old for n in b.nodes]  # consumers last: erased first
            for name in reversed(dead):
                node = by_name[name]
                assert not node.users, f"{name} still used after merging blocks {first}..{last}"
                graph.erase_node(node)
                for m in (stages, paths, layers):
                    m.pop(name, None)
            for name in new:
                paths[name] = key
                if run[0].output in program.layers:
                    layers[name] = program.layers[run[0].output]
                built[name] = stage
        new_splits.append(dataclasses.replace(split, blocks=tuple(blocks)))
        if loss is not None:
            new_losses[loss] = dataclasses.replace(loss, blocks=tuple(loss_blocks))
    graph.lint()
    gm.recompile()
    out = program.replace(graph_module=gm, module_paths=paths, layers=layers)
    side = side_values(out)  # recomputed by every stage that reads them: no stage of their own
    stages.update({n: s for n, s in built.items() if n not in side})
    return cost_pass(out.replace(stages=stages, matmul_splits=tuple(new_splits), costs={},
                                 loss_splits=tuple(new_losses.get(l, l) for l in program.loss_splits)))

