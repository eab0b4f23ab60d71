"""A ZeRO-3 world-2 load of a HF checkpoint (146 MiB of random fp32 Llama weights, vocabulary 32001:
the embedding's and the head's last shard is one row short) inside a memory cgroup v1 whose limit
leaves the two ranks, over what they hold once imported and joined, the checkpoint plus its largest
tensor.  Each rank reads only its rows of each tensor, so it loads; the loader that read whole tensors
(after a whole random draw per tensor) needed about 1.8 largest tensors more per rank and was
OOM-killed there (issue 39; README "Loading without host-memory spikes").  Each rank's shard equals
``load_file``'s tensor chunked as FSDP2 shards dim 0.  Needs root and the memory controller. ~8 s."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from bench.bench_infinity import cgroup_available, memory_cgroup
from bench.bench_load_memory import checksum, launch, make_checkpoint

WORLD = 2
SLACK = 48 * 2**20  # FSDP2's own buffers, the gloo group's, the allocator's rounding


def _held(group) -> int:
    """What the group's processes hold that cannot be reclaimed: anonymous and mapped file pages."""
    stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
    return int(stat["rss"]) + int(stat["mapped_file"])


@pytest.mark.slow
@pytest.mark.skipif(not cgroup_available(), reason="needs root and the cgroup v1 memory controller")
def test_zero3_load_fits_a_limit_the_whole_tensor_reads_exceeded(tmp_path):
    made = make_checkpoint(tmp_path / "ckpt", vocab=32001, dim=512, layers=2)
    allowance = made["bytes"] + made["largest_tensor"] + SLACK
    limits = []
    with memory_cgroup(64 * 2**30) as group:
        def confine() -> None:
            limits.append(_held(group) + allowance)
            (group / "memory.limit_in_bytes").write_text(str(limits[0]))

        ranks = launch(tmp_path / "ckpt", WORLD, group=group, when_ready=confine, timeout_s=120)
        failcnt = int((group / "memory.failcnt").read_text())
    assert all(isinstance(r, dict) for r in ranks), f"ranks {ranks} (-9: OOM-killed) under {limits}"
    full = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    for rank, got in enumerate(ranks):
        want = {k.removeprefix("model."): checksum(t.chunk(WORLD)[rank]) for k, t in full.items()}
        assert got["sums"] == want, rank
        # the load's own peak: this rank's shard plus its slice of one tensor (the estimator's load_peak)
        assert got["anon_growth"] <= made["bytes"] / WORLD + made["largest_tensor"] / WORLD + SLACK, (got, made)
    print({"limit_over_held_mib": allowance >> 20, "failcnt": failcnt,
           "anon_growth_mib": [r["anon_growth"] >> 20 for r in ranks], "checkpoint_mib": made["bytes"] >> 20})
