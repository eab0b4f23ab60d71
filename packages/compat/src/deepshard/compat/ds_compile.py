"""A ds_config's ``compile`` section, key by key.

DeepSpeed 0.19.8 reads the section into ``deepspeed/compile/config.py``'s ``CompileConfig``: every key
configures DeepCompile (``deepcompile`` and its passes' switches), and a model is compiled only by
``engine.compile()``.  DeepSpeed 0.14-0.16.5 had ``{"enabled": true, "backend": "inductor", "kwargs": {}}``
(``deepspeed/runtime/compiler.py``), which compiled at ``initialize``.  Here:

- ``enabled: true`` (the older form) -> ``compile=true``: per-block ``torch.compile`` in the recipe;
- ``backend``: ``inductor`` only (the backend our blocks are tested with);  ``kwargs``: refused when not empty;
- ``deepcompile: true`` -> refused: DeepCompile rewrites the traced graph to place ZeRO-3's all-gathers
  and reduce-scatters itself (its passes: prefetch, selective gather, offload); our ZeRO-3 is FSDP2,
  whose collectives run in hooks around each compiled block, so there is no graph of the whole step
  to rewrite.  Use ``compile=true`` (``engine.compile()``), which keeps ZeRO's overlap;
- DeepCompile's switches (``free_activation``, ``offload_activation``, ``offload_opt_states``,
  ``double_buffer``, ``symmetric_memory``, ...) without ``deepcompile`` change nothing in DeepSpeed
  either: noted, not applied.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DEEPCOMPILE_KEYS", "translate_compile"]

DEEPCOMPILE_KEYS = ("free_activation", "free_activation_threshold", "offload_activation", "offload_opt_states",
                    "offload_parameters", "double_buffer", "symmetric_memory", "dump_graphs", "debug_log",
                    "sync_before_reduce", "sync_after_reduce", "sync_before_allgather", "sync_after_allgather",
                    "keep_int_input_tensors", "keep_all_input_tensors")

DEEPCOMPILE_REFUSED = ("compile.deepcompile=true: DeepCompile rewrites a traced graph to place ZeRO-3's "
                       "all-gathers and reduce-scatters; deepshard's ZeRO-3 is FSDP2, whose collectives run in hooks "
                       "around each compiled block: drop deepcompile and keep per-block compile "
                       "(compile.enabled=true, engine.compile(), or the app's compile=true)")


def translate_compile(section: dict[str, Any], tr: Any) -> None:
    """Map ``section`` onto ``tr`` (ds_config's ``_Translator``); ValueError for what cannot mean the same."""
    t = tr.t
    if section.get("deepcompile") is True:
        raise ValueError(DEEPCOMPILE_REFUSED)
    for key, value in section.items():
        dotted = f"compile.{key}"
        if key == "deepcompile":
            continue  # false: nothing to do
        if key == "enabled":
            if not isinstance(value, bool):
                raise ValueError(f"{dotted}={value!r}: must be true or false")
            if value:
                tr.set("compile", True, dotted)
        elif key == "backend":
            if str(value) != "inductor":
                raise ValueError(f"{dotted}={value!r}: only 'inductor' is supported (the backend compiled "
                                 "blocks are tested with)")
        elif key == "kwargs":
            if value:
                t.unsupported.append(f"{dotted}={value}")
        elif key in DEEPCOMPILE_KEYS:
            t.notes.append(f"{dotted}: read only by DeepCompile (off): no effect, as in DeepSpeed")
        else:
            t.unsupported.append(dotted)
