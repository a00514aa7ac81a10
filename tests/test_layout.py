"""The package's floors: imports only go down, roles never import each other, MPI stays in transport."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import psgrad
from psgrad.codecs import make_codec
from psgrad.config import RunConfig
from psgrad.context import RunContext
from psgrad.feedback import DGCMemory

ROOT = Path(psgrad.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every psgrad module (and mpi4py) this file imports, lazy imports inside functions included."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # "from . import wire" imports a module; "from .codecs import make_codec" the package
            for alias in node.names:
                found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in KNOWN_FILES else module)
    return {m for m in found if m.startswith("psgrad") or m.startswith("mpi4py")}


KNOWN_FILES = {_module_name(p) for p in ROOT.rglob("*.py")}
MODULES = {_module_name(p): _imports(p) for p in ROOT.rglob("*.py")}
KNOWN = set(MODULES)


def _internal(name: str) -> set[str]:
    return {m for m in MODULES[name] if m in KNOWN and m != name}


ROLE_ENGINES = {"psgrad.engine.ps", "psgrad.engine.colocated", "psgrad.engine.alltoall", "psgrad.engine.gossip"}

# (floor, module prefixes): a module may import only from its own floor or below
FLOORS = [
    (
        0,
        [
            "psgrad.codecs",
            "psgrad.models",
            "psgrad.data",
            "psgrad.runtime.allocator",
            "psgrad.memory",
            "psgrad.choices",
            "psgrad.settings",
            "psgrad.comm.layout",
            "psgrad.comm.waiting",
            "psgrad.comm.channel",
            "psgrad.sim",
            "psgrad.sim.stacked_layers",
            "psgrad.runtime.segments",
            "psgrad.runtime.chain",
            "psgrad.runtime.exits",
            "psgrad.devices",
            "psgrad.inorder",
        ],
    ),
    (1, ["psgrad.feedback", "psgrad.comm.wire", "psgrad.comm.envelope", "psgrad.roles"]),
    (2, ["psgrad.comm.protocol", "psgrad.config", "psgrad.optim", "psgrad.metrics", "psgrad.comm.transport"]),
    (2, ["psgrad.runlogs"]),
    (2, ["psgrad.sim.local", "psgrad.sim.world", "psgrad.accuracy"]),
    (3, ["psgrad.backprop", "psgrad.sim.stacked"]),
    (1, ["psgrad.runtime.sentinel", "psgrad.runtime.signals", "psgrad.runtime"]),
    (2, ["psgrad.checkpoint", "psgrad.runtime.watchdog", "psgrad.agreement"]),
    (3, ["psgrad.evaluation", "psgrad.checkpointing", "psgrad.runtime.restarts", "psgrad.stopsaving"]),
    (3, ["psgrad.shards", "psgrad.ddpcomm"]),
    (3, ["psgrad.context", "psgrad.startup"]),
    (4, ["psgrad.engine", "psgrad.ddpstop"]),
    (5, sorted(ROLE_ENGINES)),
    (6, ["psgrad.train", "psgrad.sim.simulate", "psgrad.userloop"]),
    (7, ["psgrad.options", "psgrad.plot", "psgrad.runtable", "psgrad.plan"]),
    (8, ["psgrad.bench"]),
    (9, ["psgrad.cli", "psgrad.clidoc", "psgrad.runtime.job"]),
    (4, ["psgrad.runtime.failure"]),
    (10, ["psgrad.entry", "psgrad.__main__"]),
]


def _floor(name: str) -> int | None:
    best = None
    for floor, prefixes in FLOORS:
        for prefix in prefixes:
            if name == prefix or name.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (floor, len(prefix))
    return best[0] if best else None


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n not in ("psgrad", "psgrad.comm")))
def test_imports_only_go_down(name):
    own = _floor(name)
    assert own is not None, f"{name} is on no floor: add it to FLOORS"
    above = {m for m in _internal(name) if m not in ("psgrad", "psgrad.comm") and _floor(m) > own}
    assert not above, f"{name} (floor {own}) imports from above: {sorted(above)}"


def test_no_import_cycles():
    graph = {name: _internal(name) - {"psgrad", "psgrad.comm"} for name in MODULES}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(path + [node, nxt])}")
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [])


def test_roles_never_import_each_other():
    """Neither the topology declarations (roles/) nor the topologies' role engines import each other."""
    for group in ({n for n in MODULES if n.startswith("psgrad.roles.")}, ROLE_ENGINES):
        assert group <= KNOWN
        for name in group:
            assert not (_internal(name) & group), f"{name} imports another topology's module"


def test_only_transport_imports_mpi():
    """comm/transport.py is the one module that imports mpi4py (and it tells mpi4py not to start
    MPI at import); the simulation's transport implements the same interface without it."""
    users = sorted(n for n, imports in MODULES.items() if any(m.startswith("mpi4py") for m in imports))
    assert users == ["psgrad.comm.transport"]
    for name in ("psgrad.sim.local", "psgrad.sim.world", "psgrad.sim.stacked", "psgrad.sim.stacked_layers"):
        assert "psgrad.comm.transport" not in MODULES[name], f"{name} imports the MPI transport"


def test_feedback_is_built_in_one_place_with_every_dgc_option():
    """Roles get their feedback from the context: the DGC options cannot be dropped by one of them."""
    builders = sorted(
        str(p.relative_to(ROOT))
        for p in [*(ROOT / "roles").glob("*.py"), *(ROOT / "engine").glob("*.py")]
        if re.search(r"(?<!ctx\.)make_feedback\(|ErrorFeedback\(|DGCMemory\(", p.read_text())
    )
    assert builders == [], f"{builders} build feedback themselves; use ctx.make_feedback()"
    cfg = RunConfig(
        codec="topk:ratio=0.01", feedback="dgc", momentum=0.0, dgc_momentum=0.5, nesterov=True,
        dgc_clip_norm=2.0, dgc_warmup_epochs=3,
    )  # fmt: skip
    memory = RunContext.make_feedback(SimpleNamespace(cfg=cfg))
    assert isinstance(memory, DGCMemory)
    assert (memory.momentum, memory.nesterov, memory.clip_norm, memory.warmup_epochs) == (0.5, True, 2.0, 3)
    # receive buffers are sized for the warm-up's densest codec too
    assert {make_codec(spec).params["ratio"] for spec in memory.codec_specs()} == {0.25, 0.01}


def test_the_command_line_offers_every_command_without_importing_torch():
    """``psgrad --help`` and every command's --help run without torch (3-4 s to import here):
    the choices they offer come from psgrad.choices and psgrad.comm.layout."""
    script = """
import contextlib, io, json, sys
from psgrad.cli import main
helped = []
for args in [[]] + [[name] for name in sorted(main.commands)]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main.main(args=args + ["--help"], prog_name="psgrad", standalone_mode=False)
    helped += [" ".join(args)] if out.getvalue().startswith("Usage: psgrad") else []
print(json.dumps({"helped": helped, "torch": "torch" in sys.modules}))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert {"", "train", "simulate", "bench", "codecs"} <= set(seen["helped"])
    assert not seen["torch"], "building the command line imported torch"


def test_the_engines_know_nothing_of_simulation():
    """psgrad simulate's ranks reach the engines through their transport (``shared_pass``): no
    engine and not Backprop names the simulation or its stacked pass."""
    for path in [*(ROOT / "engine").glob("*.py"), ROOT / "backprop.py"]:
        text = path.read_text().lower()
        for word in ("simulat", "stacked", "psgrad.sim"):
            assert word not in text, f"{path.relative_to(ROOT)} mentions {word!r}"
