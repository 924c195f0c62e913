"""What `kvservice serve` refuses before it starts anything (issue 13, points 3, 8, 12), on real processes:
one allocator per data dir, a port in use, auth beyond loopback, and its help text; and the address a shard
advertises."""

import os
import shutil
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from kvservice.ops import AddRequestOp, AllocateOp
from tests.service_helpers import REPO, small_config, start_server


def serve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvservice.cli", "--log-level", "WARNING", "serve", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_a_second_allocator_on_the_same_data_dir_exits_and_touches_nothing(tmp_path):
    data = tmp_path / "data"
    first = start_server("--data-dir", str(data), persistence=True, log_dir=tmp_path)
    try:
        c = first.client()
        c.register_pool("p", small_config(64, 16), max_model_len=512)
        c.step("p", [AddRequestOp("r", token_ids=list(range(40))), AllocateOp("r", num_new_tokens=40)])
        redis_pid = (data / "redis.pid").read_text().strip()
        started = time.monotonic()
        second = serve("--data-dir", str(data), "--port", "0")
        assert second.returncode == 2 and time.monotonic() - started < 20
        assert f"another kvservice serve (pid {first.proc.pid}) is using --data-dir" in second.stderr
        assert second.stderr.count("\n") == 1, second.stderr  # one line, no traceback
        # The first one is untouched: same embedded Redis, persistence healthy, state intact.
        assert (data / "redis.pid").read_text().strip() == redis_pid
        time.sleep(1.5)  # its health watch runs every 0.5 s: a fenced allocator would have exited by now
        assert first.proc.poll() is None
        stats = c.get_stats()
        assert stats.persistence == "ok" and stats.pools["p"].num_requests == 1
        c.step("p", [AddRequestOp("r2", token_ids=[1, 2, 3]), AllocateOp("r2", num_new_tokens=3)])
        c.close()
    finally:
        first.stop()
    # Once the first has exited, the lock is free again.
    again = start_server("--data-dir", str(data), persistence=True, log_dir=tmp_path)
    try:
        assert again.client().get_request("p", "r2").num_tokens == 3
    finally:
        again.stop()


def test_a_port_in_use_is_a_one_line_error_before_anything_starts(tmp_path):
    first = start_server(log_dir=tmp_path)
    try:
        for extra in (["--no-persistence"], ["--data-dir", str(tmp_path / "second")]):
            second = serve("--port", str(first.port), *extra)
            assert second.returncode == 2, second.stderr
            assert second.stderr.strip() == (f"kvservice serve: port {first.port} on 127.0.0.1 is in use (Address "
                                             f"already in use); stop what listens there or choose another --port")
        assert not (tmp_path / "second" / "redis.sock").exists()  # no embedded Redis was started
    finally:
        first.stop()


NETNS_SCRIPT = textwrap.dedent("""
    import subprocess, sys
    from kvservice.client import KVServiceClient
    from kvservice.errors import Unauthenticated
    from kvservice.launch import start_serve
    from tests.service_helpers import small_config
    data, mode = sys.argv[1], sys.argv[2]
    args = ["--host", "10.99.0.1", "--port", "0", "--no-persistence", "--data-dir", data]
    proc = start_serve(args + (["--insecure"] if mode == "insecure" else []), log_level="WARNING")
    try:
        anonymous = KVServiceClient(proc.target, retries=0)
        try:
            anonymous.get_stats()
            print("anonymous: served")
        except Unauthenticated:
            print("anonymous: unauthenticated")
        if mode == "secure":
            token = open(data + "/token").read().split()[0]
            with KVServiceClient(proc.target, token) as client:
                client.register_pool("p", small_config(), max_model_len=256)
                print("token: served", sorted(client.get_stats().pools))
    finally:
        proc.stop()
""")


@pytest.mark.skipif(shutil.which("unshare") is None or shutil.which("ip") is None or os.geteuid() != 0,
                    reason="needs unshare and ip (util-linux, iproute2) and root for a private network namespace")
@pytest.mark.parametrize("mode", ["secure", "insecure"])
def test_beyond_loopback_auth_is_on_unless_insecure(tmp_path, mode):
    """In a private network namespace (nothing outside can reach it) whose only non-loopback address is
    10.99.0.1: without --token-file the server generates a token (mode 0600) and requires it."""
    data = tmp_path / "data"
    script = tmp_path / "inside.py"
    script.write_text(NETNS_SCRIPT)
    cmd = f"ip link set lo up && ip addr add 10.99.0.1/32 dev lo && exec {sys.executable} {script} {data} {mode}"
    out = subprocess.run(["unshare", "-n", "sh", "-c", cmd], capture_output=True, text=True, timeout=120, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-3000:]
    if mode == "secure":
        assert "anonymous: unauthenticated" in out.stdout and "token: served ['p']" in out.stdout
        assert stat.S_IMODE((data / "token").stat().st_mode) == 0o600
        assert "generated a token into" in out.stderr
    else:
        assert "anonymous: served" in out.stdout and not (data / "token").exists()
        assert "INSECURE" in out.stderr


def test_every_serve_flag_says_what_it_does_and_its_default():
    out = subprocess.run([sys.executable, "-m", "kvservice.cli", "serve", "--help"], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert out.returncode == 0 and out.stdout.startswith("usage: kvservice serve")
    from kvservice.cli import build_parser
    serve_parser = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = [a for a in serve_parser._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= 27
    text = " ".join(out.stdout.split())
    for action in flags:
        assert action.help and len(action.help) > 20, f"{action.option_strings[0]} has no help text"
        assert " ".join(action.help.split()[:4]) in text  # as printed
        switch = action.nargs == 0 or action.dest == "quotas"  # on/off, or repeatable
        if not switch and action.default not in (None, ""):
            assert f"(default: {action.default})" in action.help, f"{action.option_strings[0]}: no default shown"


def test_make_test_and_make_run_install_first_on_a_fresh_clone(tmp_path):
    """`make test` / `make run` work as the first command: they install when .venv/ is missing or older than
    pyproject.toml (read from a dry run, `make -n`, of a fresh checkout: the Makefile and pyproject.toml)."""
    clone = tmp_path / "clone"
    clone.mkdir()
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO / name, clone / name)
    for target in ("test", "run"):
        plan = subprocess.run(["make", "-n", target], cwd=clone, capture_output=True, text=True, timeout=60,
                              env={k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"})
        assert "make install" in plan.stdout or "install -q" in plan.stdout, plan.stdout[:2000]
    (clone / ".venv").mkdir()
    (clone / ".venv" / ".kvservice-installed").touch()
    plan = subprocess.run(["make", "-n", "test"], cwd=clone, capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"})
    assert "install" not in plan.stdout and "pytest" in plan.stdout
    later = (clone / ".venv" / ".kvservice-installed").stat().st_mtime + 10
    os.utime(clone / "pyproject.toml", (later, later))  # a newer pyproject.toml: install again
    plan = subprocess.run(["make", "-n", "test"], cwd=clone, capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"})
    assert "make install" in plan.stdout


@pytest.mark.parametrize("command", ["demo", "deploy", "generate", "status", "route"])
def test_every_subcommand_names_itself_in_its_help(command):
    out = subprocess.run([sys.executable, "-m", "kvservice.cli", command, "--help"], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0 and out.stdout.startswith(f"usage: kvservice {command}"), out.stdout[:200]


def test_a_shard_advertises_its_bound_port_when_told_port_0():
    """`--advertise HOST:0` is HOST and the port the server bound (`--port 0`: no port picked beforehand,
    which another process could take first); no --advertise: --host and the bound port."""
    from kvservice.server.serve import advertised_address
    from kvservice.settings import ServerSettings

    assert advertised_address(ServerSettings(advertise="10.0.0.7:0"), 41234) == "10.0.0.7:41234"
    assert advertised_address(ServerSettings(advertise="[::1]:0"), 41234) == "[::1]:41234"
    assert advertised_address(ServerSettings(advertise="shard-0.svc:50051"), 41234) == "shard-0.svc:50051"
    assert advertised_address(ServerSettings(host="127.0.0.1"), 41234) == "127.0.0.1:41234"
