"""launch/mpirun.sh: MPI detection, hostfile translation, ranks per node and server placement."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import mpiexec, run_bounded

SCRIPT = Path(__file__).parent.parent / "launch" / "mpirun.sh"
FOUR_GPU_NODES = "# four nodes, four GPUs each, in both syntaxes\ngpu0 slots=4\ngpu1 slots=4\ngpu2:4\ngpu3\n"


def _launch(*args: str, launcher: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return run_bounded(["bash", str(SCRIPT), *args], timeout, {"MPIEXEC": launcher or mpiexec()})


def _fake_mpiexec(tmp_path: Path, banner: str) -> str:
    """A launcher that only answers --version like the MPI named (Open MPI is not installed here)."""
    fake = tmp_path / "mpiexec"
    fake.write_text(f"#!/bin/sh\necho '{banner}'\n")
    fake.chmod(0o755)
    return str(fake)


def test_dry_run_four_nodes_of_four_gpus_with_mpich(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text(FOUR_GPU_NODES)
    out = _launch("--dry-run", "--ranks-per-node", "4", str(hosts), "16", "psgrad", "train", "--device", "cuda")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("# hydra hostfile")
    assert lines[1:5] == ["#   gpu0:4", "#   gpu1:4", "#   gpu2:4", "#   gpu3:4"]
    assert " -n 16 " in lines[5] and " -ppn 4 " in lines[5] and lines[5].rstrip().endswith("train --device cuda")


def test_the_hostfiles_slots_are_honoured_without_ranks_per_node(tmp_path):
    """ "node0 slots=2" means two ranks there unless --ranks-per-node says otherwise; the dry run's
    hostfile outlives it, since the command it prints names it."""
    hosts = tmp_path / "hosts"
    hosts.write_text("gpu0 slots=2\ngpu1:3\ngpu2\n")
    out = _launch("--dry-run", str(hosts), "6", "psgrad", "train")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1:4] == ["#   gpu0:2", "#   gpu1:3", "#   gpu2:1"] and "-ppn" not in lines[4]
    translated = lines[0].split()[3]
    assert Path(translated).read_text() == "gpu0:2\ngpu1:3\ngpu2:1\n"
    Path(translated).unlink()
    too_many = _launch("--dry-run", str(hosts), "7", "x")
    assert too_many.returncode == 2 and "6 slots (the hostfile's slot counts" in too_many.stderr
    replaced = _launch("--dry-run", "--ranks-per-node", "1", str(hosts), "4", "x")
    assert replaced.returncode == 2 and "--ranks-per-node 1 replaces the hostfile's slot counts" in replaced.stderr
    fake = _fake_mpiexec(tmp_path, "mpiexec (Open MPI) 5.0.3")
    openmpi = _launch("--dry-run", str(hosts), "6", "x", launcher=fake)
    assert "#   gpu1 slots=3" in openmpi.stdout and "--map-by slot" in openmpi.stdout


@pytest.mark.parametrize("banner", ["mpiexec (OpenRTE) 4.1.5", "mpiexec (Open MPI) 5.0.3"])
def test_dry_run_translates_to_open_mpi(tmp_path, banner):
    hosts = tmp_path / "hosts"
    hosts.write_text(FOUR_GPU_NODES)
    fake = _fake_mpiexec(tmp_path, banner)
    out = _launch("--dry-run", "--ranks-per-node", "4", str(hosts), "16", "psgrad", "train", launcher=fake)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("# openmpi hostfile")
    assert lines[1:5] == ["#   gpu0 slots=4", "#   gpu1 slots=4", "#   gpu2 slots=4", "#   gpu3 slots=4"]
    assert "--map-by ppr:4:node" in lines[5] and "--hostfile" in lines[5] and "-x OMP_NUM_THREADS=1" in lines[5]
    own = _launch("--dry-run", "--ranks-per-node", "4", "--server-node", "own", str(hosts), "13", "x", launcher=fake)
    assert own.stdout.splitlines()[1] == "#   gpu0 slots=1" and "--map-by slot" in own.stdout


def test_server_on_its_own_node_with_mpich(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text(FOUR_GPU_NODES)
    out = _launch("--dry-run", "--ranks-per-node", "4", "--server-node", "own", str(hosts), "13", "psgrad", "train")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1:3] == ["#   gpu0:1", "#   gpu1:4"] and "-ppn" not in out.stdout


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--ranks-per-node", "4", "HOSTS", "17", "x"], "17 ranks do not fit"),
        (["--ranks-per-node", "0", "HOSTS", "4", "x"], "--ranks-per-node must be a positive integer"),
        (["--server-node", "gpu", "HOSTS", "4", "x"], "--server-node must be shared or own"),
        (["/nonexistent/hosts", "4", "x"], "cannot read hostfile"),
        (["--bogus", "HOSTS", "4", "x"], "unknown option --bogus"),
    ],
)
def test_bad_launches_say_why(tmp_path, args, fragment):
    hosts = tmp_path / "hosts"
    hosts.write_text(FOUR_GPU_NODES)
    out = _launch("--dry-run", *[str(hosts) if a == "HOSTS" else a for a in args])
    assert out.returncode == 2 and fragment in out.stderr, out.stderr


@pytest.mark.parametrize("line", ["node0 slots=x", "node0 slots=", "node0 slots=0", "node0:", "node0:two"])
def test_a_slot_count_that_is_no_count_is_refused(tmp_path, line):
    """A slot count that is not a positive number, in either syntax, is an error naming the node;
    "slots=x" and an empty count used to be taken as no count (one rank on the node)."""
    hosts = tmp_path / "hosts"
    hosts.write_text(f"{line}\nnode1 slots=2\n")
    out = _launch("--dry-run", str(hosts), "2", "x")
    assert out.returncode == 2 and "bad slot count" in out.stderr and "for node0" in out.stderr, out.stderr


def test_unknown_mpi_is_refused(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("node0\n")
    out = _launch("--dry-run", str(hosts), "1", "x", launcher=_fake_mpiexec(tmp_path, "some other launcher 1.0"))
    assert out.returncode == 2 and "cannot tell which MPI" in out.stderr


@pytest.mark.parametrize("syntax", ["localhost slots=3\n", "localhost:3\n"])
def test_launch_on_localhost_with_either_hostfile_syntax(tmp_path, syntax):
    """A real job through pip MPICH: three ranks see a world of three."""
    hosts = tmp_path / "hosts"
    hosts.write_text(syntax)
    probe = "from mpi4py import MPI; c = MPI.COMM_WORLD; print(f'rank {c.rank} of {c.size}')"
    out = _launch("--ranks-per-node", "3", str(hosts), "3", sys.executable, "-c", probe)
    assert out.returncode == 0, out.stderr
    # mpiexec forwards the ranks' output in pieces, not whole lines: match the reports, not lines
    assert sorted(re.findall(r"rank (\d) of (\d)", out.stdout)) == [("0", "3"), ("1", "3"), ("2", "3")], out.stdout


def test_training_job_through_the_launch_script(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=3\n")
    train = [sys.executable, "-m", "psgrad", "train", "--model", "mlp", "--steps", "3", "--no-progress"]
    out = _launch("--ranks-per-node", "3", str(hosts), "3", *train, timeout=240)
    assert out.returncode == 0, out.stderr
    assert "test accuracy" in out.stderr, out.stderr[-2000:]


def test_launch_scripts_parse():
    for script in sorted(SCRIPT.parent.glob("*.sh")) + [SCRIPT.parent / "slurm.sbatch"]:
        check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert check.returncode == 0, f"{script.name}: {check.stderr}"
    sbatch = (SCRIPT.parent / "slurm.sbatch").read_text()
    assert "#SBATCH --gpus-per-node=1" in sbatch and "--device cuda" in sbatch and "--checkpoint-every-steps" in sbatch


def test_workers_count_gpus_among_workers_only():
    """On one node: the server (rank 0) takes no GPU index, so the workers take cuda:0 and cuda:1."""
    from conftest import run_mpi

    probe = (
        "from psgrad.comm.transport import Transport; t = Transport(); "
        "print(f'rank {t.rank} index {t.local_rank(group=int(t.rank > 0))}', flush=True)"
    )
    out = run_mpi([sys.executable, "-c", probe], n=3, timeout=60)
    assert out.returncode == 0, out.stderr
    assert sorted(re.findall(r"rank (\d) index (\d)", out.stdout)) == [("0", "0"), ("1", "0"), ("2", "1")], out.stdout


def _fake_venv(tmp_path: Path, *, has_torch: bool) -> tuple[Path, Path]:
    """A venv whose python logs its ``-m`` calls (to the returned log) and runs nothing of them,
    answers setup.sh's final check, and finds torch or not."""
    venv, log = tmp_path / "venv", tmp_path / "calls"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "python"
    no_torch = "*find_spec*) exit 1;; " if not has_torch else ""
    fake.write_text(
        "#!/bin/sh\n"
        f'[ "$1" = "-m" ] && {{ echo "$*" >> "{log}"; exit 0; }}\n'
        f'case "$2" in {no_torch}*kernels_name*) echo "torch 0 | fake MPI | fake codec kernels"; exit 0;; esac\n'
        f'exec "{sys.executable}" "$@"\n'
    )
    fake.chmod(0o755)
    return venv, log


def test_setup_runs_pip_only_when_the_install_would_change(tmp_path):
    """launch/setup.sh again is quick: pip runs on the first call and when more extras are asked
    for, not when nothing it installs from changed; psgrad's byte-code is brought up to date every
    time (a venv whose python only logs its ``-m`` calls)."""
    venv, log = _fake_venv(tmp_path, has_torch=True)
    setup = Path(__file__).parent.parent / "launch" / "setup.sh"

    def pip_calls(*args: str) -> list[str]:
        log.write_text("")
        done = run_bounded(["bash", str(setup), *args], 60, {"PSGRAD_VENV": str(venv)})
        assert done.returncode == 0 and "[setup] ready" in done.stdout, done.stdout + done.stderr
        calls = log.read_text().splitlines()
        assert any(call.startswith("-m compileall") for call in calls), calls  # psgrad's byte-code, every time
        return [call for call in calls if call.startswith("-m pip")]

    first = pip_calls()
    assert len(first) == 1 and first[0].endswith("-e .[plot,mpich]"), first
    assert pip_calls() == []
    assert pip_calls("test")[0].endswith("-e .[plot,mpich,test]")
    assert pip_calls() == [] and pip_calls("test") == []
    (venv / ".psgrad-installed").write_text("/elsewhere 0\nplot\nmpich\ntest\n")  # another checkout's
    assert len(pip_calls()) == 1


def test_setup_takes_torch_from_the_index_asked_for(tmp_path):
    """PSGRAD_TORCH_INDEX picks torch's build (PyPI's Linux wheel bundles CUDA); a venv without
    torch gets it first, pinned (a venv whose python logs its ``-m`` calls and has no torch)."""
    venv, log = _fake_venv(tmp_path, has_torch=False)
    setup = Path(__file__).parent.parent / "launch" / "setup.sh"
    url = "https://download.pytorch.org/whl/cpu"
    done = run_bounded(["bash", str(setup)], 60, {"PSGRAD_VENV": str(venv), "PSGRAD_TORCH_INDEX": url})
    assert done.returncode == 0, done.stdout + done.stderr
    torch_call = [call for call in log.read_text().splitlines() if "torch==" in call]
    assert torch_call and torch_call[0].endswith(f"--index-url {url} torch==2.13.0"), torch_call
