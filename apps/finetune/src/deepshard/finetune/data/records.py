"""User data as records: JSON lines, plain text files, or a saved HF dataset / parquet files.

A record is ``{"text": str}`` (causal LM: every token learned) or ``{"prompt": str, "response": str}``
(loss on the response only).  Bad data raises a ValueError naming the file and the line (or row)
while records are read, so ``check_records`` run before training catches it before any work.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from pathlib import Path

Record = dict[str, str]


def expand(path: str | None, key: str = "data.path") -> list[str]:
    """Files named by a path, a directory (every file in it) or a glob (``**`` recursive), sorted."""
    if not path:
        raise ValueError(f"{key}=None: this data source needs {key}=FILE (a file, a directory or a glob)")
    p = os.path.expanduser(path)
    if os.path.isdir(p):
        files = sorted(str(f) for f in Path(p).rglob("*") if f.is_file() and not f.name.startswith("."))
    else:
        files = sorted(f for f in glob.glob(p, recursive=True) if os.path.isfile(f))
    if not files:
        raise ValueError(f"{key}={path!r}: no file matches")
    return files


def _record(obj: object, where: str, text_field: str, prompt_field: str, response_field: str) -> Record:
    """One validated record from a JSON object or a table row."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if obj.get(text_field) is not None:
        fields = {"text": text_field}
    elif obj.get(prompt_field) is not None or obj.get(response_field) is not None:
        fields = {"prompt": prompt_field, "response": response_field}
    else:
        raise ValueError(f"{where}: missing field {text_field!r} (or {prompt_field!r} and {response_field!r}); "
                         f"found {sorted(obj)}")
    out = {}
    for name, field in fields.items():
        value = obj.get(field)
        if value is None:
            raise ValueError(f"{where}: missing field {field!r} (a {prompt_field!r}/{response_field!r} record "
                             f"needs both)")
        if not isinstance(value, str):
            raise ValueError(f"{where}: field {field!r} must be a string, got {type(value).__name__}")
        out[name] = value
    return out


def _utf8(raw: bytes, file: str, lineno: int = 1) -> str:
    """``raw`` decoded, or a ValueError naming the file, the line and the column of the first bad byte
    (``lineno`` is the number of ``raw``'s first line: a whole file's bytes are located too)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = lineno + raw.count(b"\n", 0, e.start)
        column = e.start - raw.rfind(b"\n", 0, e.start)
        raise ValueError(f"{file}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {column}); "
                         f"save it as UTF-8 (from Latin-1: iconv -f latin1 -t utf-8)") from None


def json_lines(path: str | None) -> Iterator[tuple[str, object]]:
    """(``FILE:LINE``, the parsed object) for each non-blank line of each JSON-lines file; a ValueError
    naming file and line for text that is not UTF-8 or not JSON, and for a file with no JSON line."""
    for file in expand(path):
        count = 0
        with open(file, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                line = _utf8(raw, file, lineno)
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{file}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
                yield f"{file}:{lineno}", obj
                count += 1
        if count == 0:
            raise ValueError(f"{file}: empty file (no JSON lines)")


def jsonl_records(path: str | None, *, text_field: str = "text", prompt_field: str = "prompt",
                  response_field: str = "response") -> Iterator[Record]:
    """Each non-blank line of each file is one JSON object (blank lines are skipped)."""
    for where, obj in json_lines(path):
        yield _record(obj, where, text_field, prompt_field, response_field)


def text_records(path: str | None, *, text_unit: str = "file") -> Iterator[Record]:
    """Plain text: each file is a document (``text_unit=file``), or each paragraph / line of it."""
    for file in expand(path):
        with open(file, "rb") as f:
            content = _utf8(f.read(), file)
        if not content.strip():
            raise ValueError(f"{file}: empty file")
        if text_unit == "file":
            parts = [content]
        elif text_unit == "paragraph":
            parts = [p for p in content.split("\n\n")]
        else:
            parts = content.splitlines()
        for part in parts:
            if part.strip():
                yield {"text": part.strip("\n")}


def _arrow_files(path: str, split: str) -> list[str]:
    """The arrow shards of a ``save_to_disk`` directory (a Dataset, or one split of a DatasetDict)."""
    root = Path(path)
    if (root / "dataset_dict.json").exists():
        splits = json.loads((root / "dataset_dict.json").read_text())["splits"]
        if split not in splits:
            raise ValueError(f"data.split={split!r}: {path} holds the splits {splits}")
        root = root / split
    state = root / "state.json"
    if not state.exists():
        raise ValueError(f"data.path={path!r}: not a save_to_disk directory (no state.json) and no parquet files")
    return [str(root / f["filename"]) for f in json.loads(state.read_text())["_data_files"]]


def _read_table(file: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if file.endswith(".parquet"):
            return pq.read_table(file)
        with pa.memory_map(file) as source:  # save_to_disk writes Arrow IPC streams
            return pa.ipc.open_stream(source).read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{file}: not readable as {'parquet' if file.endswith('.parquet') else 'arrow'} ({e})") \
            from None


def hf_disk_records(path: str | None, *, split: str = "train", text_field: str = "text",
                    prompt_field: str = "prompt", response_field: str = "response") -> Iterator[Record]:
    """A dataset written by ``datasets``' ``save_to_disk``, or parquet files (a file, directory or glob)."""
    if path and os.path.isdir(path) and not any(Path(path).glob("*.parquet")):
        files = _arrow_files(path, split)
    else:
        files = [f for f in expand(path) if f.endswith(".parquet")]
        if not files:
            raise ValueError(f"data.path={path!r}: no parquet files and not a save_to_disk directory")
    wanted = {text_field, prompt_field, response_field}
    for file in files:
        table = _read_table(file)
        columns = [c for c in table.column_names if c in wanted]
        if not columns:
            raise ValueError(f"{file}: missing column {text_field!r} (or {prompt_field!r} and {response_field!r}); "
                             f"found {table.column_names}")
        if table.num_rows == 0:
            raise ValueError(f"{file}: empty dataset (0 rows)")
        for row, obj in enumerate(table.select(columns).to_pylist()):
            yield _record(obj, f"{file}: row {row}", text_field, prompt_field, response_field)


READERS = ("jsonl", "text", "hf_disk")  # data.name values read as records (text, or prompt/response)


def read_records(data) -> Iterator[Record]:
    """The records of a file-backed source, from its typed ``data`` config (``data.name`` in READERS)."""
    fields = {"text_field": data.text_field, "prompt_field": data.prompt_field, "response_field": data.response_field}
    if data.name == "jsonl":
        return jsonl_records(data.path, **fields)
    if data.name == "text":
        return text_records(data.path, text_unit=data.text_unit)
    assert data.name == "hf_disk", data.name  # config.validate admits only SOURCES' names
    return hf_disk_records(data.path, split=data.split, **fields)
