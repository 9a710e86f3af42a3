"""Hugging Face datasets as ``--data``: a ``save_to_disk`` directory (a ``Dataset``, or a
``DatasetDict`` whose ``train`` split is read), or Parquet / Arrow files (one, or a
directory of them in sorted order).

Each row is one document: its text column (``--text-column``, default ``text``)
tokenized like a ``.jsonl`` line, or, where the dataset has no such column and holds
``input_ids``, its ids as they are. The rows are read through ``datasets`` (a
``save_to_disk`` directory) or pyarrow (the files), memory-mapped, a record batch at a
time: never the whole dataset in memory. Neither runs code from the files (Arrow and
Parquet hold data and a schema; no pickle is read).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from fxpipe.base.safe_io import check_regular, read_json_object

DATASET_SUFFIXES = (".parquet", ".arrow")
SAVED_MARKS = ("state.json", "dataset_dict.json")
"""Files ``save_to_disk`` writes at the top of a Dataset's / DatasetDict's directory."""
IDS_COLUMN = "input_ids"
TRAIN_SPLIT = "train"
_ROWS = 1024


def is_dataset(path: Path) -> bool:
    """A Parquet/Arrow file, a ``save_to_disk`` directory or a directory of Parquet/Arrow files."""
    if not path.is_dir():
        return path.suffix in DATASET_SUFFIXES
    if any((path / m).is_file() for m in SAVED_MARKS):
        return True
    return any(f.suffix in DATASET_SUFFIXES for f in path.iterdir() if f.is_file() and not f.name.startswith("."))


def dataset_files(path: Path) -> list[Path]:
    """The files a dataset's cache key covers: ``path``, or every regular file under the
    directory (hidden ones left out, links never followed), sorted."""
    if not path.is_dir():
        check_regular(path)
        return [path]
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        out += [Path(dirpath) / n for n in sorted(filenames) if not n.startswith(".")]
    return [f for f in out if not f.is_symlink()]


def check_dataset_dir(path: Path) -> None:
    """A dataset directory is read whole by pyarrow or ``datasets``, which follow links: one
    holding a link is refused naming it (text directories never read theirs either:
    ``text.skipped_links``); and one holding dataset and text files both is refused, since
    reading it as a dataset would silently leave the text out."""
    if not path.is_dir():
        return
    found: dict[str, list[str]] = {"link": [], "data": [], "text": []}
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for n in sorted(filenames + [d for d in dirnames if (Path(dirpath) / d).is_symlink()]):
            f = Path(dirpath) / n
            if n.startswith("."):
                continue
            kind = "link" if f.is_symlink() else "data" if f.suffix in DATASET_SUFFIXES else \
                "text" if f.suffix in (".txt", ".jsonl") else None
            if kind is not None:
                found[kind].append(str(f.relative_to(path)))
    if found["link"]:
        raise ValueError(f"{path}: the dataset directory holds symbolic links ({', '.join(found['link'][:4])}); a "
                         f"dataset is read whole and a link could lead outside it: copy the files in instead")
    if found["data"] and found["text"] and not any((path / m).is_file() for m in SAVED_MARKS):
        raise ValueError(f"{path} holds dataset files ({', '.join(found['data'][:3])}) and text files "
                         f"({', '.join(found['text'][:3])}); fxpipe reads a directory as one or the other, never "
                         f"half of it: put each kind in its own directory")


@dataclass(frozen=True)
class DatasetRows:
    """The rows of one dataset split, read a record batch at a time."""
    path: Path
    column: str
    ids: bool
    """True: ``column`` holds token ids (a list of integers per row), taken as they are."""
    rows: int
    tables: Any
    """() -> iterator of pyarrow tables of ``column`` (the batches, in row order)."""

    def documents(self) -> Iterator[tuple["str | np.ndarray", int]]:
        """Each row's text (or ids), with 1 (the unit of progress: rows)."""
        row = 0
        for table in self.tables():
            for value in table.column(0).to_pylist():
                if value is None:
                    raise ValueError(f"{self.path}: row {row} of column {self.column!r} is empty (null); drop or "
                                     f"fill such rows (dataset.filter(lambda r: r[{self.column!r}] is not None))")
                if self.ids:
                    value = np.asarray(value, dtype=np.int64)
                    if value.size and value.min() < 0:
                        raise ValueError(f"{self.path}: row {row} of {self.column!r} holds negative token ids")
                yield value, 1
                row += 1


def _resolve_column(path: Path, names: list[str], column: str, types: dict[str, str]) -> tuple[str, bool]:
    """(column, ids?) from the schema: the text column when it is there, else ``input_ids``."""
    if column in names:
        kind = types[column]
        if "string" in kind:
            return column, False
        if _is_id_list(kind):
            return column, True
        raise ValueError(f"{path}: column {column!r} holds {kind}, not text (string) or token ids (a list of "
                         f"integers); choose another with --text-column ({', '.join(names)})")
    if column == "text" and IDS_COLUMN in names:
        if _is_id_list(types[IDS_COLUMN]):
            return IDS_COLUMN, True
        raise ValueError(f"{path} has no column 'text', and its {IDS_COLUMN!r} holds {types[IDS_COLUMN]}, not token "
                         f"ids (one flat list of integers per row); give token ids as integers, or name a text "
                         f"column with --text-column ({', '.join(names)})")
    raise ValueError(f"{path} has no column {column!r} (its columns: {', '.join(names) or 'none'}); name the text "
                     f"column with --text-column")


def _is_id_list(kind: str) -> bool:
    """An Arrow type of one flat list of integers per row ("list<item: int64>"): not floats,
    not lists of lists."""
    return kind.count("list") == 1 and "int" in kind and "float" not in kind and "double" not in kind


def open_rows(path: Path, column: str = "text") -> DatasetRows:
    """The rows of dataset ``path`` (see the module's docstring); a ValueError naming the
    columns or splits when ``column`` or the ``train`` split is not there, or no rows."""
    if path.is_dir() and any((path / m).is_file() for m in SAVED_MARKS):
        rows = _saved(path, column)
    else:
        rows = _files(path, column)
    if rows.rows == 0:
        raise ValueError(f"{path} holds no rows; give a dataset (split) with documents")
    return rows


def _saved(path: Path, column: str) -> DatasetRows:
    try:  # an optional extra (pip install 'fxpipe[data]'): only a dataset run needs it
        import datasets
    except ImportError:
        raise ValueError(f"{path} is a Hugging Face dataset directory: reading it needs the datasets package "
                         f"(pip install datasets)") from None
    # load_from_disk fails on a split without files (IndexError): said in words first.
    for state, where in ((path / "state.json", ""), (path / TRAIN_SPLIT / "state.json", f" in its {TRAIN_SPLIT!r} split")):
        if state.is_file() and not state.is_symlink() and read_json_object(state, 1 << 24).get("_data_files") == []:
            raise ValueError(f"{path} holds no rows{where}; give a dataset (split) with documents")
    try:
        ds = datasets.load_from_disk(str(path), keep_in_memory=False)
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:  # damaged or partial directories
        raise ValueError(f"{path} is not a readable Hugging Face dataset directory ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:160]})") from None
    if isinstance(ds, datasets.DatasetDict):
        if TRAIN_SPLIT not in ds:
            raise ValueError(f"{path} holds the splits {', '.join(ds) or 'none'}, no {TRAIN_SPLIT!r}; give the "
                             f"split's own directory ({path}/<split>)")
        ds = ds[TRAIN_SPLIT]
    types = {n: str(t) for n, t in zip(ds.data.schema.names, ds.data.schema.types)}
    name, ids = _resolve_column(path, list(ds.column_names), column, types)
    part = ds.select_columns([name]).with_format("arrow")
    return DatasetRows(path, name, ids, len(ds), lambda: part.iter(batch_size=_ROWS))


def _arrow_table(f: Path) -> Any:
    import pyarrow as pa  # with the datasets extra (see _saved)

    source = pa.memory_map(str(f), "r")
    try:
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:  # save_to_disk writes the stream format
        source.seek(0)
        return pa.ipc.open_stream(source).read_all()


def _files(path: Path, column: str) -> DatasetRows:
    try:  # an optional extra, as above
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading Parquet/Arrow files needs pyarrow (pip install datasets)") from None
    files = [f for f in dataset_files(path) if f.suffix in DATASET_SUFFIXES]
    if not files:
        raise ValueError(f"{path} holds no .parquet or .arrow files")
    schemas, counts = [], []
    for f in files:
        try:
            if f.suffix == ".parquet":
                meta = pq.ParquetFile(str(f))
                schemas.append(meta.schema_arrow)
                counts.append(meta.metadata.num_rows)
            else:
                table = _arrow_table(f)
                schemas.append(table.schema)
                counts.append(table.num_rows)
        except (pa.ArrowException, OSError) as exc:
            raise ValueError(f"{f} is not a readable {f.suffix[1:]} file ({' '.join(str(exc).split())[:160]})") from None
    types = {n: str(t) for n, t in zip(schemas[0].names, schemas[0].types)}
    name, ids = _resolve_column(files[0], list(schemas[0].names), column, types)
    for f, schema in zip(files[1:], schemas[1:]):
        if name not in schema.names:
            raise ValueError(f"{f} has no column {name!r} ({files[0]} has): every file of a dataset needs it")

    def tables() -> Iterator[Any]:
        for f in files:
            if f.suffix == ".parquet":
                for batch in pq.ParquetFile(str(f)).iter_batches(batch_size=_ROWS, columns=[name]):
                    yield pa.Table.from_batches([batch])
            else:
                table = _arrow_table(f).select([name])
                for start in range(0, table.num_rows, _ROWS):
                    yield table.slice(start, _ROWS)

    return DatasetRows(path, name, ids, sum(counts), tables)
