"""A real OpenSSH ``sshd`` on the loopback, for the launcher's ssh tests: its own host key, one
authorized key and its config in a temporary directory, listening on 127.0.0.1 and 127.0.0.2 at a
free port.  The launcher reaches it through DeepSpeed's ``PDSH_SSH_ARGS_APPEND`` (``-F`` a generated
ssh config naming the port, the key and a known-hosts file of its own), so nothing of the machine's
ssh setup is read or changed; the only thing it may create is ``/run/sshd``, sshd's compiled-in
privilege-separation directory, which Debian's init script would create (removed again if it made it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deepshard.core.mesh import free_port

HOSTS = ("127.0.0.1", "127.0.0.2")
PRIVSEP_DIR = Path("/run/sshd")
INSTALL = "apt-get install openssh-server (the README's setup command does it as root on Debian/Ubuntu)"


def _sshd_binary() -> str | None:
    return shutil.which("sshd") or next((p for p in ("/usr/sbin/sshd", "/usr/local/sbin/sshd")
                                         if os.access(p, os.X_OK)), None)


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "deepshard-test", "-f", str(path)],
                   check=True, stdin=subprocess.DEVNULL)


def _listening(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


@contextlib.contextmanager
def loopback_sshd(work: Path) -> Iterator[dict[str, str]]:
    """Start sshd; yield the launcher's environment that reaches it (``PDSH_SSH_ARGS_APPEND``).
    Skips, naming the reason, when sshd or the ssh client is not installed."""
    sshd = _sshd_binary()
    if sshd is None:
        pytest.skip(f"sshd is not installed: {INSTALL}")
    if shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        pytest.skip(f"the ssh client is not installed: {INSTALL}")
    work.mkdir(parents=True, exist_ok=True)
    _keygen(work / "host_key")
    _keygen(work / "user_key")
    shutil.copy(work / "user_key.pub", work / "authorized_keys")
    port = free_port()
    (work / "sshd_config").write_text("\n".join([
        f"Port {port}", *(f"ListenAddress {h}" for h in HOSTS), f"HostKey {work / 'host_key'}",
        f"AuthorizedKeysFile {work / 'authorized_keys'}", f"PidFile {work / 'sshd.pid'}",
        "StrictModes no", "UsePAM no", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
        "PermitRootLogin prohibit-password", "PrintMotd no", "LogLevel ERROR", ""]))
    (work / "ssh_config").write_text("\n".join([
        f"Host {' '.join(HOSTS)}", f"  Port {port}", f"  IdentityFile {work / 'user_key'}", "  IdentitiesOnly yes",
        "  StrictHostKeyChecking accept-new", f"  UserKnownHostsFile {work / 'known_hosts'}",
        "  LogLevel ERROR", ""]))
    made_privsep = False
    if os.geteuid() == 0 and not PRIVSEP_DIR.exists():
        PRIVSEP_DIR.mkdir(mode=0o755)
        made_privsep = True
    log = open(work / "sshd.log", "w")
    proc = subprocess.Popen([sshd, "-D", "-e", "-f", str(work / "sshd_config")], stdin=subprocess.DEVNULL,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not all(_listening(h, port) for h in HOSTS):
            assert proc.poll() is None and time.monotonic() < deadline, \
                f"sshd did not start: {(work / 'sshd.log').read_text()}"
            time.sleep(0.05)
        yield {"PDSH_SSH_ARGS_APPEND": f"-F {work / 'ssh_config'}"}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # the daemon and the sessions it forked
        proc.wait(timeout=10)
        log.close()
        if made_privsep:
            with contextlib.suppress(OSError):
                PRIVSEP_DIR.rmdir()
