"""``deepshard``: DeepSpeed's launcher command, its flags and their meanings, over torch's elastic agent.

    deepshard --num_gpus=2 train.py --lr 1e-4             one node, 2 workers (a CPU host: 2 processes)
    deepshard --module pkg.train ...                      python -m pkg.train
    deepshard --no_python ./train.sh ...                  an executable
    deepshard --hostfile=hosts --include=a:0,1@b train.py  the hosts of a hostfile, over ssh
    deepshard --no_ssh --node_rank=1 --num_nodes=2 --master_addr=a train.py   run on each node yourself
    deepshard --launcher=slurm --hostfile=hosts train.py  inside a Slurm allocation (srun, one agent per node)
    deepshard --accelerate_config deepspeed_zero3.yaml train.py   accelerate's DeepSpeed yaml (one node)

Each worker gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and
``--local_rank=N`` before its own arguments (not with ``--no_local_rank``), and the variables of
``.deepspeed_env`` (``DS_ENV_FILE``).  Differences from DeepSpeed: on a CPU-only host
``--num_gpus``/``--num_accelerators`` counts worker processes (any positive number; default 2); a
one-node job without ``--master_port`` takes a free port; ``--max_restarts`` (default 0) restarts the
workers after a failure, and over ssh starts again a node other than node 0 that went away (its session
ended without an ``error:`` line: ``remote.run_over_ssh``); ``--hang_s`` (default 300; 0: off) ends a job whose rank reports progress
(``deepshard.launch.heartbeat``) and makes none for that long.

Exit codes: 0 every worker succeeded; 2 bad input, refused before anything started; the failed
worker's own exit code, or 128+N when it died of signal N (137: SIGKILL) or when the launcher was
stopped by signal N; 1 a hung rank or a failed rendezvous.  A failure ends with one last line
``error: ...`` naming the host, the rank and the cause.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.machinery
import math
import os
import shutil
import socket
import sys
import uuid
from collections.abc import Sequence

from deepshard.launch import remote
from deepshard.launch.agent import Failure, NodeConfig, run_node, worker_command
from deepshard.launch.env_file import job_env, unforwardable
from deepshard.launch.hostfile import MAX_SLOTS, Resources, limit, read_hostfile, select
from deepshard.launch.parent_death import end_with_stdin

DEFAULT_HOSTFILE = "/job/hostfile"  # DeepSpeed's: used when it exists and --hostfile is not given
DEFAULT_PORT = 29500
CPU_WORKERS = 2  # a CPU-only host's default worker count, as the app's
PROVIDE_DEEPSPEED = "DEEPSHARD_DEEPSPEED"  # read by deepshard.compat.provide_deepspeed (no import: launch < compat)
# DeepSpeed flags deepshard parses but does not offer (refused, named, rather than ignored)
# (dest -> (flag, whether it takes a value))
NOT_OFFERED = {"save_pid": ("--save_pid", False), "autotuning": ("--autotuning", True),
               "bind_cores_to_rank": ("--bind_cores_to_rank", False), "bind_core_list": ("--bind_core_list", True),
               "enable_each_rank_log": ("--enable_each_rank_log", True)}


class UsageError(ValueError):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, raised (argparse would print usage and exit)
        if message.startswith("unrecognized arguments: "):
            message = unknown_flag_line(self, message.split(": ", 1)[1].split())
        raise UsageError(message)


def unknown_flag_line(parser: argparse.ArgumentParser, unknown: Sequence[str]) -> str:
    flag = unknown[0].split("=", 1)[0]
    valid = [s for s in parser._option_string_actions if s.startswith("--")]
    near = difflib.get_close_matches(flag.replace("-", "_").replace("__", "--", 1), valid, n=1, cutoff=0.6)
    hint = f"; did you mean {near[0]}?" if near else "; see deepshard --help"
    return f"unknown flag {flag}{hint}"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="deepshard", description="Start a training script on every worker of one or more nodes, "
                "with DeepSpeed's launcher flags, over torch's elastic agent.")
    p.add_argument("-H", "--hostfile", default=None,
                   help=f"'HOST slots=N' lines (default: {DEFAULT_HOSTFILE} if it exists, else this host alone)")
    p.add_argument("-i", "--include", default="", help="host[:slot,...][@host...]: only these hosts/slots")
    p.add_argument("-e", "--exclude", default="", help="host[:slot,...][@host...]: all but these")
    p.add_argument("--num_nodes", type=int, default=-1, help="use the first N hosts (default: all)")
    p.add_argument("--num_gpus", "--num_accelerators", dest="num_gpus", type=int, default=-1,
                   help="workers per node: at most the visible GPUs (default: all of them); a CPU-only host "
                   f"takes any positive number of worker processes (default {CPU_WORKERS})")
    p.add_argument("--accelerate_config", default=None, help="an accelerate config yaml (distributed_type: "
                   "DEEPSPEED): its num_processes workers, its deepspeed_config given to them as accelerate launch "
                   "gives it (read by deepshard-compat)")
    p.add_argument("--master_addr", default="", help="rendezvous host (default: the first host; one node: 127.0.0.1)")
    p.add_argument("--master_port", type=int, default=None,
                   help=f"rendezvous port (default {DEFAULT_PORT}; one node: a free port)")
    p.add_argument("--node_rank", type=int, default=-1, help="this node's index, with --no_ssh (0 hosts the rendezvous)")
    p.add_argument("--no_ssh", action="store_true", help="run only this node's workers (start each node yourself)")
    p.add_argument("--no_ssh_check", action="store_true", help="do not check that each host answers ssh first")
    p.add_argument("--ssh_port", type=int, default=None)
    p.add_argument("--force_multi", action="store_true", help="start even a single host over ssh")
    p.add_argument("--launcher", default="pdsh", help=f"how nodes start: {', '.join(remote.SUPPORTED)} "
                   "(pdsh and ssh: one ssh per host)")
    p.add_argument("--launcher_args", default="", help="extra arguments of srun")
    p.add_argument("--comment", default="", help="srun --comment")
    p.add_argument("--account", default="", help="srun --account")
    p.add_argument("--venv_script", default=None, help="a script each remote node sources first")
    p.add_argument("--module", action="store_true", help="the script is a module: python -m")
    p.add_argument("--no_python", action="store_true", help="the script is an executable, run without python")
    p.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank=N to the script")
    p.add_argument("--max_restarts", type=int, default=0, help="restart the workers this often after a failure")
    p.add_argument("--elastic_training", action="store_true", help="nodes may join and leave between restarts")
    p.add_argument("--min_elastic_nodes", type=int, default=-1, help="with --elastic_training (default: all)")
    p.add_argument("--max_elastic_nodes", type=int, default=-1, help="with --elastic_training (default: all)")
    p.add_argument("--hang_s", type=float, default=300.0, help="end a job whose rank made no progress this long")
    p.add_argument("--world_info", default=None, help=argparse.SUPPRESS)  # a node's view of the job (ssh, srun)
    p.add_argument("--run_id", default=None, help=argparse.SUPPRESS)
    p.add_argument("--end_with_stdin", action="store_true", help=argparse.SUPPRESS)  # a node started over ssh
    for dest, (flag, takes_value) in NOT_OFFERED.items():
        p.add_argument(flag, dest=dest, default=None, help=argparse.SUPPRESS,
                       **({} if takes_value else {"action": "store_const", "const": True}))
    p.add_argument("user_script", help="the training script (or module, or executable)")
    p.add_argument("user_args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = build_parser()
    args, unknown = parser.parse_known_args(list(argv))
    flags = [a for a in unknown if a.startswith("-")]
    if unknown:
        raise UsageError(unknown_flag_line(parser, flags or unknown))
    for dest, (flag, _) in NOT_OFFERED.items():
        if getattr(args, dest) is not None:
            raise UsageError(f"{flag} is a DeepSpeed flag deepshard does not offer")
    return args


def _check_script(args: argparse.Namespace) -> None:
    script = args.user_script
    if args.module:
        top = script.split(".")[0]  # python -m searches the current directory first; the top package only:
        if importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path]) is None and \
                top not in sys.builtin_module_names:  # finding pkg.mod would import pkg here
            raise UsageError(f"--module {script}: no module {top!r} in the current directory or python's path")
    elif args.no_python:
        if shutil.which(script) is None:
            raise UsageError(f"--no_python {script}: no such executable")
    elif not os.path.isfile(script):
        raise UsageError(f"{script}: no such file (the training script; --module runs a module, "
                         "--no_python an executable)")


def local_workers(num_gpus: int, gpus: int) -> int:
    """This host's worker count: ``--num_gpus``, at most the ``gpus`` it has; default all (CPU-only: 2)."""
    if num_gpus <= 0:
        return gpus or CPU_WORKERS
    if gpus and num_gpus > gpus:
        raise UsageError(f"--num_gpus={num_gpus}: this host has {gpus} visible GPU(s); use at most {gpus} "
                         "(only a CPU-only host runs any number of worker processes)")
    return num_gpus  # a CPU-only host: any positive number of worker processes


def resources(args: argparse.Namespace) -> tuple[Resources, bool]:
    """The slots of every node of the job, and whether they come from a hostfile."""
    if args.world_info:
        return remote.decode_world(args.world_info), True
    path = args.hostfile if args.hostfile is not None else (DEFAULT_HOSTFILE if os.path.isfile(DEFAULT_HOSTFILE)
                                                            else None)
    if path is None:
        if args.num_gpus == 0 or args.num_gpus < -1:
            raise UsageError(f"--num_gpus={args.num_gpus}: must be a positive number of workers")
        import torch

        pool = {"localhost": local_workers(args.num_gpus, torch.cuda.device_count())}
        return select(pool, args.include, args.exclude), False
    if not os.path.isfile(path):
        raise UsageError(f"--hostfile={path}: no such file")
    pool = read_hostfile(path)
    if args.num_gpus > 0:
        over = [h for h, n in pool.items() if args.num_gpus > n]
        if over:
            raise UsageError(f"--num_gpus={args.num_gpus}: {over[0]} has slots={pool[over[0]]} in {path}")
    return limit(select(pool, args.include, args.exclude), num_nodes=args.num_nodes, num_gpus=args.num_gpus), True


def _node_counts(args: argparse.Namespace, num_nodes: int) -> tuple[int, int]:
    """The agent's (min_nodes, max_nodes): every node, or DeepSpeed's elastic range."""
    if not args.elastic_training:
        return num_nodes, num_nodes
    lo = args.min_elastic_nodes if args.min_elastic_nodes > 0 else num_nodes
    hi = args.max_elastic_nodes if args.max_elastic_nodes > 0 else num_nodes
    if lo > hi:
        raise UsageError(f"--min_elastic_nodes={lo} > --max_elastic_nodes={hi}")
    return lo, hi


def _validate(args: argparse.Namespace) -> None:
    if args.max_restarts < 0:
        raise UsageError(f"--max_restarts={args.max_restarts}: must be 0 or more")
    if not (math.isfinite(args.hang_s) and args.hang_s >= 0):  # nan compares false: it turned the watchdog off
        raise UsageError(f"--hang_s={args.hang_s}: must be 0 (off) or a finite number of seconds")
    if args.num_gpus > MAX_SLOTS:  # checked before a list of that many slots is built
        raise UsageError(f"--num_gpus={args.num_gpus}: at most {MAX_SLOTS} workers per node")
    for flag in ("master_port", "ssh_port"):
        port = getattr(args, flag)
        if port is not None and not 1 <= port <= 65535:
            raise UsageError(f"--{flag}={port}: must be a port number from 1 to 65535")
    if args.module and args.no_python:
        raise UsageError("--module and --no_python: use one of them")
    if args.launcher in remote.REFUSED:
        raise UsageError(f"--launcher={args.launcher}: MPI launchers start ranks, not torch's elastic agent; "
                         f"use one of {', '.join(remote.SUPPORTED)}")
    if args.launcher not in remote.SUPPORTED:
        raise UsageError(f"--launcher={args.launcher}: valid values are {', '.join(remote.SUPPORTED)}")
    if args.no_ssh and args.node_rank < 0 and "SLURM_NODEID" not in os.environ:
        raise UsageError("--no_ssh needs --node_rank=N: this node's index among the job's nodes")


def accelerate_settings(args: argparse.Namespace) -> None:
    """``--accelerate_config``: the worker count and the workers' ``ACCELERATE_*`` variables from accelerate's
    yaml, read by deepshard-compat (found through its ``deepshard.launch`` entry point: launch imports no
    compat); a key nothing would honour is refused there, one line naming the file and the key."""
    from importlib.metadata import entry_points

    path = args.accelerate_config
    if args.hostfile is not None or args.no_ssh or args.world_info:
        raise UsageError(f"--accelerate_config={path}: starts one node (no --hostfile or --no_ssh with it)")
    found = list(entry_points(group="deepshard.launch", name="accelerate_config"))
    if not found:
        raise UsageError(f"--accelerate_config={path}: reading accelerate's config needs deepshard-compat installed")
    num, env = found[0].load()(path)
    if args.num_gpus > 0 and args.num_gpus != num:
        raise UsageError(f"--num_gpus={args.num_gpus} and {path}'s num_processes={num} differ: give one of them")
    args.num_gpus, args.accelerate_env = num, env


def _forwarded_flags(args: argparse.Namespace) -> list[str]:
    """The flags every node's own ``deepshard`` needs from the launcher's command line."""
    flags = [f"--max_restarts={args.max_restarts}", f"--hang_s={args.hang_s}"]
    flags += [f"--{name}" for name in ("module", "no_python", "no_local_rank", "elastic_training") if getattr(args, name)]
    flags += [f"--{n}={getattr(args, n)}" for n in ("min_elastic_nodes", "max_elastic_nodes") if getattr(args, n) > 0]
    return flags


def _this_node(args: argparse.Namespace, world: Resources, from_hostfile: bool) -> tuple[NodeConfig, str]:
    """This process runs one node's agent: the only node, or node ``--node_rank`` with --no_ssh."""
    env = job_env()
    # the workers' transformers/accelerate find deepshard's engine as `deepspeed` (deepshard.compat's
    # opt-in provider, issue 41); DEEPSHARD_DEEPSPEED=0 before deepshard leaves the name alone
    env.setdefault(PROVIDE_DEEPSPEED, os.environ.get(PROVIDE_DEEPSPEED, "1"))
    env.update(getattr(args, "accelerate_env", {}))  # --accelerate_config's ACCELERATE_* variables
    if not args.no_ssh:  # one node, here
        host, slots = next(iter(world.items()))
        port = args.master_port or _free_port()
        run_id = args.run_id or uuid.uuid4().hex[:8]
        name = socket.gethostname() if host == "localhost" else host
        return NodeConfig(nproc=len(slots), master_addr="127.0.0.1", master_port=port, run_id=run_id,
                          max_restarts=args.max_restarts, host=name, devices=tuple(slots), env=env,
                          hang_s=args.hang_s), name
    node_rank = args.node_rank if args.node_rank >= 0 else int(os.environ["SLURM_NODEID"])
    if from_hostfile:
        hosts = list(world)
        if node_rank >= len(hosts):
            raise UsageError(f"--node_rank={node_rank}: the job has {len(hosts)} node(s) ({', '.join(hosts)})")
        host, slots = hosts[node_rank], world[hosts[node_rank]]
        num_nodes, master = len(hosts), args.master_addr or hosts[0]
    else:  # no hostfile: --num_nodes nodes of --num_gpus workers each
        host, slots = socket.gethostname(), next(iter(world.values()))
        num_nodes = max(1, args.num_nodes)
        if node_rank >= num_nodes:
            raise UsageError(f"--node_rank={node_rank}: must be below --num_nodes={num_nodes}")
        if num_nodes > 1 and not args.master_addr:
            raise UsageError("--no_ssh with --num_nodes>1 and no hostfile needs --master_addr (node 0's address)")
        master = args.master_addr or "127.0.0.1"
    port = args.master_port or DEFAULT_PORT
    lo, hi = _node_counts(args, num_nodes)
    return NodeConfig(nproc=len(slots), master_addr=master, master_port=port,
                      run_id=args.run_id or f"deepshard-{port}", min_nodes=lo, max_nodes=hi,
                      max_restarts=args.max_restarts, host=f"{host} (node {node_rank})", is_host=node_rank == 0,
                      devices=tuple(slots) if from_hostfile else None, env=env, hang_s=args.hang_s), host


def _free_port() -> int:
    from deepshard.core.mesh import free_port

    return free_port()


def _check_remote(args: argparse.Namespace) -> None:
    """What a job of several nodes reads besides its flags, checked before any node starts: the
    options split for srun or ssh (a ValueError names the flag or variable)."""
    if args.launcher == "slurm":
        remote.split_options("--launcher_args", args.launcher_args)
    else:
        remote.ssh_options()


def _warn_unforwarded() -> None:
    """One line naming the variables with a forwarded prefix that cannot cross a node's shell."""
    skipped = unforwardable()
    if skipped:
        print(f"warning: not forwarded to the nodes (not shell variable names, [A-Za-z_][A-Za-z0-9_]*): "
              f"{', '.join(map(repr, skipped))}", file=sys.stderr, flush=True)


def _run_nodes(args: argparse.Namespace, world: Resources) -> Failure | None:
    """The launcher of a job of several nodes: one ssh per host (or srun), each running its node's agent."""
    hosts = list(world)
    master = args.master_addr or hosts[0]
    port = args.master_port or DEFAULT_PORT
    _node_counts(args, len(hosts))
    common = dict(world=remote.encode_world(world), master_addr=master, master_port=port,
                  run_id=uuid.uuid4().hex[:8], launch_flags=_forwarded_flags(args), script=args.user_script,
                  script_args=args.user_args)
    if args.launcher == "slurm":  # Slurm's node names resolve inside the allocation, not necessarily here
        cmd = remote.srun_command(world, remote.node_command("-1", **common), launcher_args=args.launcher_args,
                                  comment=args.comment, account=args.account)
        os.environ.update(job_env())
        os.execvp(cmd[0], cmd)  # srun runs the nodes and reports their end
    remote.check_resolvable(hosts)
    if not args.no_ssh_check:
        remote.check_reachable(hosts, port=args.ssh_port)
    _warn_unforwarded()
    env, cwd = job_env(), os.getcwd()
    lines = {h: remote.remote_shell_line(remote.node_command(i, over_ssh=True, **common), env=env, cwd=cwd,
                                         venv_script=args.venv_script) for i, h in enumerate(hosts)}
    code, line = remote.run_over_ssh(lines, port=args.ssh_port, max_restarts=args.max_restarts)
    return None if code == 0 else Failure(line or f"exit {code}", code)


def run(argv: Sequence[str]) -> int:
    """The command's work; returns its exit code, having printed the ``error:`` line of a failure."""
    try:
        args = parse(argv)
        _validate(args)
        _check_script(args)
        if args.accelerate_config is not None:
            accelerate_settings(args)
        world, from_hostfile = resources(args)
        multi = (len(world) > 1 or args.force_multi) and not args.no_ssh
        if multi:
            _check_remote(args)
        else:
            node, _ = _this_node(args, world, from_hostfile)
            entry, cmd_args = worker_command(args.user_script, args.user_args, module=args.module,
                                             no_python=args.no_python, no_local_rank=args.no_local_rank)
    except ValueError as err:  # UsageError and the hostfile's, env file's ValueErrors: nothing started
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.end_with_stdin:  # this node's ssh session closing stops its workers (SIGTERM to the agent)
        end_with_stdin()
    try:
        failure = _run_nodes(args, world) if multi else run_node(node, entry, cmd_args)
    except ValueError as err:  # a host that cannot be reached, before any node started
        print(f"error: {err}", file=sys.stderr)
        return 2
    if failure is None:
        return 0
    sys.stdout.flush()
    print(f"error: {failure.line}", file=sys.stderr)
    return failure.code


def main(argv: Sequence[str] | None = None) -> None:
    sys.exit(run(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
