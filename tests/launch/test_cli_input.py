"""The deepshard command's input, in-process: DeepSpeed's flags, hostfile and include/exclude meanings,
the worker command lines, the srun and ssh command lines, and each bad input as one ``error:`` line
with exit 2 before anything starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from deepshard.launch import cli, remote
from deepshard.launch.agent import describe, visible_devices, worker_command
from deepshard.launch.env_file import job_env
from deepshard.launch.hostfile import limit, read_hostfile, select


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    return "train.py"


def refused(capsys, argv) -> str:
    assert cli.run(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err.strip()


@pytest.mark.parametrize(("flag", "near"), [("--num-gpus", "--num_gpus"), ("--num_gpu_s", "--num_gpus"),
                                            ("--master-port", "--master_port"), ("--no_local_ranks", "--no_local_rank"),
                                            ("--hostfiles", "--hostfile")])
def test_unknown_flag_names_the_nearest(capsys, script, flag, near):
    line = refused(capsys, [flag, "2", script])
    assert line == f"error: unknown flag {flag}; did you mean {near}?"


def test_script_that_does_not_exist(capsys, script):
    assert "missing.py: no such file" in refused(capsys, ["missing.py"])
    assert "--module nosuchpkg.train: no module 'nosuchpkg'" in refused(capsys, ["--module", "nosuchpkg.train"])
    assert "--no_python ./nope: no such executable" in refused(capsys, ["--no_python", "./nope"])


def test_script_args_are_the_scripts(capsys, script):
    args = cli.parse([script, "--num_gpus", "7", "--bogus"])  # after the script: its own arguments
    assert args.user_args == ["--num_gpus", "7", "--bogus"] and args.num_gpus == -1


def test_deepspeed_defaults_and_synonyms():
    args = cli.parse(["--num_accelerators=3", "t.py"])
    assert args.num_gpus == 3 and args.num_nodes == -1 and args.launcher == "pdsh" and args.max_restarts == 0
    assert args.master_port is None and args.include == args.exclude == "" and not args.no_local_rank


def test_num_gpus_on_cpu_is_any_positive_count_and_capped_on_gpu():
    assert cli.local_workers(-1, 0) == 2 and cli.local_workers(-1, 8) == 8
    assert cli.local_workers(16, 0) == 16  # CPU-only: worker processes
    with pytest.raises(cli.UsageError, match=r"--num_gpus=4: this host has 2 visible GPU\(s\); use at most 2"):
        cli.local_workers(4, 2)


def test_hostfile_lines(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# the cluster\n\nworker-0 slots=4\n  worker-1 slots=2  # half\n")
    assert read_hostfile(path) == {"worker-0": 4, "worker-1": 2}
    path.write_text("worker-0 slots=4\nworker-1 slot=2\n")
    with pytest.raises(ValueError, match=rf"^{path}:2: 'worker-1 slot=2' is not a hostfile line"):
        read_hostfile(path)
    path.write_text("a slots=1\na slots=2\n")
    with pytest.raises(ValueError, match=rf"{path}:2: host a is listed twice"):
        read_hostfile(path)


def test_malformed_hostfile_is_one_line(capsys, script, tmp_path):
    (tmp_path / "hosts").write_text("worker-0 slots=4\nworker-1 slots=two\n")
    assert refused(capsys, ["--hostfile=hosts", script]).startswith("error: hosts:2: 'worker-1 slots=two'")
    assert "--hostfile=nope: no such file" in refused(capsys, ["--hostfile=nope", script])


@pytest.mark.parametrize("slots", ["99999999999999999999", "300000000", "4097", "0", "9" * 5000])
def test_slots_out_of_bounds_are_one_line_naming_file_and_line(capsys, script, tmp_path, monkeypatch, slots):
    """Issue 45 item 8: ``slots=99999999999999999999`` was an OverflowError traceback and
    ``slots=300000000`` a list of gigabytes; a node has at most MAX_SLOTS (4096) slots, checked first."""
    monkeypatch.setattr(remote, "check_resolvable", lambda hosts: pytest.fail("the hostfile was taken"))
    (tmp_path / "hosts").write_text(f"# the cluster\nworker-0 slots=2\nworker-1 slots={slots}\n")
    shown = slots if len(slots) <= 24 else f"{slots[:20]}... ({len(slots)} digits)"
    assert refused(capsys, ["--hostfile=hosts", script]) == (
        f"error: hosts:3: worker-1 slots={shown}: slots must be an integer from 1 to 4096 (the workers of one node)")


@pytest.mark.parametrize(("argv", "says"), [
    (["--num_gpus=99999999999999999999"], "--num_gpus=99999999999999999999: at most 4096 workers per node"),
    (["--num_gpus=4097"], "--num_gpus=4097: at most 4096 workers per node"),
    (["--master_port=70000"], "--master_port=70000: must be a port number from 1 to 65535"),
    (["-H", "hosts", "--ssh_port=-22"], "--ssh_port=-22: must be a port number from 1 to 65535"),
])
def test_numbers_from_the_command_line_are_bounded_before_use(capsys, script, tmp_path, monkeypatch, argv, says):
    """Issue 45 item 8: a worker count is bounded before a list (or processes) of that many is made,
    a port before a socket is opened on it."""
    monkeypatch.setattr(cli, "run_node", lambda *a: pytest.fail("workers started"))
    monkeypatch.setattr(remote, "check_resolvable", lambda hosts: pytest.fail("nodes started"))
    (tmp_path / "hosts").write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    assert refused(capsys, [*argv, script]) == f"error: {says}"


def test_include_exclude_as_deepspeed():
    pool = {"w0": 4, "w1": 4, "w2": 2}
    assert select(pool, include="w0@w1:0,2") == {"w0": [0, 1, 2, 3], "w1": [0, 2]}
    assert select(pool, include="w2:1@w0:3") == {"w0": [3], "w2": [1]}  # the hostfile's order
    assert select(pool, exclude="w1:0@w2") == {"w0": [0, 1, 2, 3], "w1": [1, 2, 3]}
    assert limit(select(pool), num_nodes=2, num_gpus=1) == {"w0": [0], "w1": [0]}
    with pytest.raises(ValueError, match="host 'w9' is not in the hostfile"):
        select(pool, include="w9")
    with pytest.raises(ValueError, match="host w2 has no slot 2"):
        select(pool, include="w0@w2:2")
    with pytest.raises(ValueError, match="use one of them"):
        select(pool, include="w0", exclude="w1")


def test_include_naming_a_missing_host_or_slot(capsys, script, tmp_path):
    (tmp_path / "hosts").write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    assert "host '127.0.0.3' is not in the hostfile" in refused(capsys, ["-H", "hosts", "-i", "127.0.0.3", script])
    assert "host 127.0.0.2 has no slot 1 (its slots: 0)" in refused(
        capsys, ["-H", "hosts", "--include=127.0.0.1:0@127.0.0.2:1", script])
    assert "--num_nodes=3: only 2 host(s)" in refused(capsys, ["-H", "hosts", "--num_nodes=3", script])


@pytest.mark.parametrize(("argv", "says"), [
    (["--launcher=openmpi"], "MPI launchers start ranks"),
    (["--launcher=pbs"], "valid values are pdsh, ssh, slurm"),
    (["--no_ssh"], "--no_ssh needs --node_rank"),
    (["--max_restarts=-1"], "must be 0 or more"),
    (["--save_pid"], "--save_pid is a DeepSpeed flag deepshard does not offer"),
    (["--elastic_training", "--min_elastic_nodes=3", "--max_elastic_nodes=2", "--no_ssh", "--node_rank=0"],
     "--min_elastic_nodes=3 > --max_elastic_nodes=2"),
])
def test_other_refusals(capsys, script, monkeypatch, argv, says):
    monkeypatch.delenv("SLURM_NODEID", raising=False)
    assert says in refused(capsys, [*argv, script])


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_hang_limit_must_be_a_finite_number(capsys, script, monkeypatch, value):
    """Issue 45 item 10: ``--hang_s=nan`` passed the ``< 0`` check and silently turned the watchdog off."""
    monkeypatch.setattr(cli, "run_node", lambda *a: pytest.fail("workers started"))
    assert refused(capsys, [f"--hang_s={value}", script]) == (
        f"error: --hang_s={float(value)}: must be 0 (off) or a finite number of seconds")


def test_worker_commands():
    py = sys.executable
    assert worker_command("t.py", ["a"], module=False, no_python=False, no_local_rank=False) == (
        py, ["-u", "t.py", "--local_rank=${local_rank}", "a"])  # torch's agent substitutes the macro
    assert worker_command("p.m", ["a"], module=True, no_python=False, no_local_rank=True) == (py, ["-u", "-m", "p.m", "a"])
    assert worker_command("./x.sh", [], module=False, no_python=True, no_local_rank=False) == (
        "./x.sh", ["--local_rank=${local_rank}"])


def test_env_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / ".deepspeed_env").write_text("# comment\nFOO=a=b c\nexport BAR=1\n")
    env = job_env({"NCCL_DEBUG": "INFO", "HOME": str(tmp_path / "home"), "SECRET": "x"})
    assert env == {"NCCL_DEBUG": "INFO", "FOO": "a=b c", "BAR": "1"}
    (tmp_path / "other").write_text("OK=1\nnot a line\n")
    with pytest.raises(ValueError, match=r"other:2: 'not a line' is not a NAME=VALUE line"):
        job_env({"DS_ENV_FILE": str(tmp_path / "other")})
    with pytest.raises(ValueError, match="DS_ENV_FILE=missing: no such file"):
        job_env({"DS_ENV_FILE": "missing"})


def test_srun_and_node_commands():
    world = {"n1": [0, 1], "n2": [0, 1]}
    node = remote.node_command("-1", world=remote.encode_world(world), master_addr="n1", master_port=29500,
                               run_id="r1", launch_flags=["--max_restarts=1"], script="t.py", script_args=["x"])
    cmd = remote.srun_command(world, node, launcher_args="--exclusive --mem=0", comment="c", account="acct")
    assert cmd[:cmd.index(sys.executable)] == [
        "srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--nodelist=n1,n2", "--export=ALL", "--comment=c",
        "--account=acct", "--exclusive", "--mem=0"]
    args = cli.parse(node[node.index("-m") + 2:])
    assert args.no_ssh and args.node_rank == -1 and remote.decode_world(args.world_info) == world
    assert (args.master_addr, args.master_port, args.run_id, args.max_restarts) == ("n1", 29500, "r1", 1)
    assert args.user_script == "t.py" and args.user_args == ["x"]


def test_remote_shell_line_keeps_values_quoted():
    line = remote.remote_shell_line(["python", "t.py", "a b"], env={"FOO": "x y; rm -rf /"}, cwd="/w d",
                                    venv_script=None)
    assert line == "cd '/w d' && export FOO='x y; rm -rf /' && exec python t.py 'a b'"


def test_forwarded_names_cannot_run_commands_in_a_nodes_shell(capsys, script, tmp_path, monkeypatch):
    """Issue 45 item 4: a forwarded variable's name went into ``export NAME=...`` unquoted, so
    ``PYTHON_X$(touch pwn)`` ran on every node and ``PYTHON.CACHE`` failed every node's shell.  The
    lines the launcher builds for two hosts, run by a real ``sh -c``: no substitution happens, the
    skipped names are named once, and a valid name arrives with its value as it was."""
    pwn = tmp_path / "pwn"
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(f"PYTHON_X$(touch {pwn})", "1")
    monkeypatch.setenv("PYTHON.CACHE", "1")
    monkeypatch.setenv("PYTHON_OK", "it's $(a) `b` $HOME")
    (tmp_path / "hosts").write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    lines: dict[str, str] = {}
    monkeypatch.setattr(remote, "node_command", lambda *a, **k: ["printenv", "PYTHON_OK"])
    monkeypatch.setattr(remote, "run_over_ssh", lambda got, port, **_: (lines.update(got), (0, None))[1])
    assert cli.run(["-H", "hosts", "--no_ssh_check", script]) == 0
    assert list(lines) == ["127.0.0.1", "127.0.0.2"]
    for line in lines.values():
        proc = subprocess.run(["sh", "-c", line], capture_output=True, text=True, timeout=30)
        assert not pwn.exists(), f"the name ran a command: {line}"
        assert (proc.returncode, proc.stdout, proc.stderr) == (0, "it's $(a) `b` $HOME\n", ""), line
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 1 and warnings[0].startswith("warning: not forwarded to the nodes"), warnings
    assert "'PYTHON.CACHE'" in warnings[0] and f"'PYTHON_X$(touch {pwn})'" in warnings[0]
    with pytest.raises(ValueError, match=r"^'A\$\(x\)': not a shell variable name"):
        remote.remote_shell_line(["true"], env={"A$(x)": "1"}, cwd="/", venv_script=None)


@pytest.mark.parametrize(("launcher", "name", "setting"), [
    ("pdsh", "PDSH_SSH_ARGS_APPEND", {"env": "-F '/x"}), ("slurm", "--launcher_args", {"flag": "--mem='1"})])
def test_unsplittable_ssh_or_srun_options_name_their_source(capsys, script, tmp_path, monkeypatch, launcher, name,
                                                           setting):
    """Issue 45 item 10: ``PDSH_SSH_ARGS_APPEND="-F '/x"`` ended in ``error: No closing quotation``,
    naming nothing; now the variable (or srun's flag) is named, before any ssh or srun starts."""
    (tmp_path / "hosts").write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    monkeypatch.setenv("PDSH_SSH_ARGS_APPEND", setting.get("env", ""))
    monkeypatch.setattr(remote, "run_over_ssh", lambda *a, **k: pytest.fail("ssh started"))
    monkeypatch.setattr(cli.os, "execvp", lambda *a: pytest.fail("srun started"))
    flags = [f"--launcher_args={setting['flag']}"] if "flag" in setting else []
    line = refused(capsys, ["-H", "hosts", "--no_ssh_check", f"--launcher={launcher}", *flags, script])
    given = setting.get("env") or setting["flag"]
    assert line.startswith(f"error: {name}={given!r}: cannot be split into arguments as a shell would "
                           "(No closing quotation)"), line


def test_a_host_is_never_an_ssh_option(tmp_path):
    """A hostfile host ``-oProxyCommand=...`` would be an ssh option that runs a command on the launcher's
    host: refused in the hostfile, and ``--`` ends ssh's options anyway."""
    path = tmp_path / "hosts"
    path.write_text("a slots=1\n-oProxyCommand=touch${IFS}pwn slots=1\n")
    with pytest.raises(ValueError, match=rf"^{path}:2: host '-oProxyCommand=touch\${{IFS}}pwn': a host name cannot "):
        read_hostfile(path)
    cmd = remote.ssh_command("-oX=y", "true", port=22)
    assert cmd[-3:] == ["--", "-oX=y", "true"]


def test_describe_names_host_rank_and_signal():
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    killed = ProcessFailure(local_rank=0, pid=1, exitcode=-9, error_file="/nonexistent")
    stopped = ProcessFailure(local_rank=1, pid=2, exitcode=-15, error_file="/nonexistent")
    failed = describe({3: killed, 2: stopped}, "worker-1")
    assert (failed.line, failed.code) == ("rank 3 on worker-1 died with SIGKILL", 137)
    exited = describe({1: ProcessFailure(local_rank=1, pid=2, exitcode=3, error_file="/nonexistent")}, "h")
    assert (exited.line, exited.code) == ("rank 1 on h exited with code 3", 3)


def test_unresolvable_host_is_named(capsys, script, tmp_path):
    (tmp_path / "hosts").write_text("127.0.0.1 slots=1\nno-such-host.invalid slots=1\n")
    assert "hostfile host no-such-host.invalid cannot be resolved" in refused(capsys, ["-H", "hosts", script])


def test_elastic_flags_map_to_the_agents_node_range():
    plain = cli.parse(["--min_elastic_nodes=1", "t.py"])
    assert cli._node_counts(plain, 4) == (4, 4)  # without --elastic_training: every node, always
    elastic = cli.parse(["--elastic_training", "--min_elastic_nodes=2", "--max_elastic_nodes=6", "t.py"])
    assert cli._node_counts(elastic, 4) == (2, 6)
    assert cli._node_counts(cli.parse(["--elastic_training", "t.py"]), 3) == (3, 3)
    flags = cli._forwarded_flags(elastic)
    assert "--elastic_training" in flags and "--min_elastic_nodes=2" in flags and "--max_elastic_nodes=6" in flags


def test_slots_are_the_gpus_this_process_sees():
    assert visible_devices([0, 2], None) == "0,2"
    assert visible_devices([0, 1], "4,5,6") == "4,5"  # the user's CUDA_VISIBLE_DEVICES narrows first


def test_the_command_does_not_import_the_engine_or_dtensor():
    """Every launcher process (and every node's agent) pays its imports: torch's elastic agent is needed,
    the engine and DTensor (~1 s of CPU, with all of core's package) are not."""
    code = ("import sys, deepshard.launch.cli; heavy = [m for m in ('deepshard.core.engine', 'torch.distributed.tensor',"
            " 'deepshard.core.memory', 'transformers') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_launcher_of_several_nodes_does_not_import_torch(tmp_path):
    """The ``deepshard`` process that starts the nodes over ssh (or srun) runs no worker and no agent: torch
    (~1.5 s of CPU before the first ssh, and in each refusal) is imported by each node's agent only."""
    (tmp_path / "hosts").write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    (tmp_path / "train.py").write_text("")
    code = ("import sys; from deepshard.launch import cli, remote\n"
            "remote.run_over_ssh = lambda lines, **_: (print(sorted(lines)), (0, None))[1]  # ssh itself: not here\n"
            "print(cli.run(['-H', 'hosts', '--no_ssh_check', 'train.py']), cli.run(['-H', 'hosts', 'nothing.py']))\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.stdout.splitlines() == ["['127.0.0.1', '127.0.0.2']", "0 2", "False"], out.stdout + out.stderr
