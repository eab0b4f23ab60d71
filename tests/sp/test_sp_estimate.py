"""The estimator's activations measured (issues 28, 39): one rank's working set for a training step (the
bench's ``step_growth`` of ``working_set``) against the peak RSS growth a world-2 run measures over that
step (bench/bench_long_context.py's measurement: ``clear_refs`` and VmHWM, large tensors unmapped on
free), within 15%, at sp=1, sp=2 and sp=2 + ``mlp_tiles=8`` + ``ac=full`` + ``ac_offload``, and for
Phi-3 (partial rotary, grouped kv heads, a window shorter than the row); on the transformers path
(GPT-NeoX from transformers' own config class) the estimate is a bound, at most ``RATIO_MAX`` times
the peak.  And ``tools/estimate --fit-memory``: the seq_len it names fits and the next does not, sp=2
with tiling and offloaded checkpoints fits several times sp=1's, bad sizes one line.
One 2-rank launch (~12 s) and in-process checks (~5 s).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = {"sp1": (1, 1, "none", False, 2048), "sp2": (2, 1, "none", False, 4096),
           "sp2_tiles_ac_offload": (2, 8, "full", True, 8192)}  # sp, mlp_tiles, ac, ac_offload, seq_len
FAMILIES = ("phi3", "neox")  # measured at sp=1, ac none, 2048 tokens per rank, in the same launch
SEQ = 2048
RATIO_MAX = 2.1  # the transformers path's bound over its measured peak (see the test's docstring)


def _bench():
    spec = importlib.util.spec_from_file_location("bench_long_context", ROOT / "bench" / "bench_long_context.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def family_config(name: str) -> Any:
    """Phi-3 as Phi-4-mini shapes it (partial rotary 0.75, grouped kv heads) with Phi-3-mini's sliding
    window shorter than the row; GPT-NeoX from transformers' own config class (SDPA, partial rotary,
    fused qkv), read by the transformers path.  Tiny vocabulary and width, so attention and the
    blocks' saved tensors dominate."""
    import json
    import tempfile

    from deepshard.finetune.models import registry

    if name == "phi3":
        return registry.get("phi3").config(vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=2,
                                           ffn_hidden=512, max_seq_len=SEQ, rotary_dim=24, sliding_window=SEQ // 2)
    from transformers import GPTNeoXConfig

    hf = GPTNeoXConfig(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=512, max_position_embeddings=SEQ)
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps({**hf.to_dict(), "architectures": ["GPTNeoXForCausalLM"]}))
        return registry.get("transformers").hf.config_from_hf(d)


def _worker() -> dict:
    from deepshard.core import init_distributed

    init_distributed()  # MALLOC_MMAP_THRESHOLD_ (set by the test) is in force: launch_local's worker applies it
    bench = _bench()
    got = {name: bench._measure(sp, tiles, ac, seq, ac_offload=off)
           for name, (sp, tiles, ac, off, seq) in LAYOUTS.items()}
    return got | {name: bench._measure(1, 1, "none", SEQ, model_cfg=family_config(name)) for name in FAMILIES}


@pytest.fixture(scope="module")
def measured() -> dict:
    """One 2-rank launch for every measurement below (rank 0's results; peaks are the ranks' max)."""
    from deepshard.launch.local import launch_local

    mp = pytest.MonkeyPatch()
    mp.setenv("OMP_NUM_THREADS", "1")
    mp.setenv("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))  # freed tensors leave RSS (the bench's setting)
    try:
        return launch_local(_worker, 2)[0]
    finally:
        mp.undo()


@pytest.mark.slow
def test_activation_estimate_within_15_percent_of_measured_peak(measured):
    got = {name: measured[name] for name in LAYOUTS}
    ratios = {name: r["estimate_mb"] / r["peak_mb"] for name, r in got.items()}
    assert all(0.85 <= v <= 1.15 for v in ratios.values()), (ratios, got)
    # what tiling and offloaded checkpoints buy, seen by both: 4x the tokens in less than sp=1's memory
    assert got["sp2_tiles_ac_offload"]["peak_mb"] < got["sp1"]["peak_mb"]


@pytest.mark.slow
def test_phi3_estimate_within_15_percent_of_measured_peak(measured):
    """Phi-3 runs the Llama decoder (its fused qkv/gate_up split on load), so it shares Llama's count;
    what it adds, the window's [seq, seq] mask per block (SDPA's fp32 additive copy), is 1/3 of this
    step's growth here, and partial rotary keeps nothing more."""
    r = measured["phi3"]
    print("phi3 estimate / measured:", round(r["estimate_mb"] / r["peak_mb"], 3), r)
    assert 0.85 <= r["estimate_mb"] / r["peak_mb"] <= 1.15, r


@pytest.mark.slow
def test_transformers_path_estimate_bounds_the_measured_peak(measured):
    """The transformers path counts what no model's code tells it: a bound.  On GPT-NeoX its blocks
    keep ~20 x dim per token (saved-tensor hooks) where the count takes 15 x dim + 5 x ffn (35 x dim
    here: the most of GPT-2, GPT-NeoX and OLMo2), so the step measures 1.8x below the estimate on
    these unpacked rows (packed ones add a [seq, seq] mask per block on both sides); RATIO_MAX holds
    that with ~15% margin."""
    r = measured["neox"]
    ratio = r["estimate_mb"] / r["peak_mb"]
    print("GPT-NeoX (transformers path) estimate / measured:", round(ratio, 3), r)
    assert 1.0 <= ratio <= RATIO_MAX, r


def test_the_transformers_path_counts_its_attention(tmp_path):
    """SDPA keeps a [seq, seq] mask per block only for packed rows (doc_ids: transformers builds a 4-D
    mask) and no scores; a class without SDPA (GPT-Neo) runs eager and keeps its scores."""
    import json

    import transformers as tf

    from deepshard.finetune.models import registry
    from deepshard.finetune.models.transformers_path import keeps_scores
    from deepshard.finetune.models.working_set import RunShape

    neox = family_config("neox")
    causal = RunShape(stage=1, dp=1, micro_batch_size=2, seq_len=64)
    act = registry.spec_of(neox).activation_memory
    packed = act(neox, dataclasses.replace(causal, doc_mask=True))[0] - act(neox, causal)[0]
    assert packed == neox.n_layers * 2 * 64 * 64 * 4 and not keeps_scores(neox)
    hf = tf.GPTNeoConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global"], 2]])
    (tmp_path / "config.json").write_text(json.dumps({**hf.to_dict(), "architectures": ["GPTNeoForCausalLM"]}))
    neo = registry.get("transformers").hf.config_from_hf(tmp_path)
    assert keeps_scores(neo)
    assert act(neo, causal)[0] >= neo.n_layers * 2 * 64 * neo.n_heads * 64 * (2 * 4 + 1)


def _settings(*overrides: str):
    from deepshard.finetune.config import validate
    from deepshard.finetune.tools.estimate import compose

    return validate(compose(["model.max_seq_len=65536", *overrides]))


@pytest.mark.slow  # searches seq_len with the estimator (~8 s)
def test_fit_memory_names_the_longest_seq_len_that_fits():
    from deepshard.finetune.models.working_set import run_shape, working_set_of
    from deepshard.finetune.tools.estimate import fit_seq_len

    memory = 2 * 2**30
    longest = {}
    for name, extra in {"sp1": [], "sp2": ["launcher.nproc_per_node=2", "parallel.sp=2"],
                        "sp2_tiles_ac_offload": ["launcher.nproc_per_node=2", "parallel.sp=2", "model.mlp_tiles=8",
                                                 "ac=full", "ac_offload=true"]}.items():
        s = _settings("train.micro_batch_size=1", *extra)
        seq, size = fit_seq_len(s, memory)
        shape = run_shape(s)
        assert seq % shape.sp == 0 and size <= memory, (name, seq, size)
        at = working_set_of(s, baseline=0, shape=dataclasses.replace(shape, seq_len=seq // shape.sp)).ram(False)
        more = working_set_of(s, baseline=0, shape=dataclasses.replace(shape, seq_len=seq // shape.sp + 1)).ram(False)
        assert more + (size - at) > memory, (name, seq)  # one more token per rank does not fit (same baseline)
        longest[name] = seq
    print(longest)
    assert longest["sp2"] >= 1.7 * longest["sp1"], longest  # the fixed parts (model states, process) do not halve
    assert longest["sp2_tiles_ac_offload"] >= 3 * longest["sp1"], longest


@pytest.mark.parametrize("size", ["2GX", "-1GiB", "lots"])
def test_fit_memory_bad_size_is_one_line(size, capsys):
    from deepshard.finetune.tools.estimate import main

    assert main(["--fit-memory", size]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--fit-memory={size}" in err and "GiB" in err, err


@pytest.mark.slow  # a fresh interpreter; the in-process tests above keep the inner loop's coverage
def test_fit_memory_cli_prints_one_line():
    # its own process, as users run it: the baseline is read from the process (a test runner's grows)
    proc = subprocess.run([sys.executable, "-m", "deepshard.finetune.tools.estimate", "--fit-memory", "1GiB",
                           "train.micro_batch_size=1", "model.max_seq_len=65536", "launcher.nproc_per_node=2",
                           "parallel.sp=2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout.strip()
    assert len(out.splitlines()) == 1 and out.startswith("largest data.seq_len that fits 1.00GB"), out
