#!/usr/bin/env bash
# The prepared GPU check: one script, at most 8 minutes on one GPU, everything as JSON under $OUT.
#
#   bash bench/gpu_check.sh              # on a CUDA host (OUT defaults to ./bench/out)
#   bash bench/gpu_check.sh --cpu-smoke  # the same parts, tiny and on CPU: checks the script itself
#
# Parts (each under its own timeout, cut further so the whole stays inside BUDGET_S; a part that
# fails or times out is recorded and the next one runs):
#   1. versions.json      torch / CUDA / Triton versions and the device
#   2. kernels_tests.*    pytest tests/kernels -m triton, natively on CUDA tensors
#   3. train/*.json       the app, model=small in bf16 for 30 steps at ZeRO 0-3 with offload
#                         none / cpu / nvme (offload needs stage >= 1) and stage 3 with offload.params=cpu:
#                         step time, tokens/s, MFU, device peak memory (bench/bench_app_run.py)
#   4. kernels_bench.json bench/bench_kernels.py --llama8b (hidden 4096, ffn 14336, vocab 128256; triton,
#                         eager and torch.compile providers), with whatever time is left (<= 150 s)
#   5. gpu_check.json     every part's status, seconds and figures together
set -u
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT="${OUT:-$ROOT/bench/out}"
mkdir -p "$OUT/train"
OUT=$(cd "$OUT" && pwd)
SMOKE=0
[[ "${1:-}" == "--cpu-smoke" ]] && SMOKE=1
BUDGET_S="${BUDGET_S:-470}"  # 8 minutes less a margin for the summary
START=$(date +%s)
PY="${PYTHON:-python}"
exec > >(tee "$OUT/gpu_check.log") 2>&1  # the whole console too
STATUS="$OUT/status.tsv"
: > "$STATUS"

left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }

# part NAME LIMIT_S CMD...: runs CMD with min(LIMIT_S, time left) seconds, records rc and seconds
part() {
  local name=$1 limit=$2; shift 2
  local rest; rest=$(left)
  (( rest < limit )) && limit=$rest
  if (( limit < 15 )); then
    printf '%s\tskipped\t0\n' "$name" >> "$STATUS"; echo "== $name: skipped (budget spent)"; return
  fi
  echo "== $name (<= ${limit}s)"
  local t0; t0=$(date +%s)
  timeout -k 10 "$limit" "$@"
  local rc=$?
  (( rc == 124 || rc == 137 )) && rc=timeout
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$STATUS"
  echo "== $name: rc=$rc in $(( $(date +%s) - t0 ))s"
}

# 1. versions and device
part versions 60 "$PY" - "$OUT/versions.json" <<'EOF'
import json, sys, torch
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
try:
    import triton
    info["triton"] = triton.__version__
except ImportError:
    info["triton"] = None
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(device=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                device_count=torch.cuda.device_count(), nccl=".".join(map(str, torch.cuda.nccl.version())))
else:
    info["device"] = "cpu"
print(json.dumps(info))
json.dump(info, open(sys.argv[1], "w"), indent=1)
EOF

# 2. the Triton kernel tests on CUDA tensors (tests/kernels/conftest.py keeps them on a GPU host)
part kernels_tests $(( SMOKE ? 120 : 100 )) "$PY" -m pytest tests/kernels -m triton -q -p no:cacheprovider \
  --junitxml="$OUT/kernels_tests.xml" -o addopts="" -W ignore

# 2b. the native families on CUDA with the fused kernels against transformers' own models (tests/models/test_family_cuda.py)
part families_cuda 90 "$PY" -m pytest tests/models/test_family_cuda.py -q -p no:cacheprovider -o addopts="" -W ignore
# 2c. MoE: grouped GEMM on CUDA (fp32, against the per-expert loop) and the expert dispatch through a 1-rank nccl
#     all-to-all (one GPU: every expert local, the exchange still runs)
part moe_ep 60 "$PY" -c 'import torch, torch.distributed as dist; from deepshard.core import init_distributed; from deepshard.finetune.models.moe import SparseMoe; init_distributed(); torch.manual_seed(0); d = "cuda" if torch.cuda.is_available() else "cpu"; m = SparseMoe(256, 512, 8, 2, routing="softmax_topk").to(d); [torch.nn.init.normal_(p, std=0.05) for p in m.parameters()]; x = torch.randn(4, 512, 256, device=d); ref = m(x); m.ep_group = dist.group.WORLD; y = m(x); y.sum().backward(); torch.testing.assert_close(y, ref); m.experts.impl = "loop"; torch.testing.assert_close(m(x), ref, rtol=1e-4, atol=1e-4); print("moe_ep ok", dist.get_backend())'
# 2d. Gemma on CUDA's attention paths (flex masks per layer kind, soft-capped scores) against the CPU's
part gemma_cuda 90 "$PY" -m pytest tests/models/test_gemma.py -k cuda -q -p no:cacheprovider -o addopts="" -W ignore

# 3. the app: model=small, bf16, 30 steps, ZeRO 0-3 x offload none/cpu/nvme (+ params on the host)
if (( SMOKE )); then
  COMMON=(model=tiny precision=fp32 train.max_steps=4 data.seq_len=64 train.micro_batch_size=2
          launcher.nproc_per_node=1 train.log_every=2)
  RUNS=("s0_none:+zero=stage0" "s2_cpu:+zero=stage2 +offload=cpu" "s3_nvme:+zero=stage3 +offload=nvme")
  RUN_S=90; WARMUP=1
else
  COMMON=(model=small precision=bf16 train.max_steps=30 data.seq_len=1024 train.micro_batch_size=8
          launcher.nproc_per_node=1 train.log_every=10)
  RUNS=("s0_none:+zero=stage0")
  for s in 1 2 3; do
    RUNS+=("s${s}_none:+zero=stage$s" "s${s}_cpu:+zero=stage$s +offload=cpu" "s${s}_nvme:+zero=stage$s +offload=nvme")
  done
  RUNS+=("s3_cpu_params:+zero=stage3 +offload=cpu offload.params=cpu")
  RUNS+=("s3_muon_bf16:+zero=stage3 optim=muon optim.state_dtype=bf16")
  RUNS+=("s3_compile:+zero=stage3 compile=true")  # per-block torch.compile (issue 42): its tok/s and MFU beside s3_none's
  # unpacked rows cut to a multiple of 64 (issue 42): tokens/s and MFU from the positions computed, whose
  # count rides in the loss's float64 all-reduce over nccl
  RUNS+=("s3_pad_multiple:+zero=stage3 data.pack=false data.pad_to_multiple_of=64")
  RUN_S=40; WARMUP=5
fi
RUNS+=("s3_qlora:+zero=stage3 +peft=lora peft.base_quant=nf4")  # QLoRA: NF4 base sharded by ZeRO-3 (issue 44)
RUNS+=("s2_muon_cpu:+zero=stage2 optim=muon +offload=cpu")  # Muon on the host store: all-to-alls moved to the GPU (issue 44)
SWAP="${NVME_PATH:-$OUT/swap}"
mkdir -p "$SWAP"
for run in "${RUNS[@]}"; do
  name=${run%%:*}
  read -r -a extra <<< "${run#*:}"
  [[ $name == *nvme* ]] && extra+=("offload.nvme_path=$SWAP")
  t=$(( $(left) - 10 )); (( t > RUN_S )) && t=$RUN_S  # the run's own timeout, inside the part's
  part "train_$name" $(( t + 10 )) "$PY" bench/bench_app_run.py --name "$name" --out "$OUT/train" --timeout "$t" \
    --warmup "$WARMUP" -- "${COMMON[@]}" "${extra[@]}" profile.enabled=true
done
rm -rf "$SWAP"

# 4. kernel benchmark at Llama-3-8B shapes against eager and torch.compile
if (( SMOKE )); then
  part kernels_bench 120 sh -c '"$0" bench/bench_kernels.py --quick --only rms_norm,swiglu --repeat 1 --no-compile \
    --out "$1" > /dev/null' "$PY" "$OUT/kernels_bench.json"
else
  part kernels_bench 150 sh -c '"$0" bench/bench_kernels.py --llama8b --repeat 5 --compile --out "$1" > /dev/null' \
    "$PY" "$OUT/kernels_bench.json"
fi

# 5. one summary (always written, even when parts failed)
"$PY" - "$OUT" "$BUDGET_S" "$(( $(date +%s) - START ))" <<'EOF'
import json, sys
from pathlib import Path
out, budget, total = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
parts = {}
for line in (out / "status.tsv").read_text().splitlines():
    name, rc, secs = line.split("\t")
    parts[name] = {"rc": int(rc) if rc.lstrip("-").isdigit() else rc, "seconds": int(secs)}
def load(p):
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None
def junit(p):
    """pytest's junit XML as counts and the names of the tests that did not pass."""
    import xml.etree.ElementTree as ET
    try:
        root = ET.parse(p).getroot()
    except (OSError, ET.ParseError):
        return None
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    bad = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
           if c.find("failure") is not None or c.find("error") is not None]
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")} | {"not_passed": bad}
summary = {"seconds": total, "budget_s": budget, "parts": parts, "versions": load(out / "versions.json"),
           "kernels_tests": junit(out / "kernels_tests.xml"), "kernels_bench": load(out / "kernels_bench.json"),
           "train": {p.stem: load(p) for p in sorted((out / "train").glob("*.json"))}}
(out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
print(f"{'run':<16}{'rc':>8}{'step s':>9}{'tok/s':>10}{'MFU':>7}{'peak GiB':>10}{'reserved':>10}")
for name, r in summary["train"].items():
    r = r or {}
    f = lambda k, fmt: format(r[k], fmt) if isinstance(r.get(k), (int, float)) else "-"
    print(f"{name:<16}{str(r.get('rc', '-')):>8}{f('step_s', '.3f'):>9}{f('tokens_per_s', ',.0f'):>10}"
          f"{f('mfu', '.1%'):>7}{f('device_peak_allocated_gib', '.2f'):>10}{f('device_peak_reserved_gib', '.2f'):>10}")
bad = {k: v["rc"] for k, v in parts.items() if v["rc"] != 0}
print(f"gpu_check: {total}s of {budget}s; parts not clean: {bad or 'none'}; JSON in {out}")
EOF
