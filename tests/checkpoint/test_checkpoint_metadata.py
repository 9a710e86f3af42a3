"""Crafted checkpoint files: nothing in a checkpoint directory runs code.

Each payload below is checked twice: plain ``pickle.loads`` (what DCP's own reader
does) must fall for it — so the test proves a real exploit is refused, not a harmless
file — and fxpipe's reader must refuse it with ``UnsafeCheckpointError`` before
anything runs. The marker file is the witness: the payload's command creates it.
"""
from __future__ import annotations

import copy
import copyreg
import dataclasses
import json
import os
import pickle
import shlex
import struct
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from fxpipe.checkpoint.dcp import latest_checkpoint

from fxpipe.checkpoint.export import export_consolidated
from fxpipe.checkpoint.files import SafeReader, step_dirname
from fxpipe.checkpoint.metadata import ALLOWED_GLOBALS, UnsafeCheckpointError, read_metadata

DCP_METADATA = "torch.distributed.checkpoint.metadata"


# ---- a real index to start from ------------------------------------------------------------
@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A real DCP checkpoint directory (one process, no process group)."""
    path = tmp_path / step_dirname(3)
    state = {"model.w": torch.randn(4, 3), "model.b": torch.zeros(3, dtype=torch.bfloat16),
             "optim.state.w.step": torch.tensor(3.0)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=FileSystemWriter(path), no_dist=True)
    # Format 1 (no digests), so that a crafted index reaches the unpickler: with format 2
    # a changed .metadata is refused earlier, by its digest.
    (path / "fxpipe.json").write_text(json.dumps(dict(
        format=1, step=3, extra={}, world_size=1, mesh=dict(pp=1, dp=1, tp=1), state_dict={"w": "w", "b": "b"},
        source="M", precision="fp32", loss_scaler=None)))
    return path


# ---- hand-made pickles -----------------------------------------------------------------------
def _str(proto: int, s: str) -> bytes:
    b = s.encode()
    return (b"\x8c" + bytes([len(b)]) + b) if proto >= 4 else (b"X" + struct.pack("<I", len(b)) + b)


def _global(proto: int, module: str, name: str) -> bytes:
    if proto >= 4:  # STACK_GLOBAL: protocol 4+ resolves dotted names
        return _str(proto, module) + _str(proto, name) + b"\x93"
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _call(proto: int, module: str, name: str, arg: str) -> bytes:
    """PROTO, GLOBAL module.name, (arg,), REDUCE, STOP."""
    return bytes([0x80, proto]) + _global(proto, module, name) + _str(proto, arg) + b"\x85R."


def _touch(marker: Path) -> str:
    return f"touch {shlex.quote(str(marker))}"


def _payloads(marker: Path) -> dict[str, bytes]:
    cmd = _touch(marker)
    out = {}
    for proto in (2, 3, 4, 5):
        out[f"os.system p{proto}"] = _call(proto, "os", "system", cmd)
        out[f"posix.system p{proto}"] = _call(proto, "posix", "system", cmd)
    for proto in (4, 5):  # names resolved through an allowed module
        out[f"dotted dcp.metadata os.system p{proto}"] = _call(proto, DCP_METADATA, "os.system", cmd)
        out[f"dotted dcp.filesystem os.system p{proto}"] = _call(
            proto, "torch.distributed.checkpoint.filesystem", "os.system", cmd)
        out[f"dotted allowed-class globals p{proto}"] = (
            bytes([0x80, proto]) + _global(proto, DCP_METADATA, "Metadata.__init__.__globals__")
            + b".")
    out["module attribute of an allowed module p2"] = (
        bytes([0x80, 2]) + _global(2, DCP_METADATA, "os") + b".")
    out["torch.load"] = _call(4, "torch", "load", "/dev/null")
    out["INST opcode"] = b"(S'" + cmd.encode() + b"'\nios\nsystem\n."
    out["OBJ opcode"] = b"(cos\nsystem\nS'" + cmd.encode() + b"'\no."
    out["builtins.eval"] = _call(2, "builtins", "eval", f"__import__('os').system({cmd!r})")
    out["persistent id"] = b"\x80\x02X\x01\x00\x00\x00xQ."
    return out


def _plain_pickle_runs(payload: bytes, marker: Path) -> bool:
    try:
        pickle.loads(payload)
    except Exception:
        pass
    ran = marker.exists()
    marker.unlink(missing_ok=True)
    return ran


def test_real_index_is_read_exactly(ckpt):
    ours = read_metadata(ckpt)
    plain = pickle.loads((ckpt / ".metadata").read_bytes())
    assert ours.state_dict_metadata == plain.state_dict_metadata
    assert ours.storage_data == plain.storage_data


def test_allow_list_is_exact_pairs():
    assert all("." not in name for _, name in ALLOWED_GLOBALS), "a dotted name would be resolved"
    assert (DCP_METADATA, "os") not in ALLOWED_GLOBALS


def test_crafted_pickles_are_refused_and_run_nothing(ckpt, tmp_path):
    marker = tmp_path / "pwned"
    payloads = _payloads(marker)
    assert len(payloads) >= 18
    exploits = [name for name, p in payloads.items() if _plain_pickle_runs(p, marker)]
    # The payloads are real: plain pickle (DCP's reader) runs most of them.
    assert {"os.system p2", "dotted dcp.metadata os.system p4", "INST opcode", "OBJ opcode",
            "builtins.eval"} <= set(exploits), exploits
    for name, payload in payloads.items():
        (ckpt / ".metadata").write_bytes(payload)
        with pytest.raises(UnsafeCheckpointError, match=r"\.metadata"):
            SafeReader(ckpt).read_metadata()
        assert not marker.exists(), name


def test_extension_registry_opcode_is_refused(ckpt, tmp_path):
    """Once an extension code was unpickled, the C unpickler serves it from copyreg's
    cache without calling find_class: EXT opcodes are refused before unpickling."""
    marker = tmp_path / "pwned"
    copyreg.add_extension("os", "system", 0xF1)
    try:
        payload = b"\x80\x02\x82\xf1" + _str(2, _touch(marker)) + b"\x85R."
        assert _plain_pickle_runs(payload, marker)
        (ckpt / ".metadata").write_bytes(payload)
        with pytest.raises(UnsafeCheckpointError, match="opcode EXT1"):
            read_metadata(ckpt)
        assert not marker.exists()
    finally:
        copyreg.remove_extension("os", "system", 0xF1)


def test_nested_global_inside_a_valid_index_is_refused(ckpt, tmp_path):
    """A genuine index whose planner_data holds a REDUCE of os.system deep inside."""
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return os.system, (_touch(marker),)

    md = read_metadata(ckpt)
    md.planner_data = {"model.w": ("model.w", [Evil()])}
    for proto in (2, 3, 4, 5):
        payload = pickle.dumps(md, protocol=proto)
        assert _plain_pickle_runs(payload, marker)
        (ckpt / ".metadata").write_bytes(payload)
        with pytest.raises(UnsafeCheckpointError):
            read_metadata(ckpt)
        assert not marker.exists()


def _tamper(ckpt: Path, edit) -> None:
    md = copy.deepcopy(read_metadata(ckpt))
    edit(md)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md, protocol=4))


def _first(md):
    return next(iter(md.storage_data))


@pytest.mark.parametrize("what,edit,message", [
    ("path traversal", lambda md: md.storage_data.__setitem__(
        _first(md), dataclasses.replace(md.storage_data[_first(md)], relative_path="../../etc/passwd")),
     "not a DCP data file"),
    ("absolute path", lambda md: md.storage_data.__setitem__(
        _first(md), dataclasses.replace(md.storage_data[_first(md)], relative_path="/etc/passwd")),
     "not a DCP data file"),
    ("missing data file", lambda md: md.storage_data.__setitem__(
        _first(md), dataclasses.replace(md.storage_data[_first(md)], relative_path="__9_0.distcp")),
     "missing"),
    ("read past the file", lambda md: md.storage_data.__setitem__(
        _first(md), dataclasses.replace(md.storage_data[_first(md)], length=10**9)), "beyond"),
    ("negative offset", lambda md: md.storage_data.__setitem__(
        _first(md), dataclasses.replace(md.storage_data[_first(md)], offset=-5)), "beyond"),
    ("load transforms", lambda md: md.storage_data.__setitem__(
        _first(md), dataclasses.replace(md.storage_data[_first(md)], transform_descriptors=["zstd"])),
     "transforms"),
    ("path object where a chunk list belongs", lambda md: setattr(
        md.state_dict_metadata["model.w"], "chunks", Path("/etc")), "chunks"),
    ("chunk outside the tensor", lambda md: setattr(
        md.state_dict_metadata["model.w"].chunks[0], "sizes", torch.Size([40, 3])), "outside"),
    ("negative size", lambda md: setattr(md.state_dict_metadata["model.w"], "size", torch.Size([-1, 3])),
     "bad size"),
    ("record for an unknown key", lambda md: md.storage_data.__setitem__(
        dataclasses.replace(_first(md), fqn="ghost"), md.storage_data[_first(md)]), "unknown key"),
    ("top level is not Metadata", lambda md: md.__setattr__("state_dict_metadata", [1, 2]), "not a dict"),
])
def test_hostile_arguments_to_allowed_classes_are_refused(ckpt, what, edit, message):
    _tamper(ckpt, edit)
    with pytest.raises(UnsafeCheckpointError, match=message):
        SafeReader(ckpt).read_metadata()


def test_bytes_entry_is_refused(ckpt):
    """DCP reads a bytes entry with torch.load(weights_only=False): never allowed in."""
    md = read_metadata(ckpt)
    md.state_dict_metadata["extra"] = BytesStorageMetadata()
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafeCheckpointError, match="BytesStorageMetadata"):
        read_metadata(ckpt)


def test_truncated_index_is_refused(ckpt):
    data = (ckpt / ".metadata").read_bytes()
    (ckpt / ".metadata").write_bytes(data[: len(data) // 2])
    with pytest.raises(UnsafeCheckpointError, match="not a readable DCP index"):
        read_metadata(ckpt)


def test_data_file_pickle_runs_nothing(ckpt, tmp_path):
    """A .distcp whose bytes are a code-running pickle: DCP reads tensors with
    torch.load(weights_only=True), so loading fails and nothing runs."""
    marker = tmp_path / "pwned"
    data_file = next(ckpt.glob("*.distcp"))
    payload = _call(2, "os", "system", _touch(marker))
    size = data_file.stat().st_size
    data_file.write_bytes(payload + b"." * (size - len(payload)))  # same size: the index still fits
    md = read_metadata(ckpt)
    targets = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()}
    with warnings.catch_warnings(), pytest.raises(BaseException, match="weights_only|Unsupported|Weights"):  # DCP wraps it in CheckpointException(BaseException)
        warnings.simplefilter("ignore")
        dcp.load(targets, storage_reader=SafeReader(ckpt), no_dist=True)
    assert not marker.exists()


def test_export_of_a_crafted_directory_runs_nothing(ckpt, tmp_path):
    marker = tmp_path / "pwned"
    (ckpt / ".metadata").write_bytes(_call(4, DCP_METADATA, "os.system", _touch(marker)))
    with pytest.raises(UnsafeCheckpointError):
        export_consolidated(ckpt, tmp_path / "out.pt")
    assert not marker.exists() and not (tmp_path / "out.pt").exists()


def test_latest_pointer_cannot_leave_the_directory(tmp_path, ckpt):
    outside = tmp_path / "elsewhere" / step_dirname(9)
    outside.mkdir(parents=True)
    for f in (".metadata", "fxpipe.json"):
        (outside / f).write_bytes((ckpt / f).read_bytes())
    (ckpt.parent / "latest").write_text(f"../elsewhere/{step_dirname(9)}\n")
    assert latest_checkpoint(ckpt.parent) == ckpt, "the pointer is ignored; the newest local one wins"
