"""psgrad keeps freed memory in its processes (psgrad/allocator.py), unless the user chose otherwise."""

from __future__ import annotations

import os
import platform
import sys

import pytest
from conftest import run_bounded

from psgrad.runtime.allocator import user_choice

# A step's activation, allocated, touched and freed again and again; prints the page faults of the
# last rounds (the first ones fault the heap in once, tuned or not). 40 MiB is above the most that
# glibc's own threshold rises to (32 MiB), so by default every round maps it fresh.
_STEPS = """
import resource, torch
from psgrad.runtime.allocator import keep_freed_memory
print(keep_freed_memory())
for round in range(30):
    if round == 10:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    activation = torch.ones(10 << 20)
    del activation
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(extra_env: dict[str, str]) -> tuple[str, int]:
    unset = {k: None for k in os.environ if k.startswith("MALLOC_") or k in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    done = run_bounded([sys.executable, "-c", _STEPS], 120, env={**unset, **extra_env})
    assert done.returncode == 0, done.stderr
    state, faults = done.stdout.strip().splitlines()
    return state, int(faults)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_buffers_are_reused_instead_of_faulted_in_every_step():
    kept_state, kept = _faults({})
    system_state, system = _faults({"PSGRAD_MALLOC": "system"})
    assert kept_state == "freed memory is kept"
    assert system_state == "left as it is: PSGRAD_MALLOC=system"
    # 20 rounds of 40 MiB fault in 800 MiB afresh with the defaults: 204,800 faults of 4 KiB pages,
    # fewer where the kernel faults anonymous memory in larger folios (a 6.18 kernel with 16 KiB
    # ones "always": 52,480). At least one fault per 2 MiB (the largest folio) every round:
    assert system >= 20 * (40 << 20) // (2 << 20), system
    assert kept < system / 20, (kept, system)


@pytest.mark.parametrize(
    "environ, reason",
    [
        ({}, None),
        ({"PSGRAD_MALLOC": "keep"}, None),
        ({"PSGRAD_MALLOC": "system"}, "PSGRAD_MALLOC=system"),
        ({"MALLOC_ARENA_MAX": "2", "MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_ is set"),
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "GLIBC_TUNABLES is set"),
        ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "LD_PRELOAD is set"),
    ],
)
def test_the_users_own_allocator_settings_win(environ, reason):
    assert user_choice(environ) == reason


def test_a_misspelt_setting_warns_and_keeps():
    with pytest.warns(UserWarning, match="PSGRAD_MALLOC must be keep or system, got 'sytem'"):
        assert user_choice({"PSGRAD_MALLOC": "sytem"}) is None


def test_the_library_leaves_the_allocator_alone(monkeypatch):
    """simulate() (train.run too) called from Python does not touch the process's allocator:
    tuning it is the caller's choice (the psgrad command makes it for its own process)."""
    import psgrad.runtime.allocator as allocator
    from psgrad.config import RunConfig
    from psgrad.sim.simulate import simulate

    monkeypatch.setattr(allocator, "_state", None)
    simulate(RunConfig(model="convnet", batch_size=8, steps=1, progress=False, eval_every_epochs=0, timeout=60), 1)
    assert allocator._state is None


_COMMAND_RUN = """
from click.testing import CliRunner
import psgrad.runtime.allocator as allocator
from psgrad.cli import main
done = CliRunner().invoke(main, ["simulate", "--workers", "2", "--model", "mlp", "--steps", "2", "--batch-size", "8",
                                 "--synthetic-size", "64", "--no-progress"])
assert done.exit_code == 0, done.output
print(allocator._state)
"""


def test_every_training_command_tunes_its_process():
    done = run_bounded([sys.executable, "-c", _COMMAND_RUN], 300, env={"PSGRAD_MALLOC": "system"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "left as it is: PSGRAD_MALLOC=system"
