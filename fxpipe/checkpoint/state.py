"""What a checkpoint holds of a ParallelModel, keyed by original names: the model's tensors
(TP shards as ShardedTensors of the full shape), the optimizer's state, the RNGs and the
loss scaler; and putting a loaded state back into this rank's tensors. The save/resume
protocol around it is ``dcp.py``."""
import random
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fxpipe.checkpoint.files import SafeReader
from fxpipe.checkpoint.manifest import SCALER_FIELDS, CorruptCheckpointError
from fxpipe.checkpoint.shard_chunks import empty_chunks, first_held, is_sharded, restrict, wrap_state
from fxpipe.ir.program import ParamKind, Program
from fxpipe.ir.shard_spec import ShardSpec
from fxpipe.ir.state_mismatch import full_shapes, raise_if_mismatched
from fxpipe.runtime.api import ParallelModel

# ---- what is saved ---------------------------------------------------------------------------
def _is_persistent(info: Any) -> bool:
    """In the model's ``state_dict()``: parameters and persistent buffers."""
    return info.kind is ParamKind.PARAMETER or info.persistent


def optional_names(program: Program) -> set[str]:
    """Canonical names a checkpoint may lack: the non-persistent buffers."""
    return {p.canonical for p in program.params if p.kind is ParamKind.BUFFER and not p.persistent}


def state_dict_names(program: Program) -> dict[str, str]:
    """What ``model.state_dict()`` holds: every original name -> its canonical name
    (tied names all map to their group's tensor)."""
    return {p.name: p.canonical for p in program.params
            if p.kind is not ParamKind.CONSTANT and _is_persistent(p)}


def _model_tensors(pm: "ParallelModel") -> dict[str, torch.Tensor]:
    """This rank's live model tensors by canonical name (tensor-parallel shards): the
    fp32 masters for trained parameters under mixed precision (the compute copies are
    refreshed from them at every ``train_step``), else ``pm.state``; buffers from ``pm.state``."""
    kinds = {p.canonical: p.kind for p in pm.plan.program.params}
    masters = pm.master.masters if pm.master is not None else {}
    return {n: masters.get(n, t) for n, t in pm.state.items() if kinds[n] is not ParamKind.CONSTANT}


def _saved_model_tensors(pm: "ParallelModel") -> dict[str, torch.Tensor]:
    """What this rank writes: under ZeRO-1 a trained tensor only by its owner (the one
    with its fp32 master); DCP merges the ranks' keys."""
    return {n: t for n, t in _model_tensors(pm).items() if pm.owns(n)}


def _tp_ranks(pm: "ParallelModel") -> list[int]:
    """Global ranks of this rank's tp group, in tp order (tp is innermost in the mesh)."""
    base = pm.groups.rank - pm.groups.tp_rank
    return [base + t for t in range(pm.groups.mesh.tp)]


def _chunked(pm: "ParallelModel", tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """This rank's shards (tensor-parallel, and rows split over pipeline ranks) as DCP
    chunks of the full shape (no gather; ``shard_chunks.py``); everything else as
    it is. A row held by several pipeline ranks is written by the lowest of them."""
    specs = dict(pm.specs)
    if not any(is_sharded(s) for s in specs.values()):
        return tensors
    keeps = {}
    for name, rows in pm.plan.row_shards.items():
        if name in specs and rows.ranks[pm.groups.pp_rank]:
            keep = first_held(rows, pm.groups.pp_rank)
            if len(keep) < rows.local_rows(pm.groups.pp_rank):
                keeps[name] = keep
                if keep:
                    specs[name] = restrict(specs[name], keep)
    out = {}
    for name, t in tensors.items():
        keep = keeps.get(name)
        if keep is not None:
            if not keep:
                continue  # every row written by a lower pipeline rank (the step counter too)
            if t.dim() and t.shape[0] == pm.specs[name].local_shape[0]:
                t = t.index_select(0, torch.tensor(keep, dtype=torch.long, device=t.device))
        out[name] = t
    return wrap_state(out, specs, pm.groups.tp_rank, _tp_ranks(pm), pm.groups.tp_group)


def _model_state(pm: "ParallelModel") -> dict[str, Any]:
    pm.sync_parameters()  # after an optimizer step, every copy current (ZeRO-1: the owners')
    local = _chunked(pm, {n: t.detach() for n, t in _saved_model_tensors(pm).items()})
    if pm.groups.pp_rank == 0:  # buffers no stage reads are in no rank's state: the Program's copy
        held = {n for st in range(pm.plan.num_stages) for n in pm.plan.stage_params(st)}
        program = pm.plan.program
        # A model built on meta never materialises a buffer no stage reads: nothing to save.
        local.update({p.canonical: program.state[p.canonical].detach().cpu() for p in program.params
                      if p.kind is ParamKind.BUFFER and p.canonical not in held
                      and not program.state[p.canonical].is_meta})
    return {f"model.{n}": t for n, t in local.items()}


def _optimizer_names(pm: "ParallelModel", optimizer: torch.optim.Optimizer) -> list[str]:
    """Original name of each parameter in torch.optim's index order (groups in order)."""
    by_id = {id(t): n for n, t in pm.named_parameters()}
    names = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in by_id:
                raise ValueError(f"the optimizer holds a tensor of shape {tuple(p.shape)} that is not one "
                                 f"of this ParallelModel's parameters; build it from pm.parameters()")
            names.append(by_id[id(p)])
    return names


def _is_number(v: Any) -> bool:
    if isinstance(v, (tuple, list)):
        return bool(v) and all(_is_number(x) for x in v)
    return isinstance(v, torch.Tensor) or (isinstance(v, (int, float)) and not isinstance(v, bool))


def _optimizer_state(pm: "ParallelModel", optimizer: torch.optim.Optimizer, names: list[str]) -> dict[str, torch.Tensor]:
    sd = optimizer.state_dict()
    by_key: dict[str, dict[str, torch.Tensor]] = {}  # state key -> parameter name -> tensor
    for index, entries in sd["state"].items():
        for key, value in entries.items():
            by_key.setdefault(key, {})[names[index]] = torch.as_tensor(value)
    out = {}
    for key in sorted(by_key):
        # Moments (exp_avg, exp_avg_sq) have the parameter's shape: chunked with its
        # ShardSpec like the parameter. Scalars (step) are the same on every tp rank.
        for name, t in _chunked(pm, by_key[key]).items():
            out[f"optim.state.{name}.{key}"] = t
    for group in sd["param_groups"]:
        # Numbers only (lr, initial_lr, betas, eps, weight_decay): flags such as foreach
        # or fused describe how the optimizer was built, which the loader's run decides.
        for key, value in group.items():
            if key != "params" and _is_number(value):
                for index in group["params"]:
                    out[f"optim.param_groups.{names[index]}.{key}"] = torch.as_tensor(value, dtype=torch.float64)
    return out


def _rng_state(rank: int, device: torch.device, tp_rng: Any = None) -> dict[str, torch.Tensor]:
    version, words, gauss = random.getstate()  # Mersenne Twister: 624 words + position
    assert version == 3, version
    _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    out = {"torch": torch.get_rng_state(),
           "python": torch.tensor(words, dtype=torch.int64),
           "python_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
           "numpy_keys": torch.from_numpy(keys.astype(np.int64)),
           "numpy_rest": torch.tensor([pos, has_gauss, cached], dtype=torch.float64)}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    if tp_rng is not None:  # the TP dropout streams (Megatron's RNG tracker), per rank
        for (dev, sharded), state in tp_rng.get_state().items():
            out[f"tp_{dev}_{int(sharded)}"] = state
    return {f"rng.{rank}.{k}": v for k, v in out.items()}


def _set_rng(loaded: Mapping[str, torch.Tensor], device: torch.device, tp_rng: Any = None) -> None:
    torch.set_rng_state(loaded["torch"])
    if tp_rng is not None:
        tp_rng.restore({(k.split("_")[1], k.split("_")[2] == "1"): v
                        for k, v in loaded.items() if k.startswith("tp_")})
    has_gauss, gauss = loaded["python_gauss"].tolist()
    random.setstate((3, tuple(loaded["python"].tolist()), gauss if has_gauss else None))
    pos, flag, cached = loaded["numpy_rest"].tolist()
    np.random.set_state(("MT19937", loaded["numpy_keys"].numpy().astype(np.uint32), int(pos), int(flag), cached))
    if device.type == "cuda" and "cuda" in loaded:
        torch.cuda.set_rng_state(loaded["cuda"], device)


_SCALER_FIELDS = SCALER_FIELDS  # checked in the manifest (manifest.py)


def _scaler_state(pm: "ParallelModel") -> dict | None:
    """fp16's dynamic loss scale (the same on every rank: overflow is all-reduced).
    ``growth_interval``/``min_scale`` are configuration, which the loading run decides."""
    scaler = pm.master.scaler if pm.master is not None else None
    return None if scaler is None else {f: getattr(scaler, f) for f in _SCALER_FIELDS}


# ---- load ------------------------------------------------------------------------------------
def _check_model(program: Program, specs: Mapping[str, ShardSpec], saved: Mapping[str, Any], path: Path) -> None:
    """The checkpoint must hold exactly this model's tensors, by name and full shape
    (after the TP pass ``ParamInfo.shape`` is the local shape: ``full_shape`` from the spec).
    A non-persistent buffer (``persistent=False``: a Llama's ``rotary_emb.original_inv_freq``)
    is not in ``state_dict()`` and is rebuilt by the model's own init: it may be absent (a
    model built on meta never materialises one no stage reads, so it is not saved), and
    when present it is checked and loaded like the rest."""
    expected = full_shapes(program, specs)
    optional = optional_names(program)
    found = {k[len("model."):]: tuple(md.size) for k, md in saved.items() if k.startswith("model.")}
    raise_if_mismatched(
        f"checkpoint {path} does not match this model ({program.source})",
        sorted(set(expected) - set(found) - optional), sorted(set(found) - set(expected)),
        [f"{n}: checkpoint {found[n]} vs model {expected[n]}"
         for n in sorted(set(expected) & set(found)) if tuple(found[n]) != tuple(expected[n])])


def _targets(saved: Mapping[str, Any], prefix: str) -> dict[str, torch.Tensor]:
    """Empty CPU tensors, shaped as DCP's index says, for every saved key under ``prefix``."""
    return {k: torch.empty(tuple(md.size), dtype=md.properties.dtype)
            for k, md in saved.items() if k.startswith(prefix) and hasattr(md, "size")}


def _local_targets(pm: "ParallelModel", saved: Mapping[str, Any], prefix: str, name_of: Any,
                   wanted: set[str]) -> dict[str, tuple[Any, Callable[[], torch.Tensor]]]:
    """Load targets for the saved keys under ``prefix`` whose parameter this rank
    holds, as (what DCP fills, a function returning this rank's tensor once filled): for
    a tensor-parallel parameter (and its moments, of the full shape) a ShardedTensor of
    this rank's ranges over a local-shape buffer, so no full tensor is ever built;
    otherwise one full tensor."""
    out = {}
    for key, md in saved.items():
        if not key.startswith(prefix) or name_of(key) not in wanted:
            continue
        spec, shape, dtype = pm.specs.get(name_of(key)), tuple(md.size), md.properties.dtype
        if is_sharded(spec) and shape == tuple(spec.full_shape):
            out[key] = empty_chunks(spec, pm.groups.tp_rank, _tp_ranks(pm), pm.groups.tp_group, dtype)
        else:
            full = torch.empty(shape, dtype=dtype)
            out[key] = (full, lambda full=full: full)
    return out


def _like(current: Any, loaded: torch.Tensor) -> Any:
    """A loaded hyper-parameter in the type the optimizer was built with."""
    if isinstance(current, torch.Tensor):
        return loaded.to(dtype=current.dtype, device=current.device)
    if isinstance(current, (tuple, list)):
        return type(current)(type(c)(x) for c, x in zip(current, loaded.tolist()))
    return type(current)(loaded.item())


def _install_optimizer(optimizer: torch.optim.Optimizer, names: list[str],
                       loaded: Mapping[str, torch.Tensor]) -> None:
    """Rebuild torch.optim's index-keyed state dict from name-keyed tensors and load it
    (torch's load_state_dict then casts state to each parameter's device and dtype)."""
    state: dict[str, dict[str, torch.Tensor]] = {}
    hyper: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in loaded.items():
        kind, rest = key[len("optim."):].split(".", 1)
        name, field = rest.rsplit(".", 1)  # torch.optim's own keys have no dots
        (state if kind == "state" else hyper).setdefault(name, {})[field] = t
    current = optimizer.state_dict()
    groups = []
    for group in current["param_groups"]:
        group = dict(group)
        for key, value in list(group.items()):
            found = [hyper[names[i]][key] for i in group["params"] if key in hyper.get(names[i], {})]
            if key != "params" and found and _is_number(value):
                group[key] = _like(value, found[0])
        groups.append(group)
    optimizer.load_state_dict({"state": {i: state[n] for i, n in enumerate(names) if n in state},
                               "param_groups": groups})


def read_dcp(tensors: dict[str, torch.Tensor], path: Path, *, no_dist: bool = False) -> None:
    """``dcp.load`` from ``path`` with the safe reader. DCP reports a failed read (a
    file changed after the digests were checked, or a format-1 checkpoint without
    digests) as ``CheckpointException``, which derives from BaseException, not
    Exception: turned into a ``CorruptCheckpointError`` naming the checkpoint. The
    failure is gathered by DCP, so every rank raises it alike."""
    try:
        dcp.load(tensors, storage_reader=SafeReader(path), no_dist=no_dist)
    except CheckpointException as exc:
        raise CorruptCheckpointError(f"checkpoint {path} could not be read: {str(exc)[:600]}") from None
