import importlib.util
import re
from pathlib import Path

import click
import pytest

from psgrad.cli import main

DOCS = Path(__file__).parent.parent / "docs"


def test_every_cli_option_has_help_and_a_line_in_docs():
    text = (DOCS / "cli.md").read_text()
    assert "Sentinel" not in text  # click's marker for "no default" is not a default a user can read
    for name, cmd in main.commands.items():
        assert cmd.help, name
        for param in cmd.params:
            if isinstance(param, click.Option):
                assert param.help, f"{name} {param.opts}"
                assert f"`{' / '.join(param.opts + param.secondary_opts)}`" in text, (
                    f"{name} {param.opts} missing from docs/cli.md"
                )


def test_training_help_is_grouped_into_sections():
    """Every training option belongs to a section, and --help lists the sections in order."""
    from click.testing import CliRunner

    from psgrad.options import SECTIONS, section_of

    assert all(section_of(param) in SECTIONS for param in main.commands["train"].params if param.name != "help")
    help_text = CliRunner().invoke(main, ["train", "--help"]).output
    positions = [help_text.index(f"\n{title}:\n") for title in SECTIONS]
    assert positions == sorted(positions)
    assert help_text.index("--accumulate") > help_text.index("Optimizer and training:")
    assert "Only --model wrn" in help_text


def test_cli_reference_is_current():
    from psgrad.clidoc import markdown

    assert (DOCS / "cli.md").read_text() == markdown(), "docs/cli.md is stale: python -m psgrad.clidoc > docs/cli.md"
    # an option given more than once shows its default values, not a Python tuple ("('none',)")
    defaults = [row.split(" | ")[1] for row in markdown().splitlines() if row.startswith("| `-")]
    assert defaults and not [d for d in defaults if d.startswith(("(", "["))], defaults


def test_every_codec_has_a_budget_line():
    from psgrad.codecs import available_codecs

    text = (DOCS / "codecs.md").read_text()
    for name in available_codecs():
        assert f"`{name}" in text, name


def test_top_level_help_gives_whole_descriptions():
    from click.testing import CliRunner

    out = " ".join(CliRunner().invoke(main, ["--help"]).output.split())
    for name, cmd in main.commands.items():
        first = " ".join(cmd.help.split("\n\n")[0].split())
        assert first in out, f"{name}: {first!r} cut in psgrad --help"


def test_bench_refuses_the_run_options_it_would_ignore():
    from click.testing import CliRunner

    for args in (["--checkpoint-every-steps", "5"], ["--resume", "."], ["--tensorboard"]):
        result = CliRunner().invoke(main, ["bench", "--steps", "2", *args])
        assert result.exit_code == 2 and "psgrad bench does not use" in result.output, (args, result.output)


def test_no_command_has_an_option_twice():
    for name, cmd in main.commands.items():
        flags = [
            flag for param in cmd.params for flag in getattr(param, "opts", []) + getattr(param, "secondary_opts", [])
        ]
        assert len(flags) == len(set(flags)), f"{name}: {sorted(f for f in flags if flags.count(f) > 1)}"


def test_api_example_runs_as_written(tmp_path):
    """docs/api.md's script of psgrad's own loop, copied out of the page, trains under mpiexec -n 3
    and learns."""
    import re
    import sys

    from conftest import run_mpi

    script = re.findall(r"```python\n(.*?)```", (DOCS / "api.md").read_text(), re.S)[3]  # psgrad's own loop
    path = tmp_path / "my_train.py"
    path.write_text(script)
    out = run_mpi([sys.executable, str(path)], n=3, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    accuracy = float(re.search(r"final test accuracy ([0-9.]+)", out.stdout).group(1))
    assert accuracy > 0.3, out.stdout  # 10 classes: chance is 0.1


def _own_loop_scripts() -> tuple[str, str]:
    """docs/api.md's plain torch script and the same script under psgrad."""
    import re

    plain, ours = re.findall(r"```python\n(.*?)```", (DOCS / "api.md").read_text(), re.S)[:2]
    return plain, ours


def test_ddp_hook_example_runs_under_torchrun(tmp_path):
    """docs/api.md's DDP script, as written, on two processes started by torchrun (no MPI): it
    learns, and each rank saves the hook's memories with its checkpoint."""
    import re
    import sys

    import torch
    from conftest import run_bounded

    script = re.findall(r"```python\n(.*?)```", (DOCS / "api.md").read_text(), re.S)[2]
    assert script.startswith("# ddp_train.py")
    (tmp_path / "ddp_train.py").write_text(script)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "ddp_train.py"]
    out = run_bounded(command, timeout=180, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"epoch \d loss ([0-9.]+)", out.stdout)]
    assert len(losses) == 3 and losses[-1] < 1.0, out.stdout  # 10 classes: chance is 2.3
    for rank in (0, 1):
        saved = torch.load(tmp_path / f"ckpt{rank}.pt", weights_only=True)
        assert int(saved["hook"]["step"]) == 3 * 32 and len(saved["hook"]) > 1, saved["hook"].keys()


def test_your_own_loop_gains_at_most_six_lines():
    """The page's claim, counted: lines added to the plain script (its first line, the command
    to run it, aside); the changed lines are counted apart."""
    import difflib

    plain, ours = (script.splitlines()[1:] for script in _own_loop_scripts())
    ops = difflib.SequenceMatcher(a=plain, b=ours, autojunk=False).get_opcodes()
    added = sum(j2 - j1 for op, i1, i2, j1, j2 in ops if op == "insert")
    added += sum(max(0, (j2 - j1) - (i2 - i1)) for op, i1, i2, j1, j2 in ops if op == "replace")
    assert added <= 6, ops
    assert "four lines are added" in (DOCS / "api.md").read_text().lower() and added == 4


@pytest.mark.parametrize("topology, ranks", [("colocated", 2), ("ps", 3)])
def test_your_own_loop_runs_as_written(tmp_path, topology, ranks):
    """The plain script runs with python, the psgrad one under mpiexec with either topology: every
    worker finishes its epochs and saves a checkpoint that loads with weights_only=True."""
    import sys

    import torch
    from conftest import run_bounded, run_mpi

    plain, ours = _own_loop_scripts()
    if topology == "colocated":  # the plain script once is enough
        (tmp_path / "plain.py").write_text(plain)
        out = run_bounded(
            [sys.executable, "-c", f"import os; os.chdir({str(tmp_path)!r}); exec(open('plain.py').read())"], 180
        )
        assert out.returncode == 0 and "epoch 2: loss" in out.stdout, out.stderr[-2000:]
    assert 'topology="colocated"' in ours
    (tmp_path / "train.py").write_text(ours.replace('topology="colocated"', f'topology="{topology}"'))
    out = run_mpi(
        [sys.executable, "-c", f"import os; os.chdir({str(tmp_path)!r}); exec(open('train.py').read())"],
        n=ranks,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("epoch 2: loss") == 2, out.stdout  # two workers either way
    workers = [0, 1] if topology == "colocated" else [1, 2]  # rank 0 serves under ps
    for rank in workers:
        state = torch.load(tmp_path / f"ckpt-{rank}.pt", weights_only=True)
        assert {"model", "opt", "sched"} <= set(state) and "psgrad" in state["opt"]


README = DOCS.parent / "README.md"


def _documented_commands():
    """(file, command) for every shell command in the README's and docs' bash/console blocks:
    continuation lines joined, prompts and trailing comments dropped, '&&' chains split."""
    import re

    for path in [README, *sorted(DOCS.glob("*.md"))]:
        for kind, body in re.findall(r"```(bash|console)\n(.*?)```", path.read_text(), re.S):
            text = re.sub(r"\\\n\s*", " ", body)
            for line in text.splitlines():
                if kind == "console":
                    if not line.startswith("$ "):
                        continue  # output
                    line = line[2:]
                line = re.split(r"\s{2,}#\s", line)[0].strip()
                if line and not line.startswith("#"):
                    yield from ((path.name, part.strip()) for part in line.split("&&"))


def test_documented_psgrad_commands_parse_as_written():
    """Every psgrad command in a bash or console block of README.md and docs/ names a real
    command and options with valid values (sketches with '...' are checked up to the dots)."""
    import shlex

    checked = 0
    for name, command in _documented_commands():
        words = shlex.split(command.replace("…", "...").split("...")[0], comments=True)
        starts = [i for i, w in enumerate(words) if w == "psgrad" or w.endswith("/psgrad")]
        if not starts or len(words) <= starts[0] + 1:
            continue
        sub, args = words[starts[0] + 1], words[starts[0] + 2 :]
        args = args[: args.index(":")] if ":" in args else args  # the first part of an MPMD launch
        assert sub in main.commands, f"{name}: unknown command in {command!r}"
        try:
            main.commands[sub].make_context(sub, list(args), resilient_parsing=False)
        except click.exceptions.Exit as done:  # an eager flag that answers and exits (--list)
            assert done.exit_code == 0, f"{name}: {command!r} exits {done.exit_code}"
        except click.BadParameter as err:
            assert "does not exist" in str(err), f"{name}: {command!r}: {err}"
        except click.UsageError as err:
            raise AssertionError(f"{name}: {command!r}: {err}") from None
        checked += 1
    assert checked >= 15, checked


def test_launch_scripts_named_in_the_docs_exist():
    import re

    for name, command in _documented_commands():
        for script in re.findall(r"launch/[\w.-]+", command):
            assert (DOCS.parent / script).is_file(), f"{name}: {command!r} names a missing {script}"


def test_readme_first_command_trains_as_written(tmp_path):
    """The README's first line, past its setup step, with this checkout's venv: the main job."""
    import sys

    from conftest import run_bounded

    first = next(command for name, command in _documented_commands() if "psgrad train" in command)
    bin_dir = Path(sys.executable).parent
    words = [str(bin_dir / w.removeprefix(".venv/bin/")) if w.startswith(".venv/bin/") else w for w in first.split()]
    out = run_bounded(words, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "test accuracy" in out.stderr and "[synthetic]" in out.stderr, out.stderr[-2000:]


def test_python_snippets_run_as_written(tmp_path):
    """Every python block of README.md and docs/ runs (docs/api.md's is an MPI script: the test
    above runs it under mpiexec); pseudo-code is fenced as text, not python."""
    import re
    import sys

    from conftest import run_bounded

    for path in [README, *sorted(DOCS.glob("*.md"))]:
        if path.name == "api.md":
            continue
        for index, block in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), re.S)):
            script = tmp_path / f"{path.stem}_{index}.py"
            script.write_text(block)
            out = run_bounded([sys.executable, str(script)], timeout=120)
            assert out.returncode == 0, f"{path.name} python block {index}: {out.stderr[-2000:]}"


ROOT = DOCS.parent
# what the product's text may not say of itself: the history lives in git
_HISTORY = re.compile(r"\bsessions?\b(?! *=)|\bissue #?\d+|\bissues? #\d+|#\d+\b(?!\])|\bitem \d+\b", re.IGNORECASE)
_DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b")
BENCHMARKS_BUDGET = 430


def _product_text() -> list[Path]:
    """README, docs/, launch/ and the package's source: where the product speaks of itself."""
    files = [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *sorted((ROOT / "launch").iterdir())]
    files += sorted((ROOT / "psgrad").rglob("*.py"))
    return [f for f in files if f.is_file() and f.suffix in (".md", ".py", ".sh", ".sbatch", "")]


def test_the_product_names_no_session_issue_item_or_date():
    """docs/, the README, launch/ and the source say what psgrad does and how it was measured,
    never which session or issue did it, nor a dated running log."""
    found = []
    for path in _product_text():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            text = line.replace("start_new_session", "")  # subprocess's keyword, not a work session
            for pattern in (_HISTORY, _DATED):
                if pattern.search(text):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not found, "\n".join(found)


def test_benchmarks_is_a_results_page_within_its_budget():
    lines = (DOCS / "benchmarks.md").read_text().splitlines()
    assert len(lines) <= BENCHMARKS_BUDGET, (
        f"docs/benchmarks.md has {len(lines)} lines, over its budget of {BENCHMARKS_BUDGET}: replace superseded "
        "figures instead of adding below them (git keeps the history)"
    )


def test_every_docs_section_reference_names_a_heading_that_exists():
    """`docs/benchmarks.md, "Which codec learns"` in the docs, the README or the source must name a
    heading of that page, so a renamed section cannot leave a dangling pointer."""
    reference = re.compile(r"docs/([a-z_]+\.md),\s+\"([^\"]+)\"")
    headings = {
        path.name: [line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#")]
        for path in DOCS.glob("*.md")
    }
    dangling = []
    for path in [*_product_text(), *sorted((ROOT / "benchmarks").iterdir())]:
        if not path.is_file():
            continue
        for page, title in reference.findall(path.read_text(errors="replace").replace("\n", " ")):
            title = title.replace("\\'", "'")
            if not any(h.startswith(title) for h in headings.get(page, [])):
                dangling.append(f"{path.relative_to(ROOT)}: {page}, {title!r}")
    assert not dangling, "\n".join(dangling)


def test_the_package_meets_the_shape_targets_architecture_md_names():
    """benchmarks/structure.py's lists (docs/architecture.md, "Structure, measured") are empty:
    a long module or function, a wide positional signature, a topology tested by name outside
    roles/, or an engine that names the simulation fails here, not in a later review."""
    spec = importlib.util.spec_from_file_location("structure", ROOT / "benchmarks" / "structure.py")
    structure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(structure)
    found = structure.measure(ROOT / "psgrad")
    assert not any(found.values()), {title: rows for title, rows in found.items() if rows}
