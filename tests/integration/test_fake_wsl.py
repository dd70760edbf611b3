"""The fake `wsl.exe` behaves as real WSL2 does where the app depends on it: UTF-16 listings, the
shell re-parse of `--` (and none with `-e`), only `WSLENV` variables crossing, the app's folders
absent inside, localhost forwarding of TCP only, a Linux process outliving its wsl.exe, and stock
Ubuntu's python3 without ensurepip."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.engines import free_port
from tests.support.fake_wsl import TOOLS, FakeDistro, FakeWsl, install_fake_wsl

pytestmark = pytest.mark.integration

TIMEOUT_S = 10.0


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeWsl]:
    app_data = tmp_path / "app-data"
    app_data.mkdir()
    (app_data / "settings.json").write_text("{}")
    installed = install_fake_wsl(tmp_path / "bin", [FakeDistro("Ubuntu", default=True),
                                                    FakeDistro("Legacy", version=1)],
                                 hide=[tmp_path, TOOLS])
    yield installed
    installed.kill_all()


def environment(fake: FakeWsl, **extra: str) -> dict[str, str]:
    env = fake.environment({name: value for name, value in os.environ.items() if name not in ("WSL_UTF8", "WSLENV")})
    env.update(extra)
    return env


def wsl(fake: FakeWsl, *args: str, input: bytes = b"", **extra: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["wsl.exe", *args], env=environment(fake, **extra), input=input, capture_output=True,
                          timeout=TIMEOUT_S, check=False)


def eventually(check: Callable[[], object], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_listing_is_utf16_unless_wsl_utf8(fake: FakeWsl) -> None:
    listed = wsl(fake, "-l", "-v")
    assert listed.returncode == 0
    assert listed.stdout.decode("utf-16-le").splitlines() == [
        "  NAME      STATE           VERSION",
        "* Ubuntu    Stopped         2",
        "  Legacy    Stopped         1",
    ]
    assert listed.stdout.startswith(b" \0 \0N\0A\0M\0E\0")  # UTF-16LE with no byte-order mark
    assert wsl(fake, "--list", "--quiet").stdout == "Ubuntu\r\nLegacy\r\n".encode("utf-16-le")
    assert wsl(fake, "-l", "-q", WSL_UTF8="1").stdout == b"Ubuntu\r\nLegacy\r\n"

    sleeper = subprocess.Popen(["wsl.exe", "-d", "Legacy", "-e", "sleep", "30"], env=environment(fake))
    try:
        eventually(lambda: fake.processes("Legacy"))
        assert wsl(fake, "--list", "--verbose", WSL_UTF8="1").stdout.decode().splitlines()[1:] == [
            "* Ubuntu    Stopped         2",
            "  Legacy    Running         1",
        ]
    finally:
        sleeper.kill()
        sleeper.wait()


def test_no_distribution_and_unknown_distribution(fake: FakeWsl, tmp_path: Path) -> None:
    unknown = wsl(fake, "-d", "Debian", "-e", "true", WSL_UTF8="1")
    assert (unknown.returncode, unknown.stderr.decode().splitlines()[0]) == (
        1, "There is no distribution with the supplied name.")
    empty = install_fake_wsl(tmp_path / "empty", [])
    listed = wsl(empty, "-l", "-q")
    assert listed.returncode != 0
    assert "Windows Subsystem for Linux has no installed distributions." in listed.stderr.decode("utf-16-le")


def test_double_dash_reparses_through_the_shell_and_exec_does_not(fake: FakeWsl) -> None:
    marker = fake.home("Ubuntu") / "ran"
    shelled = wsl(fake, "--cd", "~", "--", "printf", "'[%s]'", "{a,b}", "$(touch ran)", WSL_UTF8="1")
    assert shelled.returncode == 0, shelled.stderr
    assert shelled.stdout == b"[a][b][]"
    assert marker.exists()
    marker.unlink()

    execed = wsl(fake, "--cd", "~", "-e", "printf", "[%s]", "{a,b}", "$(touch ran)")
    assert execed.returncode == 0, execed.stderr
    assert execed.stdout == b"[{a,b}][$(touch ran)]"
    assert not marker.exists()


def test_exit_status_stdio_and_missing_program(fake: FakeWsl) -> None:
    echoed = wsl(fake, "-e", "sh", "-c", "cat; echo err >&2; exit 7", input=b"through stdin")
    assert (echoed.returncode, echoed.stdout, echoed.stderr) == (7, b"through stdin", b"err\n")
    missing = wsl(fake, "-e", "no-such-program")
    assert missing.returncode == 1
    assert b"execvpe(no-such-program) failed: No such file or directory" in missing.stderr
    no_sudo = wsl(fake, "-e", "sudo", "apt-get", "install", "-y", "python3-venv")
    assert no_sudo.returncode != 0
    assert b"sudo: a terminal is required" in no_sudo.stderr
    assert wsl(fake, "-d", "Ubuntu").returncode != 0  # an interactive shell: nothing a test can use


def test_only_wslenv_variables_arrive(fake: FakeWsl) -> None:
    shown = wsl(fake, "-e", "env", "-0", SECRET_KEY="s3cret", NOT_NAMED="left-behind",
                MODEL_DIR="C:\\Users\\Jos\\models", SEARCH="C:\\a;D:\\b\\c", OUTWARD="only-out",
                WSLENV="SECRET_KEY/u:MODEL_DIR/p:SEARCH/l:OUTWARD/w")
    assert shown.returncode == 0, shown.stderr
    inside = dict(entry.split("=", 1) for entry in shown.stdout.decode().split("\0") if entry)
    assert inside.pop("WSLENV") == "SECRET_KEY/u:MODEL_DIR/p:SEARCH/l:OUTWARD/w"
    inside.pop("PWD", None)
    assert inside == {
        "HOME": "/home/lender", "USER": "lender", "LOGNAME": "lender", "SHELL": "/bin/bash",
        "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "WSL_DISTRO_NAME": "Ubuntu",
        "SECRET_KEY": "s3cret", "MODEL_DIR": "/mnt/c/Users/Jos/models", "SEARCH": "/mnt/c/a:/mnt/d/b/c",
    }


def test_app_folders_are_absent_inside_and_the_distro_has_its_own(fake: FakeWsl, tmp_path: Path) -> None:
    hidden_repo_file = TOOLS / "wslpath"
    script = (f"test -e {tmp_path / 'app-data' / 'settings.json'} && echo app-data; "
              f"test -e {hidden_repo_file} && echo repo-tools; "
              f"test -e {Path(sys.executable).resolve()} || echo no-python; "
              "test -e /usr/bin/python3 && echo system-python; "
              "echo home > ~/made-inside; ls -A /tmp; wslpath -w ~/made-inside; wslpath -u 'C:\\Users\\Jos'")
    shown = wsl(fake, "--cd", "~", "-e", "bash", "-c", script)
    assert shown.returncode == 0, shown.stderr
    made = fake.home("Ubuntu") / "made-inside"
    assert shown.stdout.decode().splitlines() == ["system-python", str(made), "/mnt/c/Users/Jos"]
    assert made.read_text() == "home\n"
    assert fake.linux_path_on_host("Ubuntu", "~/made-inside") == made


def test_only_home_and_tmp_are_writable_inside(fake: FakeWsl) -> None:
    """As for the distro's non-root user; and a program inside never changes the host's system or
    this repository."""
    repo_file = Path(__file__).parent / "fake-wsl-write-probe"
    script = f"touch ~/mine /tmp/mine && echo own-folders; touch /usr/lib/probe {repo_file} 2>&1"
    shown = wsl(fake, "-e", "bash", "-c", script)
    # a checkout under /tmp or /home is not there at all inside (the distro has its own of both)
    hidden = repo_file.parts[1] in ("tmp", "home")
    assert shown.stdout.decode().splitlines() == [
        "own-folders",
        "touch: cannot touch '/usr/lib/probe': Read-only file system",
        f"touch: cannot touch '{repo_file}': " + ("No such file or directory" if hidden else "Read-only file system"),
    ]
    assert not repo_file.exists() and not Path("/usr/lib/probe").exists()


def test_an_app_folder_made_after_the_distro_started_is_covered_too(tmp_path: Path) -> None:
    outside = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="fake-wsl-test-"))  # not the distro's /tmp
    later = outside / "app-data"
    late = install_fake_wsl(tmp_path / "bin", [FakeDistro("Ubuntu")], hide=[later])
    sleeper = subprocess.Popen(["wsl.exe", "-e", "sleep", "30"], env=environment(late))
    try:
        eventually(lambda: late.processes("Ubuntu"))
        later.mkdir()
        (later / "settings.json").write_text("{}")
        (outside / "not-hidden").write_text("")
        eventually(lambda: wsl(late, "-e", "test", "!", "-e", str(later / "settings.json")).returncode == 0)
        assert wsl(late, "-e", "test", "-e", str(outside / "not-hidden")).returncode == 0
    finally:
        sleeper.kill()
        sleeper.wait()
        late.kill_all()
        shutil.rmtree(outside)


def test_tcp_inside_is_reachable_from_host_with_streaming(fake: FakeWsl) -> None:
    port = free_port()
    server = textwrap.dedent(f"""
        import socket, threading, time
        srv = socket.socket()
        srv.bind(("127.0.0.1", {port}))
        srv.listen(64)
        print("up", flush=True)
        def serve(conn):
            with conn:
                count = int(conn.recv(16))
                for i in range(count):
                    conn.sendall(b"chunk %d\\n" % i)
                    time.sleep(0.05)
        while True:
            threading.Thread(target=serve, args=(srv.accept()[0],), daemon=True).start()
    """)
    inside = subprocess.Popen(["wsl.exe", "-e", "python3", "-c", server], env=environment(fake),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert inside.stdout is not None and inside.stdout.readline() == b"up\n"
        started = time.monotonic()
        eventually(lambda: _connects(port))
        assert time.monotonic() - started < 2.0  # WSL forwards within about a second; the fake polls every 0.1 s
        results: dict[int, list[tuple[float, bytes]]] = {}
        clients = [threading.Thread(target=_stream, args=(port, n, results)) for n in range(8)]
        for client in clients:
            client.start()
        for client in clients:
            client.join(TIMEOUT_S)
        for received in results.values():
            assert b"".join(data for _, data in received) == b"".join(b"chunk %d\n" % i for i in range(10))
            assert received[-1][0] - received[0][0] > 0.3  # it arrived as it was sent, not all at once
        assert len(results) == 8
        assert not _connects(free_port())  # a port nothing listens on inside is not forwarded
    finally:
        inside.kill()
        inside.wait()


def test_wildcard_and_ipv6_listeners_are_forwarded_too(fake: FakeWsl) -> None:
    ports = {address: free_port() for address in ("0.0.0.0", "::", "::1", "::ffff:127.0.0.1")}
    server = textwrap.dedent(f"""
        import socket, threading
        def serve(address, port):
            srv = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
            srv.bind((address, port))
            srv.listen(4)
            ready.release()
            while True:
                conn, _ = srv.accept()
                conn.sendall(address.encode())
                conn.close()
        ready = threading.Semaphore(0)
        for address, port in {ports!r}.items():
            threading.Thread(target=serve, args=(address, port), daemon=True).start()
        for _ in range(4):
            ready.acquire()
        print("up", flush=True)
        input()
    """)
    inside = subprocess.Popen(["wsl.exe", "-e", "python3", "-c", server], env=environment(fake),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert inside.stdout is not None and inside.stdout.readline() == b"up\n"
        for address, port in ports.items():
            eventually(lambda: _connects(port))
            with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as conn:
                assert conn.recv(64) == address.encode()
    finally:
        inside.kill()
        inside.wait()


def _connects(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _stream(port: int, n: int, results: dict[int, list[tuple[float, bytes]]]) -> None:
    received: list[tuple[float, bytes]] = []
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as conn:
        conn.sendall(b"10")
        while data := conn.recv(65536):
            received.append((time.monotonic(), data))
    results[n] = received


def test_unix_sockets_and_host_ports_do_not_cross(fake: FakeWsl) -> None:
    host_server = socket.socket()
    host_server.bind(("127.0.0.1", 0))
    host_server.listen(1)
    host_port = host_server.getsockname()[1]
    script = textwrap.dedent(f"""
        import socket, sys
        try:
            socket.create_connection(("127.0.0.1", {host_port}), timeout=1)
            print("host port reached", flush=True)
        except OSError:
            print("host port unreachable", flush=True)
        unix = socket.socket(socket.AF_UNIX)
        unix.bind("/tmp/engine.sock")
        unix.listen(1)
        print("up", flush=True)
        sys.stdin.read()
    """)
    inside = subprocess.Popen(["wsl.exe", "-e", "python3", "-c", script], env=environment(fake),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert inside.stdout is not None
        assert inside.stdout.readline() == b"host port unreachable\n"
        assert inside.stdout.readline() == b"up\n"
        with socket.socket(socket.AF_UNIX) as client, pytest.raises(OSError):
            client.connect("/tmp/engine.sock")
    finally:
        host_server.close()
        inside.kill()
        inside.wait()


def test_killing_wsl_exe_leaves_the_linux_process_running_with_stdin_at_eof(fake: FakeWsl) -> None:
    script = textwrap.dedent("""
        import os, sys, time
        print(os.getpid(), flush=True)
        sys.stdin.read()
        open(os.path.expanduser("~/stdin-closed"), "w").close()
        time.sleep(60)
    """)
    launcher = subprocess.Popen(["wsl.exe", "-e", "python3", "-c", script], env=environment(fake),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    assert launcher.stdout is not None
    linux_pid = int(launcher.stdout.readline())
    assert fake.processes("Ubuntu") == [linux_pid]
    os.killpg(launcher.pid, signal.SIGKILL)  # as a Job Object or taskkill /T ends wsl.exe
    launcher.wait()
    eventually(lambda: (fake.home("Ubuntu") / "stdin-closed").exists())
    assert fake.processes("Ubuntu") == [linux_pid]
    fake.kill_all()
    eventually(lambda: not fake.processes("Ubuntu"))


def test_without_root_the_distro_is_a_user_namespace_run_by_the_host_python(tmp_path: Path) -> None:
    """A developer's machine: no root (CI drops to nobody to get there), /usr/bin/python3 only."""
    unprivileged = 65534 if os.geteuid() == 0 else os.geteuid()
    place = Path(tempfile.mkdtemp(prefix="fake-wsl-user-"))
    user_fake = install_fake_wsl(place / "bin", [FakeDistro("Ubuntu")], hide=[place])
    for path in [place, *place.rglob("*")]:
        os.chown(path, unprivileged, unprivileged)
    port = free_port()
    script = (f"import os, socket; s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(); "
              "print(os.getuid(), os.listdir('/tmp'), os.getcwd(), flush=True); c, _ = s.accept(); c.sendall(b'hi')")
    env = {"PATH": f"{user_fake.bin_dir}:/usr/bin:/bin", "HOME": str(place)}
    inside = subprocess.Popen(["wsl.exe", "--cd", "~", "-e", "python3", "-c", script], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, user=unprivileged, group=unprivileged, extra_groups=[])
    try:
        assert inside.stdout is not None
        assert inside.stdout.readline() == f"{unprivileged} [] /home/lender\n".encode()
        eventually(lambda: _connects_and_reads(port) == b"hi")
    finally:
        inside.kill()
        inside.wait()
        user_fake.kill_all()
        shutil.rmtree(place)


def _connects_and_reads(port: int) -> bytes:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
            return conn.recv(16)
    except OSError:
        return b""


def test_processes_include_grandchildren_and_the_distro_stops_after(fake: FakeWsl) -> None:
    started = wsl(fake, "--", "sleep", "30", ">/dev/null", "2>&1", "&", "echo", "$!")
    grandchild = int(started.stdout)
    assert fake.processes("Ubuntu") == [grandchild]
    os.kill(grandchild, signal.SIGKILL)
    eventually(lambda: b"Stopped" in wsl(fake, "-l", "-v", WSL_UTF8="1").stdout.splitlines()[1])
    assert fake.processes("Ubuntu") == []


def test_shutdown_ends_everything_inside_and_the_attached_wsl_exe(fake: FakeWsl) -> None:
    """What Docker Desktop or an update does: the engine's wsl.exe sees its program end."""
    attached = subprocess.Popen(["wsl.exe", "-e", "sleep", "30"], env=environment(fake))
    try:
        eventually(lambda: fake.processes("Ubuntu"))
        assert wsl(fake, "--shutdown").returncode == 0
        assert attached.wait(TIMEOUT_S) != 0
        eventually(lambda: not fake.processes("Ubuntu"))
        assert b"Running" not in wsl(fake, "-l", "-v", WSL_UTF8="1").stdout
    finally:
        attached.kill()
        attached.wait()


def test_python3_venv_needs_without_pip_as_on_stock_ubuntu(fake: FakeWsl) -> None:
    refused = wsl(fake, "--cd", "~", "-e", "python3", "-m", "venv", "engines/vllm")
    assert refused.returncode == 1
    assert refused.stdout.decode().startswith(
        "The virtual environment was not created successfully because ensurepip is not\n"
        "available.  On Debian/Ubuntu systems, you need to install the python3-venv\n"
        "package using the following command.\n")
    made = wsl(fake, "--cd", "~", "-e", "python3", "-m", "venv", "--without-pip", "venv")
    assert made.returncode == 0, made.stderr
    venv_python = fake.home("Ubuntu") / "venv" / "bin" / "python3"
    assert venv_python.exists()
    ran = wsl(fake, "-e", "/home/lender/venv/bin/python3", "-c", "import sys; print(sys.prefix)")
    assert ran.stdout == b"/home/lender/venv\n"
    around = wsl(fake, "--cd", "~", "-e", "/usr/bin/python3", "-m", "venv", "other")  # not round the wrapper either
    assert around.returncode == 1
    for no_pip in (["python3", "-m", "pip", "--version"], ["pip3", "install", "vllm"]):
        assert wsl(fake, "-e", *no_pip).returncode != 0


def test_ensurepip_when_the_distro_has_python3_venv(tmp_path: Path) -> None:
    with_venv = install_fake_wsl(tmp_path / "bin", [FakeDistro("Ubuntu")], ensurepip=True)
    try:
        shown = wsl(with_venv, "-e", "python3", "-m", "ensurepip", "--version")
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.startswith(b"pip ")
    finally:
        with_venv.kill_all()
