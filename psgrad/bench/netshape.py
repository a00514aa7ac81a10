"""Bandwidth-shaped network namespaces for ``psgrad bench --bandwidth`` (Linux, root, MPICH).

1. A namespace ``<prefix>-sw`` holds a bridge ``br0``: the switch. Nothing is created in the
   host's own namespace, and the only addresses used are the ones given here to the ranks'
   interfaces (``10.213.0.<rank+1>/24``), which exist only inside these namespaces.
2. Rank i gets a namespace ``<prefix>-r<i>`` with ``lo`` and one end of a veth pair, ``psg0``; the
   other end, ``p<i>``, is a port of the bridge.
3. A token-bucket filter (``tc qdisc ... tbf rate R``) on both ends of every veth pair limits each
   rank's link to R in each direction: one full-duplex NIC per node on a switch.
4. ``mpiexec`` starts ``python -m psgrad.bench.netshape exec CMD`` on every rank, which reads the rank
   MPICH gave it (``PMI_RANK``) and replaces itself with ``ip netns exec <prefix>-r<rank> CMD``.
   The rank's PMI connection to mpiexec is an inherited socket, so it crosses into the namespace;
   ``environment()`` forces MPICH (and gloo, for the DDP baselines) onto TCP over ``psg0``.
5. Deleting the namespaces removes every veth, the bridge and the qdiscs. ``ShapedNetwork`` does
   it on exit, on an exception, on Ctrl-C and on SIGTERM/SIGHUP; namespaces whose owner (the pid
   in ``<prefix>``) was SIGKILLed are removed by the next ``ShapedNetwork``.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
from types import FrameType

from ..runtime.signals import Terminated

IFACE = "psg0"
SUBNET = "10.213.0"
_PREFIX_RE = re.compile(r"^psgrad(\d+)-(?:sw|r\d+)$")
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)\s*$", re.IGNORECASE)
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


class ShapeError(RuntimeError):
    """The shaped network cannot be built here (not root, no ``ip``/``tc``, not MPICH, ...)."""


def parse_rate(text: str) -> int:
    """``100mbit`` → 100_000_000 bits per second (tc's units: bit, kbit, mbit, gbit, tbit)."""
    match = _RATE_RE.match(text)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"bandwidth must look like 100mbit or 1gbit (tc units bit/kbit/mbit/gbit), got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def address(rank: int) -> str:
    """The IPv4 address of rank ``rank`` inside its namespace."""
    return f"{SUBNET}.{rank + 1}"


@functools.cache
def mpiexec_banner(mpiexec: str) -> str:
    """What ``mpiexec --version`` prints (which MPI it belongs to); asked once per mpiexec."""
    return subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30).stdout


def check_available(mpiexec: str) -> None:
    """Raise ShapeError saying exactly what is missing for shaped runs."""
    if sys.platform != "linux":
        raise ShapeError("--bandwidth needs Linux network namespaces")
    if os.geteuid() != 0:
        raise ShapeError(
            "--bandwidth needs root: it creates network namespaces, veth pairs and tc rate limits "
            "(run as root, e.g. sudo -E, or leave out --bandwidth for an unshaped run)"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ShapeError(f"--bandwidth needs the '{tool}' command (Debian/Ubuntu package iproute2)")
    version = mpiexec_banner(mpiexec)
    if "HYDRA" not in version and "MPICH" not in version:
        raise ShapeError(
            f"--bandwidth supports MPICH's mpiexec (hydra) only; {mpiexec} is not MPICH "
            "(install the pip 'mpich' package: bash launch/setup.sh)"
        )


def environment(prefix: str) -> dict[str, str]:
    """Variables that put MPICH and gloo on TCP over the shaped interface."""
    return {
        "PSGRAD_NETNS_PREFIX": prefix,
        "MPIR_CVAR_NOLOCAL": "1",  # no shared memory between ranks: every byte crosses the link
        "MPIR_CVAR_CH4_NETMOD": "ofi",
        "FI_PROVIDER": "tcp",
        "FI_TCP_IFACE": IFACE,
        "GLOO_SOCKET_IFNAME": IFACE,
        "PSGRAD_RANK0_ADDR": address(0),
    }


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise ShapeError(f"'ip {' '.join(args)}' failed: {proc.stderr.strip()}")
    return proc


def _tbf(namespace: str, device: str, rate_bits: int) -> None:
    # the bucket must hold at least one timer tick of traffic or the link runs below its rate:
    # 10 ms worth, and never less than a few full-size frames
    burst = max(32_000, rate_bits // 8 // 100)
    cmd = ["tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", f"{rate_bits}bit"]
    cmd += ["burst", str(burst), "latency", "50ms"]
    proc = subprocess.run(["ip", "netns", "exec", namespace, *cmd], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ShapeError(f"'{' '.join(cmd)}' in {namespace} failed: {proc.stderr.strip()}")


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete psgrad namespaces whose owning process no longer exists; return their names."""
    removed = []
    for name in _namespaces():
        match = _PREFIX_RE.match(name)
        if match and not _alive(int(match.group(1))) and _ip("netns", "del", name, check=False).returncode == 0:
            removed.append(name)
    return removed


class ShapedNetwork:
    """Context manager: ``ranks`` namespaces on a bridge, each link limited to ``rate``."""

    def __init__(self, ranks: int, rate: str) -> None:
        if not 1 <= ranks <= 250:
            raise ValueError(f"shaped networks hold 1..250 ranks, got {ranks}")
        self.ranks = ranks
        self.rate = rate
        self.rate_bits = parse_rate(rate)
        self.prefix = f"psgrad{os.getpid()}"
        self.created: list[str] = []
        self._old_handlers: dict[int, object] = {}

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def namespace(self, rank: int) -> str:
        return f"{self.prefix}-r{rank}"

    def environment(self) -> dict[str, str]:
        return environment(self.prefix)

    def wrap(self, command: list[str]) -> list[str]:
        """The rank command as mpiexec must start it: inside the rank's namespace."""
        return [sys.executable, "-m", "psgrad.bench.netshape", "exec", *command]

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self.created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def build(self) -> None:
        remove_stale()
        self._add_namespace(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for rank in range(self.ranks):
            ns, port = self.namespace(rank), f"p{rank}"
            self._add_namespace(ns)
            _ip("link", "add", IFACE, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{address(rank)}/24", "dev", IFACE)
            _ip("-n", ns, "link", "set", IFACE, "up")
            _tbf(ns, IFACE, self.rate_bits)
            _tbf(self.switch, port, self.rate_bits)

    def remove(self) -> None:
        """Delete every namespace made, the switch last; one that stays is said, with the command
        that removes it (a namespace left behind holds its veth and qdiscs until someone does)."""
        for name in reversed(self.created):
            proc = _ip("netns", "del", name, check=False)
            if proc.returncode != 0:
                from ..metrics import say  # here only: it imports numpy, and every rank starts through this module

                said = proc.stderr.strip() or f"exit status {proc.returncode}"
                say(f"[bench] network namespace {name} was not removed ({said}): ip netns del {name}")
        self.created.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        raise Terminated(signum)  # as Ctrl-C: the launcher ends the job and says so, __exit__ tidies up

    def __enter__(self) -> ShapedNetwork:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self.build()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._old_handlers.clear()


def _exec_in_namespace(command: list[str]) -> None:
    prefix = os.environ.get("PSGRAD_NETNS_PREFIX")
    rank = os.environ.get("PMI_RANK")
    if not prefix or rank is None:
        sys.exit("psgrad.bench.netshape exec: run by 'psgrad bench --bandwidth' under MPICH's mpiexec (PMI_RANK unset)")
    os.execvp("ip", ["ip", "netns", "exec", f"{prefix}-r{rank}", *command])


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "exec":
        sys.exit("usage: python -m psgrad.bench.netshape exec COMMAND...")
    _exec_in_namespace(sys.argv[2:])
