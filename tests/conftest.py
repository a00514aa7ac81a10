import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    return torch.device(request.param)


import csv  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

SCRIPTS = Path(__file__).parent / "mpi_scripts"


def mpiexec() -> str:
    """The mpiexec beside this Python (pip MPICH) or on PATH (system MPI)."""
    local = Path(sys.executable).parent / "mpiexec"
    found = str(local) if local.exists() else shutil.which("mpiexec")
    if not found:
        pytest.skip("no mpiexec found (bash launch/setup.sh installs MPICH)")
    return found


def run_bounded(
    cmd: list[str], timeout: float, env: dict | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Run ``cmd`` (in ``cwd``) with its output captured and no stdin; a hang fails the test at
    ``timeout`` instead of stalling CI. ``env`` is added to this process's environment (None
    values remove)."""
    try:
        return subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=_environment(env),
            stdin=subprocess.DEVNULL,
            cwd=cwd,
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{' '.join(cmd)} hung for {timeout}s\n{err.stdout}\n{err.stderr}")


def _environment(env: dict | None) -> dict:
    """This process's environment, one torch thread, and ``env`` added (None values remove)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return {key: value for key, value in full_env.items() if value is not None}


def interrupt_when(
    cmd: list[str],
    ready,
    err_file: Path,
    timeout: float = 180,
    env: dict | None = None,
    sig: int = signal.SIGINT,
    group: bool = True,
    target=None,
) -> subprocess.CompletedProcess:
    """Start ``cmd`` in a process group of its own, poll ``ready(stderr so far)`` until it holds,
    then send ``sig`` to the whole group (SIGINT: what Ctrl-C in a terminal does), with ``group``
    False to ``cmd``'s process alone (``kill PID``), or to the process ``target(stderr so far)``
    names (one rank; or the processes, a list), and wait for the end; a command that never gets ready or never ends fails
    the test at ``timeout``. Standard error goes through ``err_file`` so it can be read while the
    command runs."""
    import time

    with open(err_file, "w") as err:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True, env=_environment(env),
            start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + timeout
    try:
        while not ready(err_file.read_text()):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{' '.join(cmd)} ended or hung before it was ready:\n{err_file.read_text()[-3000:]}")
            time.sleep(0.1)
        segments = mpi_segments(descendants(proc.pid))
        if target is not None:
            targets = target(err_file.read_text())
            for pid in [targets] if isinstance(targets, int) else targets:
                os.kill(pid, sig)
        elif group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(cmd)} did not end after signal {sig}:\n{err_file.read_text()[-3000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert_removed(segments)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err_file.read_text())


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (hydra's proxy starts a session of its own)."""
    table = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout.split()
    children: dict[int, list[int]] = {}
    for child, parent in zip(table[::2], table[1::2], strict=True):
        children.setdefault(int(parent), []).append(int(child))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def mpi_segments(pids) -> set[str]:
    """The MPI library's shared-memory files that ``pids`` map (psgrad/comm/segments.py)."""
    from psgrad.runtime.segments import job_segments

    return {path for pid in pids for path in job_segments(f"/proc/{pid}/maps")}


def assert_removed(segments: set[str], seconds: float = 5.0) -> None:
    """A job that ended without MPI_Finalize must not leave its segments in /dev/shm (RAM, until
    the machine reboots): its ranks, or their sentinels, remove them."""
    import time

    deadline = time.monotonic() + seconds
    while any(os.path.exists(path) for path in segments) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = sorted(path for path in segments if os.path.exists(path))
    assert not left, f"the job left its MPI shared memory behind: {left}"


def run_mpi(args: list[str], n: int = 3, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``args`` under ``mpiexec -n n`` (see run_bounded)."""
    return run_bounded([mpiexec(), "-n", str(n), *args], timeout, env)


def run_script(
    name: str, *args: str, n: int = 3, timeout: float = 240, env: dict | None = None
) -> subprocess.CompletedProcess:
    return run_mpi([sys.executable, str(SCRIPTS / name), *args], n=n, timeout=timeout, env=env)


def train_runs(root: Path, runs: dict[str, list[str]], n: int = 3, timeout: float = 400) -> subprocess.CompletedProcess:
    """Every ``name: options`` of ``psgrad train`` in one mpiexec job, one after another
    (mpi_scripts/train_runs.py: the ranks start once), each logging to ``root / name``."""
    args = [arg for name, options in runs.items() for arg in [*options, "--log-dir", str(root / name), "--"]]
    return run_script("train_runs.py", *args, n=n, timeout=timeout)


def metrics_rows(log_dir: Path) -> list[dict]:
    """A run's metrics.csv, one dict of strings a row."""
    with open(log_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def run_local_ranks(world, body) -> list:
    """Run ``body(rank)`` for every rank of the simulated ``world`` (sim/world.py), each in a thread
    of its own, as ``psgrad simulate`` does: a rank that raises fails the world. Returns each rank's
    result or exception; a rank still running after a minute fails the test."""
    import threading

    out: list = [None] * world.size

    def play(rank: int) -> None:
        try:
            out[rank] = body(rank)
        except Exception as err:  # noqa: BLE001 -- inspected by the test
            out[rank] = err
            world.fail(f"rank {rank}: {err}")
        finally:
            world.finished(rank)

    threads = [threading.Thread(target=play, args=(r,)) for r in range(world.size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive(), "a local rank hangs"
    return out


@pytest.fixture(autouse=True)
def mpi_stays_initialized(request):
    """A test that finalizes MPI in the test process (say, through the CLI's end of a job) ends the
    run here, by name and with pytest's summary: the next test's MPI call would otherwise end the
    process with neither."""
    yield
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_finalized():
        request.session.shouldstop = f"{request.node.nodeid} finalized MPI: no later test can use it"
        pytest.fail("this test finalized MPI in the test process")
