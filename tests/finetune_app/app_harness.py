"""Shared by the finetune app tests: small data files made in tmp_path, a tiny model, the CLI."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from deepshard.finetune.data.corpus import generate
from tests.app_runner import MAIN, run_main  # noqa: F401  (MAIN: what the tests import from here)

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parent / "fixtures"
# a ~0.4M-parameter Llama (the embedded tokenizer's 2048 tokens dominate): quick on 2 CPU cores
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128",
        "data.seq_len=64", "train.log_every=2", "optim.lr=0.01"]


def prompt_response_rows(n: int, seed: int = 3) -> list[dict]:
    """Stories split into a prompt (first two sentences) and a response (the rest)."""
    rows = []
    for story in generate(n, seed=seed):
        parts = story.split(". ")
        rows.append({"prompt": ". ".join(parts[:2]) + ".", "response": " " + ". ".join(parts[2:])})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_save_to_disk(root: Path, rows: list[dict], split: str | None = None) -> Path:
    """The layout ``datasets.Dataset.save_to_disk`` writes: Arrow IPC stream shards + state.json
    (+ dataset_dict.json for a DatasetDict), made with pyarrow alone."""
    import pyarrow as pa

    target = root / split if split else root
    target.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    name = "data-00000-of-00001.arrow"
    with pa.OSFile(str(target / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    (target / "state.json").write_text(json.dumps({"_data_files": [{"filename": name}], "_fingerprint": "0",
                                                   "_format_columns": None, "_format_kwargs": {},
                                                   "_format_type": None, "_output_all_columns": False,
                                                   "_split": split}))
    (target / "dataset_info.json").write_text(json.dumps({"features": {k: {"dtype": "string", "_type": "Value"}
                                                                        for k in rows[0]}}))
    if split:
        (root / "dataset_dict.json").write_text(json.dumps({"splits": [split]}))
    return root


def run_app(cwd: Path, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python apps/finetune/main.py OVERRIDES hydra.run.dir=cwd/run`` (through the pytest worker's app runner)."""
    return run_main([*overrides, f"hydra.run.dir={cwd / 'run'}"], cwd=cwd, timeout=timeout)


def scalars(logdir: Path) -> dict[str, list[float]]:
    """Every scalar series in a TensorBoard directory, read back with EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
