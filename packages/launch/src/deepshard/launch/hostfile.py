"""DeepSpeed's hostfile and its ``--include``/``--exclude`` filters, with DeepSpeed's meanings.

A hostfile has one ``host slots=N`` line per host (``#`` comments and blank lines allowed); a
filter is ``NODE_SPEC[@NODE_SPEC ...]`` with ``NODE_SPEC = host[:slot[,slot ...]]``: ``--include
worker-0@worker-1:0,2`` uses every slot of worker-0 and slots 0 and 2 of worker-1; ``--exclude
worker-1:0`` uses everything but slot 0 of worker-1.  The result keeps the hostfile's host order,
which is the order of the nodes.  Mistakes are ValueErrors naming the file and line, or the host
and slot, with what is valid.  A node has at most ``MAX_SLOTS`` slots: the number is checked before
anything is sized by it (``slots=300000000`` would be a list of gigabytes).
"""

from __future__ import annotations

import re
from pathlib import Path

Resources = dict[str, list[int]]  # host -> its slots (GPU indices, or worker numbers on a CPU host)
# workers on one node: far above any node's accelerators or cores, and small enough that a node's slot
# list stays a few KiB (every node receives the job's slot lists on its command line, --world_info)
MAX_SLOTS = 4096

_LINE = re.compile(r"^(\S+)\s+slots=(\d+)\s*(#.*)?$")


def read_hostfile(path: str | Path) -> dict[str, int]:
    """``host -> slots`` from a hostfile, in the file's order."""
    pool: dict[str, int] = {}
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--hostfile={path}: cannot be read ({err.__class__.__name__}: {err})") from None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            raise ValueError(f"{path}:{number}: {line!r} is not a hostfile line: expected 'HOST slots=N' "
                             "(e.g. 'worker-1 slots=8'), a '#' comment or a blank line")
        host, digits = match.group(1), match.group(2)
        slots = int(digits) if len(digits.lstrip("0")) <= len(str(MAX_SLOTS)) else MAX_SLOTS + 1  # no 5000-digit int
        if not 1 <= slots <= MAX_SLOTS:
            shown = digits if len(digits) <= 24 else f"{digits[:20]}... ({len(digits)} digits)"
            raise ValueError(f"{path}:{number}: {host} slots={shown}: slots must be an integer from 1 to "
                             f"{MAX_SLOTS} (the workers of one node)")
        if host.startswith("-"):
            raise ValueError(f"{path}:{number}: host {host!r}: a host name cannot start with '-' (ssh would read "
                             "it as an option)")
        if host in pool:
            raise ValueError(f"{path}:{number}: host {host} is listed twice (first with slots={pool[host]})")
        pool[host] = slots
    if not pool:
        raise ValueError(f"--hostfile={path}: names no host: expected lines of 'HOST slots=N'")
    return pool


def _parse_filter(flag: str, text: str, pool: Resources) -> list[tuple[str, list[int] | None]]:
    """``[(host, slots or None for every slot)]`` of an include/exclude string, checked against ``pool``."""
    specs = []
    for spec in text.split("@"):
        host, sep, slot_text = spec.partition(":")
        if not host:
            raise ValueError(f"{flag}={text}: {spec!r} names no host: the syntax is host[:slot,...][@host...]")
        if host not in pool:
            raise ValueError(f"{flag}={text}: host {host!r} is not in the hostfile (hosts: {', '.join(pool)})")
        if not sep:
            specs.append((host, None))
            continue
        try:
            slots = [int(s) for s in slot_text.split(",")]
        except ValueError:
            raise ValueError(f"{flag}={text}: {slot_text!r} after {host}: is not a comma-separated list of slot "
                             "numbers") from None
        for slot in slots:
            if slot not in pool[host]:
                raise ValueError(f"{flag}={text}: host {host} has no slot {slot} (its slots: "
                                 f"{','.join(map(str, pool[host]))})")
        specs.append((host, slots))
    return specs


def select(pool: dict[str, int], include: str = "", exclude: str = "") -> Resources:
    """The slots to run on: every slot of every host, or what ``include`` names, or all but what
    ``exclude`` names (DeepSpeed's ``parse_resource_filter``); hosts left with no slot drop out."""
    slots: Resources = {host: list(range(n)) for host, n in pool.items()}
    if include and exclude:
        raise ValueError(f"--include={include} and --exclude={exclude}: use one of them, not both")
    if include:
        chosen: Resources = {}
        for host, picked in _parse_filter("--include", include, slots):
            chosen[host] = sorted(set(chosen.get(host, []) + (picked if picked is not None else slots[host])))
        slots = {host: chosen[host] for host in slots if host in chosen}  # the hostfile's order
    elif exclude:
        for host, picked in _parse_filter("--exclude", exclude, slots):
            slots[host] = [] if picked is None else [s for s in slots[host] if s not in picked]
        slots = {host: s for host, s in slots.items() if s}
    if not slots:
        raise ValueError(f"--exclude={exclude}: leaves no host to run on")
    return slots


def limit(resources: Resources, *, num_nodes: int, num_gpus: int) -> Resources:
    """DeepSpeed's ``--num_nodes`` (the first N hosts) and ``--num_gpus`` (slots 0..N-1 of each)."""
    hosts = list(resources)
    if num_nodes > 0:
        if num_nodes > len(hosts):
            raise ValueError(f"--num_nodes={num_nodes}: only {len(hosts)} host(s) to run on "
                             f"({', '.join(hosts)})")
        hosts = hosts[:num_nodes]
    return {host: list(range(num_gpus)) if num_gpus > 0 else resources[host] for host in hosts}
