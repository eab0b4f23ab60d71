"""The exit handler ``deepspeed.initialize`` registers (``comm.close_group_at_exit``) frees the GIL
before the interpreter finalizes.

Why it matters: a gloo worker thread frees a finished collective's tensors itself, and a tensor made in
Python needs the GIL to die.  When a script's last collective returns just before it exits
(transformers' Trainer ends ``train()`` with an ``all_gather``), that worker may still be waiting for
the GIL when the interpreter finalizes; it is then killed inside C++ and the process aborts
("terminate called without an active exception", SIGABRT: seen in .ci/run on a Trainer script's rank).

The race itself needs a loaded host to show; the property the fix rests on does not: a thread that
wants the GIL when the script ends gets it inside the handler.  The main thread keeps the GIL between
bytecodes for 1000 s (``sys.setswitchinterval``), so without a handler that releases it the waiting
thread never runs before finalization and writes nothing.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import sys, threading, time
    from pathlib import Path

    if sys.argv[2] == "handler":  # the control imports nothing: torch's import costs ~4 s of CPU
        from deepshard.compat.deepspeed import comm

        comm.close_group_at_exit()
    go = threading.Event()

    def waiter():  # a gloo worker finishing its release: it needs the GIL once the script ends
        go.wait()
        Path(sys.argv[1]).write_text("ran")
        time.sleep(60)  # hands the GIL back; killed at finalization

    threading.Thread(target=waiter, daemon=True).start()
    sys.setswitchinterval(1000.0)  # the main thread keeps the GIL while it runs Python
    go.set()
""")


def _ran(tmp_path: Path, mode: str) -> bool:
    marker = tmp_path / f"{mode}.txt"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(marker), mode], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return marker.exists()


def test_a_thread_waiting_for_the_gil_at_exit_runs_inside_the_handler(tmp_path):
    assert not _ran(tmp_path, "none")  # the control: nothing frees the GIL, the thread dies unrun
    assert _ran(tmp_path, "handler")
