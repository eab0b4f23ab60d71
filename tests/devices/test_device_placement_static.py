"""Static check: no tensor constructor in packages/ or apps/ without an explicit ``device=``.

Checked: the constructors that allocate on the default device (the CPU) when no device is given:
``CONSTRUCTORS`` below, called as ``torch.<name>(...)``.  Not checked: ``*_like`` and
``tensor.new_*`` (they inherit the device of a tensor), ``torch.from_numpy`` / ``frombuffer`` (host
memory by definition), ``.to(...)``.  ``device=None`` counts as explicit (it follows the caller's
``torch.device`` context, the meta-device build).  On a CPU host the compute device *is* the CPU,
so a forgotten device is invisible until nccl rejects the tensor; hence a check on the source.

Host memory used on purpose is listed in ``ALLOWED`` as ``path:qualified.function`` (``path:*``
for a whole file) with the reason; an entry that no longer matches anything fails the test too.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("packages", "apps")
CONSTRUCTORS = {
    "tensor", "as_tensor", "scalar_tensor", "zeros", "ones", "empty", "full", "empty_strided", "arange", "range",
    "linspace", "logspace", "eye", "rand", "randn", "randint", "randperm", "normal", "tril_indices",
    "triu_indices", "Tensor", "FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor", "LongTensor",
    "IntTensor", "BoolTensor", "ByteTensor",
}
OFFLOAD = "packages/offload/src/deepshard/offload"
FINETUNE = "apps/finetune/src/deepshard/finetune"
ALLOWED = {
    "apps/finetune/src/deepshard/finetune/recipe/faults.py:exhaust_memory":
        "the test-only OOM fault (DEEPSHARD_TEST_FAULT=oom@K): host memory held until the cgroup's OOM killer "
        "takes the worker; it never reaches a collective",
    "packages/compat/src/deepshard/compat/deepspeed/zero.py:_gathered_before_initialize":
        "GatheredParameters before initialize: full host tensors a script loads weights into (the model is not "
        "on a device yet); they reach the broadcast only after .to(local_device())",
    "packages/compat/src/deepshard/compat/deepspeed/schedule.py:_LRCarrier.__init__":
        "a placeholder parameter for a scheduler's optimizer: it carries the lr and is never updated or reduced",
    "packages/compat/src/deepshard/compat/transformers/bridge.py:hf_schedule":
        "a probe optimizer to read transformers' LambdaLR factors: never stepped or reduced",
    f"{OFFLOAD}/pinned.py:*": "pinned host buffers: host memory is the point",
    f"{OFFLOAD}/nvme_store.py:NvmeStateStore.state_dict": "checkpoint copies of swapped-out state, in host memory",
    f"{OFFLOAD}/infinity_store.py:InfinityStore.state_dict":
        "placeholders for views of the memory-mapped swap files a checkpoint saves from (host by design)",
    f"{OFFLOAD}/infinity_store.py:map_file.region":
        "an empty region of a memory-mapped swap file: the same host placeholder as the mapped ones",
    f"{OFFLOAD}/grad_norms.py:GradNorms.reset":
        "per-shard gradient norms of the host staging buffers; the optimizer's total moves to the compute device",
    f"{OFFLOAD}/param_swap.py:_slot_parts":
        "an empty view standing for no bytes of the host staging buffers a gradient is copied into",
    f"{OFFLOAD}/tiled_shard.py:TiledShard.rows":
        "an empty tile for a rank that owns none of its rows, host like the file's rows (the kernel moves "
        "every tile to the compute device before its all-gather)",
    f"{OFFLOAD}/tiled_shard.py:TiledShard.grads_done":
        "the tiled unit's gradient norm, like ParamSwap's per-shard norms (the optimizer's total moves to the "
        "compute device)",
    "packages/kernels/src/deepshard/kernels/host_adam.py:*":
        "the host AdamW pass: its scalars go with the host buffers it updates (ZeRO-Offload's CPU step)",
    "packages/core/src/deepshard/core/checkpoint/consolidate.py:load_full_tensor":
        "export consolidates one tensor at a time into a plain host tensor (no GPU needed)",
    "packages/core/src/deepshard/core/checkpoint/json_state.py:set_rng_state":
        "torch.set_rng_state / cuda.set_rng_state_all take CPU ByteTensors",
    "packages/kernels/src/deepshard/kernels/rms_norm.py:RMSNorm.__init__":
        "a module parameter: follows the caller's torch.device context (meta, then to_empty)",
    f"{FINETUNE}/data/packing.py:*": "data pipeline: host tensors, moved to the device by steppers.model_inputs",
    f"{FINETUNE}/data/resumable.py:*": "data order from a seeded host generator (identical on every rank)",
    f"{FINETUNE}/models/llama/model.py:Llama.init_weights":
        "seeded host RNG: the same init on any device and world size; copied into the (sharded) params",
    f"{FINETUNE}/models/gemma/model.py:Gemma.init_weights":
        "seeded host RNG, as Llama.init_weights: copied into the (sharded) params",
    f"{FINETUNE}/models/gemma/model.py:GemmaRMSNorm.__init__":
        "a module parameter: follows the caller's torch.device context (meta, then to_empty)",
    f"{FINETUNE}/models/lora.py:init_adapters":
        "seeded host RNG for the adapters, as Llama.init_weights: copied into the (sharded) params",
    "packages/compat/src/deepshard/compat/deepspeed/ds_layout.py:DsCheckpoint.full":
        "the DeepSpeed importer assembles each tensor in host memory from the rank files (no GPU, no group)",
    "packages/compat/src/deepshard/compat/deepspeed/ds_export.py:export_zero12":
        "the ZeRO-1/2 exporter writes DeepSpeed's flat per-rank files from host tensors (no GPU, no process group)",
    "packages/compat/src/deepshard/compat/deepspeed/ds_export.py:export_zero3":
        "the ZeRO-3 exporter writes DeepSpeed's per-rank files from host tensors (no GPU, no process group)",
    f"{FINETUNE}/tools/adapter_export.py:export_adapter":
        "export builds the PEFT folder in host memory from the checkpoint files (no process group, no GPU)",
}


def _violations() -> dict[str, list[str]]:
    """``path:qualname`` -> the offending calls (``path:line: source``)."""
    found: dict[str, list[str]] = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            tree = ast.parse(path.read_text(), filename=rel)

            def visit(node: ast.AST, scope: tuple[str, ...], rel: str = rel) -> None:
                for child in ast.iter_child_nodes(node):
                    inner = scope
                    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        inner = (*scope, child.name)
                    if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                            and child.func.attr in CONSTRUCTORS and isinstance(child.func.value, ast.Name)
                            and child.func.value.id == "torch"
                            and not any(k.arg == "device" for k in child.keywords)):
                        key = f"{rel}:{'.'.join(scope) or '<module>'}"
                        found.setdefault(key, []).append(f"{rel}:{child.lineno}: {ast.unparse(child)[:100]}")
                    visit(child, inner)

            visit(tree, ())
    return found


def _allowed(key: str) -> str | None:
    path, _, qualname = key.partition(":")
    for entry in ALLOWED:
        e_path, _, e_name = entry.partition(":")
        if e_path == path and (e_name == "*" or qualname == e_name or qualname.startswith(e_name + ".")):
            return entry
    return None


def test_tensor_constructors_name_their_device() -> None:
    found = _violations()
    bad = [line for key, lines in found.items() if _allowed(key) is None for line in lines]
    assert not bad, ("tensor constructors without device= (a host tensor; nccl rejects it in a collective). "
                     "Pass device=local_device() or the tensor's device, or add an ALLOWED entry with the "
                     "reason host memory is meant:\n" + "\n".join(bad))


def test_allowlist_entries_still_match() -> None:
    used = {_allowed(key) for key in _violations()}
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"ALLOWED entries that match no constructor any more (remove them): {stale}"
