"""``psgrad bench --bandwidth``: namespaces, rate limits and their removal (root only)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from test_bench import SMALL, _launcher

from psgrad.bench import netshape

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not sys.platform.startswith("linux") or not (shutil.which("ip") and shutil.which("tc")),
    reason="shaped runs need root on Linux with iproute2 (network namespaces, veth, tc)",
)


def _ours() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith("psgrad")]


def test_parse_rate():
    assert netshape.parse_rate("100mbit") == 100_000_000
    assert netshape.parse_rate("1Gbit") == 1_000_000_000
    assert netshape.parse_rate("2.5kbit") == 2500
    for bad in ("100", "fast", "0mbit", "100mbps", "-1gbit"):
        with pytest.raises(ValueError, match="100mbit"):
            netshape.parse_rate(bad)


def test_without_root_says_so(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(netshape.ShapeError, match="needs root"):
        netshape.check_available("mpiexec")


@needs_root
def test_shaped_bench_is_rate_limited_and_cleans_up(tmp_path):
    out = tmp_path / "bench.json"
    rate = 50_000_000
    proc = _launcher(
        [*SMALL, "--steps", "6", "--warmup-steps", "2", "--codecs", "none", "--baselines", "ddp"]
        + ["--bandwidth", "50mbit", "--json", str(out)]
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "50mbit per link (shaped)" in proc.stderr
    rows = {r["codec"]: r for r in json.loads(out.read_text())}
    # the kernel's token bucket is an upper bound: the server's link cannot carry more than its rate
    # (10% slack for the bucket's burst), and unshaped loopback would carry far more
    none = rows["none"]
    assert none["it_per_s"] * none["bytes_down"] * 8 <= rate * 1.1
    ddp = rows["ddp"]
    assert ddp["it_per_s"] * ddp["bytes_up"] / 2 * 8 <= rate * 1.1
    assert _ours() == []


def test_a_namespace_that_cannot_be_removed_is_said_with_the_command(monkeypatch, capsys):
    def busy(*args, check=True):
        return subprocess.CompletedProcess(
            ["ip", *args], 1, "", "Cannot remove namespace file: Device or resource busy"
        )

    monkeypatch.setattr(netshape, "_ip", busy)
    net = netshape.ShapedNetwork(1, "10mbit")
    net.created = [net.switch, net.namespace(0)]
    net.remove()
    err = capsys.readouterr().err
    for name in (net.switch, net.namespace(0)):
        assert (
            f"network namespace {name} was not removed (Cannot remove namespace file: Device or resource busy)" in err
        )
        assert f"ip netns del {name}" in err


@needs_root
def test_shaped_network_removed_on_error():
    with pytest.raises(RuntimeError, match="boom"), netshape.ShapedNetwork(2, "10mbit") as net:
        assert set(_ours()) == {net.switch, net.namespace(0), net.namespace(1)}
        raise RuntimeError("boom")
    assert _ours() == []


@needs_root
@pytest.mark.parametrize(
    "signal_name,group,said,status",
    [("SIGINT", True, "interrupted", 130), ("SIGTERM", False, "terminated (SIGTERM)", 143)],
)
def test_shaped_bench_removed_on_ctrl_c_or_sigterm(signal_name, group, said, status):
    """Ctrl-C (SIGINT to the terminal's process group) or SIGTERM to the launcher alone: the
    namespaces are gone, the running job was stopped and said so, and the status is the signal's."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "psgrad",
            "bench",
            *SMALL,
            "--steps",
            "500",
            "--codecs",
            "none",
            "--bandwidth",
            "10mbit",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(_ours()) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(_ours()) == 4, "the shaped network never came up"
        time.sleep(3)  # let the MPI job start inside it
        if group:
            os.killpg(proc.pid, getattr(signal, signal_name))  # what Ctrl-C in a terminal does
        else:
            proc.send_signal(getattr(signal, signal_name))
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == status, err[-3000:]
    assert f"[bench] {said} in run 1/1: its job was stopped, no table" in err, err[-3000:]
    assert _ours() == []


@needs_root
def test_stale_namespaces_of_dead_launchers_are_removed():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    name = f"psgrad{int(dead.stdout)}-r0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    assert name in netshape.remove_stale()
    assert name not in _ours()
