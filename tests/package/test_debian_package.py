"""The Debian package, end to end, as an operator meets it: ``make deb`` builds it from this
tree, apt installs it, the unit's command runs the broker as the ``logbroker`` user with the
shipped settings file, the installed ``logbroker`` command produces and consumes over TLS, and
``apt-get purge`` leaves nothing behind.

It changes the machine (a package, a system user), so it needs root on Debian 12; it fails,
never skips, when something it needs is missing. Select it with ``-m package``.
"""

from __future__ import annotations

import grp
import os
import pwd
import shlex
import signal
import socket
import ssl
import stat
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.certificates import issue, write

pytestmark = pytest.mark.package

ROOT = Path(__file__).resolve().parents[2]
VENV = Path("/opt/venvs/logbroker")
ENV_FILE = Path("/etc/logbroker/logbroker.env")
TLS_DIR = Path("/etc/logbroker/tls")
DATA_DIR = Path("/var/lib/logbroker")
UNIT = Path("/lib/systemd/system/logbroker.service")
CLI = Path("/usr/bin/logbroker")
WANTS = Path("/etc/systemd/system/multi-user.target.wants/logbroker.service")
PASSWORD = "package-test-admin"
#: apt-get that waits for another apt's lock instead of failing, and never asks.
APT = ("apt-get", "-y", "-q", "-o", "DPkg::Lock::Timeout=300")
APT_ENV = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}


def sh(*command: str, timeout: float = 300, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Run ``command``; fail the test with its output unless it exits 0."""
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, check=False, **kwargs
    )
    assert result.returncode == 0, (
        f"{shlex.join(command)} exited {result.returncode}\n"
        f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"
    )
    return result


def purge() -> None:
    sh(*APT, "purge", "logbroker", env=APT_ENV)


def installed() -> bool:
    """Whether dpkg knows the package at all (installed, half-installed or its conffiles left)."""
    status = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", "logbroker"], capture_output=True, text=True
    ).stdout
    return bool(status) and not status.endswith("not-installed")


@pytest.fixture(scope="module")
def package() -> Iterator[Path]:
    """Build the package from this tree, install it; purge it afterwards whatever happened."""
    assert os.geteuid() == 0, "the package test installs a .deb: run it as root"
    assert Path("/etc/debian_version").exists(), "the package test needs Debian"
    if installed():
        purge()
    for old in ROOT.glob("dist/logbroker_*"):
        old.unlink()
    sh("make", "deb", cwd=ROOT, timeout=900)
    [deb] = ROOT.glob("dist/logbroker_*.deb")
    sh(
        *APT,
        "install",
        "--no-install-recommends",
        f"./{deb.relative_to(ROOT)}",
        cwd=ROOT,
        env=APT_ENV,
    )
    try:
        yield deb
    finally:
        if installed():
            purge()


def test_files_owners_and_modes(package: Path) -> None:
    user = pwd.getpwnam("logbroker")
    group = grp.getgrnam("logbroker")
    assert user.pw_gid == group.gr_gid
    assert user.pw_uid < 1000, "a system user"
    assert not Path(user.pw_dir).exists(), "the user has no home"

    data = DATA_DIR.stat()
    assert (stat.S_IMODE(data.st_mode), data.st_uid, data.st_gid) == (
        0o750,
        user.pw_uid,
        group.gr_gid,
    )
    env = ENV_FILE.stat()
    assert (stat.S_IMODE(env.st_mode), env.st_uid, env.st_gid) == (0o640, 0, group.gr_gid)
    assert ENV_FILE.read_bytes() == (ROOT / "etc/logbroker.env").read_bytes()
    uncommented = [line for line in ENV_FILE.read_text().splitlines() if not line.startswith("#")]
    assert not [line for line in uncommented if "_PASS" in line or "PASSWORD" in line]
    conffiles = sh("dpkg-query", "-W", "-f=${Conffiles}", "logbroker").stdout
    assert str(ENV_FILE) in conffiles
    assert TLS_DIR.is_dir()

    assert CLI.is_symlink()
    assert os.readlink(CLI) == str(VENV / "bin/logbroker")
    for shipped in ("prometheus/logbroker-alerts.yml", "grafana/logbroker-dashboard.json"):
        installed = Path("/usr/share/logbroker") / shipped
        assert installed.read_bytes() == (ROOT / "etc" / shipped).read_bytes()
    # The native parts were built into the package.
    for native in ("logbroker.storage._speedups", "logbroker.wire._speedups"):
        sh(str(VENV / "bin/python"), "-c", f"import {native}")
    # postinst wrote the plugin cache, so the service user never has to.
    assert list(VENV.glob("lib/python3*/site-packages/twisted/plugins/dropin.cache"))


def test_unit_file(package: Path) -> None:
    sh("systemd-analyze", "verify", str(UNIT))
    unit = UNIT.read_text()
    for line in [
        f"ExecStart={VENV}/bin/twistd --nodaemon --pidfile= --logfile=- logbroker",
        "User=logbroker",
        "Group=logbroker",
        f"EnvironmentFile={ENV_FILE}",
        # Restarted after any exit, a config that fails at boot included, and never given
        # up on (the certification's bad-config drill supervises its nodes the same way).
        "Restart=always",
        "RestartSec=5",
        "StartLimitIntervalSec=0",
        "RestartSteps=6",
        "RestartMaxDelaySec=60",
        "ProtectSystem=strict",
        f"ReadWritePaths={DATA_DIR}",
        "NoNewPrivileges=yes",
    ]:
        assert line in unit.splitlines()
    assert not [
        line for line in unit.splitlines() if line.startswith(("RestartPrevent", "StartLimitBurst"))
    ]
    assert WANTS.is_symlink(), "the unit is enabled"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def unit_command(**extra: str) -> list[str]:
    """The unit's ExecStart as the unit runs it: as logbroker, with only the settings file's
    variables (and ``extra``) in the environment."""
    settings = [
        line.strip()
        for line in ENV_FILE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    execstart = next(
        line.removeprefix("ExecStart=")
        for line in UNIT.read_text().splitlines()
        if line.startswith("ExecStart=")
    )
    return [
        "runuser",
        "-u",
        "logbroker",
        "--",
        "env",
        "-i",
        "PATH=/usr/bin:/bin",
        *settings,
        *(f"{name}={value}" for name, value in extra.items()),
        *shlex.split(execstart),
    ]


def get(url: str, context: ssl.SSLContext) -> int:
    try:
        with urllib.request.urlopen(url, context=context, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return error.code


def test_the_service_runs_as_the_unit_runs_it(package: Path, tmp_path: Path) -> None:
    server = issue(None, names=("localhost", "127.0.0.1"))
    gid = grp.getgrnam("logbroker").gr_gid
    for name, content in [("server.crt", server.cert_pem), ("server.key", server.key_pem)]:
        path = TLS_DIR / name
        write(path, content)
        os.chown(path, 0, gid)
        path.chmod(0o640)
    cafile = write(tmp_path / "ca.pem", server.cert_pem)
    context = ssl.create_default_context(cafile=cafile)
    port, dashboard = free_port(), free_port()
    ports = {
        "SVC_TCP_PORT": str(port),
        "SVC_DASHBOARD_PORT": str(dashboard),
        "SVC_PEER_PORT": str(free_port()),
    }
    log = tmp_path / "twistd.log"
    with log.open("wb") as output:
        broker = subprocess.Popen(
            unit_command(SVC_ADMIN_PASS=PASSWORD, **ports), stdout=output, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert broker.poll() is None, f"the broker exited:\n{log.read_text()}"
            try:
                if get(f"https://127.0.0.1:{dashboard}/ready", context) == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"not ready in 60 s:\n{log.read_text()}"
            time.sleep(0.2)
        assert get(f"https://127.0.0.1:{dashboard}/health", context) == 200

        client = [
            str(CLI), "--server", f"127.0.0.1:{port}", "--user", "admin", "--password", PASSWORD,
            "--tls", "--cafile", cafile,
        ]  # fmt: skip
        sh(*client, "topic", "create", "packaged", timeout=60)
        sh(*client, "produce", "packaged", input="first\nsecond\n", timeout=60)
        consumed = sh(*client, "consume", "packaged", timeout=60).stdout.split()
        assert sorted(consumed) == ["first", "second"]
        assert any(DATA_DIR.iterdir()), "the broker keeps its data in the data directory"
    finally:
        # runuser would answer a SIGTERM of its own by killing the broker: signal the broker
        # (runuser's one child, twistd exec'd by env), as systemd would, and take its status.
        for twistd in Path(f"/proc/{broker.pid}/task/{broker.pid}/children").read_text().split():
            os.kill(int(twistd), signal.SIGTERM)
        status = broker.wait(timeout=60)
    assert status == 0, log.read_text()


def test_without_an_admin_password_it_exits_2_naming_the_variable(package: Path) -> None:
    result = subprocess.run(
        unit_command(), capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "SVC_ADMIN_PASS" in result.stdout + result.stderr


def test_purge_leaves_nothing(package: Path) -> None:
    purge()
    paths = (VENV, ENV_FILE.parent, DATA_DIR, CLI, UNIT, WANTS, Path("/usr/share/logbroker"))
    left = [str(path) for path in paths if os.path.lexists(path)]
    assert not left, f"left after purge: {left}"
    for database in ("passwd", "group"):
        found = subprocess.run(["getent", database, "logbroker"], capture_output=True, check=False)
        assert found.returncode == 2, f"logbroker still in {database}"
