"""``psgrad compare``: runs ranked by their time to one test accuracy (psgrad/runtable.py)."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from psgrad.cli import main


def _run(folder, *, step_seconds: float, accuracies: dict[int, float], paused: float = 0.0, data="synthetic"):
    """A log dir of ``max(accuracies) + 1`` steps of ``step_seconds`` each, 1000 + 1000 bytes a
    step, evaluated after the steps ``accuracies`` names (each holding training up ``paused`` s)."""
    folder.mkdir(parents=True)
    steps = max(accuracies, default=3) + 1
    lines = ["step,loss,bytes_up,bytes_down,wall"]
    held = 0.0
    for step in range(steps):
        lines.append(f"{step},1.0,1000,1000,{step_seconds * (step + 1) + held}")
        held += paused if step in accuracies else 0.0
    (folder / "metrics.csv").write_text("\n".join(lines) + "\n")
    if accuracies:
        evals = ["epoch,step,test_loss,test_acc,dataset,eval_seconds,paused_seconds"]
        evals += [f"1,{s},1.0,{a},{data},{paused},{paused}" for s, a in sorted(accuracies.items())]
        (folder / "eval.csv").write_text("\n".join(evals) + "\n")
    return folder


def test_runs_are_ranked_by_their_time_to_the_highest_accuracy_every_run_reached(tmp_path):
    """The default target is the lowest of the runs' best accuracies; a run's time to it is the
    wall clock after the step of the first evaluation that reached it, evaluation pauses left out."""
    from psgrad.runtable import common_target, figures, ranked

    slow = _run(tmp_path / "slow", step_seconds=1.0, accuracies={4: 0.5, 9: 0.8})
    quick = _run(tmp_path / "quick", step_seconds=0.5, accuracies={3: 0.6, 7: 0.9}, paused=10.0)
    weak = _run(tmp_path / "weak", step_seconds=0.1, accuracies={9: 0.7})
    blind = _run(tmp_path / "blind", step_seconds=0.1, accuracies={})
    runs = [figures(d) for d in (slow, quick, weak, blind)]
    assert common_target(runs) == 0.7  # weak's best: every evaluated run reached it
    records = ranked(runs, 0.7)
    assert [r["log_dir"] for r in records] == [str(weak), str(quick), str(slow), str(blind)]
    by_name = {r["log_dir"]: r for r in records}
    # quick reached 0.9 at step 7: 4.0 s of training; the 10 s its evaluation after step 3 held it up do not count
    assert by_name[str(quick)]["target_steps"] == 8 and by_name[str(quick)]["target_seconds"] == pytest.approx(4.0)
    assert by_name[str(quick)]["seconds"] == pytest.approx(14.0)  # the whole clock, pause included
    assert by_name[str(quick)]["target_mb"] == pytest.approx(8 * 2000 / 1e6)
    assert by_name[str(slow)]["of_fastest"] == pytest.approx(10.0 / 1.0)
    assert by_name[str(weak)]["of_fastest"] == 1.0 and by_name[str(weak)]["best_acc"] == 0.7
    assert math.isnan(by_name[str(blind)]["target_seconds"]) and math.isnan(by_name[str(blind)]["best_acc"])
    missed = ranked(runs, 0.85)  # only quick gets there; the others keep their order after it
    assert [r["log_dir"] for r in missed] == [str(quick), str(slow), str(weak), str(blind)]
    assert math.isnan(missed[1]["target_steps"]) and missed[0]["of_fastest"] == 1.0


def test_the_command_prints_the_table_its_json_and_what_it_could_not_compare(tmp_path):
    _run(tmp_path / "bench" / "01-r1-none", step_seconds=1.0, accuracies={9: 0.8})
    _run(tmp_path / "bench" / "02-r1-sign", step_seconds=0.5, accuracies={9: 0.75})
    (tmp_path / "bench" / "02-r1-sign" / "row.txt").write_text("sign --feedback ef\n")
    (tmp_path / "bench" / "03-r1-compute").mkdir()
    (tmp_path / "bench" / "03-r1-compute" / "job.log").write_text("")
    done = CliRunner().invoke(main, ["compare", str(tmp_path / "bench")])
    assert done.exit_code == 0, done.output
    lines = done.output.splitlines()
    assert "steps missing" not in done.output, done.output
    assert lines[0].startswith("target: test accuracy 0.750, the highest every evaluated run reached")
    assert lines[2].startswith("sign --feedback ef (02-r1-sign)") and lines[2].endswith("1.00x")
    assert lines[3].startswith("01-r1-none") and lines[3].endswith("2.00x")
    assert "not compared, no steps logged (DDP, compute-only and --api optimizer rows): 03-r1-compute" in done.output
    assert (
        "note: sign --feedback ef (02-r1-sign) set the target, its best accuracy, while 01-r1-none reached 0.800: "
        "this ranks who got to 0.750 first, not who learned most" in done.output
    ), done.output
    done = CliRunner().invoke(main, ["compare", str(tmp_path / "bench"), "--target-accuracy", "0.75"])
    assert done.exit_code == 0 and "set the target" not in done.output, done.output  # a target of the user's own
    done = CliRunner().invoke(main, ["compare", str(tmp_path / "bench"), "--target-accuracy", "0.8", "--json", "-"])
    assert done.exit_code == 0, done.output
    out = json.loads(done.stdout, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert out["target_accuracy"] == 0.8
    labels = [(r["label"], r["target_steps"]) for r in out["runs"]]
    assert labels == [("01-r1-none", 10), ("sign --feedback ef (02-r1-sign)", None)]


def test_runs_scored_on_other_data_or_not_runs_are_said_so(tmp_path):
    _run(tmp_path / "a", step_seconds=1.0, accuracies={3: 0.8})
    _run(tmp_path / "b", step_seconds=1.0, accuracies={3: 0.9}, data="digits")
    done = CliRunner().invoke(main, ["compare", str(tmp_path / "a"), str(tmp_path / "b")])
    assert done.exit_code == 0 and "scored on different data (digits, synthetic)" in done.output, done.output
    (tmp_path / "empty").mkdir()
    done = CliRunner().invoke(main, ["compare", str(tmp_path / "empty")])
    assert done.exit_code == 2 and "empty: no metrics.csv (was it a psgrad --log-dir?)" in done.output, done.output
    done = CliRunner().invoke(main, ["compare", str(tmp_path / "a"), "--target-accuracy", "1.5"])
    assert done.exit_code == 2 and "--target-accuracy" in done.output, done.output


def test_two_simulated_runs_compare_end_to_end(tmp_path):
    """From psgrad's own log dirs: the faster-learning run to the common target ranks first."""
    for name, codec in (("dense", "none"), ("sign", "sign")):
        done = CliRunner().invoke(
            main,
            ["simulate", "--workers", "2", "--model", "mlp", "--steps", "8", "--eval-every-steps", "4"]
            + ["--lr", "0.01", "--codec", codec, "--no-progress", "--log-dir", str(tmp_path / name)],
        )
        assert done.exit_code == 0, done.output
    done = CliRunner().invoke(main, ["compare", str(tmp_path / "dense"), str(tmp_path / "sign")])
    assert done.exit_code == 0, done.output
    rows = done.output.splitlines()[2:4]
    assert sorted(row.split()[0] for row in rows) == ["none", "sign"] and rows[0].endswith("1.00x"), done.output


def test_a_run_is_labelled_by_what_sets_it_apart(tmp_path):
    """Codec, feedback, down-link, a topology other than ps and local steps: two runs of one codec
    that differ in topology or local steps are told apart by more than their folders' names."""
    from psgrad.runlogs import run_label

    (tmp_path / "slow").mkdir()
    config = {"codec": "qsgd:levels=16", "feedback": "ef", "down_codec": "qsgd:levels=64", "topology": "colocated"}
    (tmp_path / "slow" / "config.json").write_text(json.dumps({**config, "local_steps": 32}))
    assert run_label(tmp_path / "slow") == "qsgd:levels=16+ef, down qsgd:levels=64, colocated, 32 local steps (slow)"
    (tmp_path / "ps").mkdir()
    (tmp_path / "ps" / "config.json").write_text(json.dumps({"codec": "none", "topology": "ps", "local_steps": 0}))
    assert run_label(tmp_path / "ps") == "none (ps)"


def test_a_run_whose_metrics_miss_steps_is_said_so_and_the_others_still_rank(tmp_path):
    """A job killed before it logged a step's row, then resumed, lacks that row: its time to the
    target cannot be read, which its row says; the comparison of the others goes on. The whole
    command used to fail on it."""
    _run(tmp_path / "whole", step_seconds=1.0, accuracies={5: 0.8})
    gap = _run(tmp_path / "gap", step_seconds=0.5, accuracies={5: 0.9})
    lines = (gap / "metrics.csv").read_text().splitlines()
    (gap / "metrics.csv").write_text("\n".join(lines[:3] + lines[4:]) + "\n")  # step 2's row is gone
    done = CliRunner().invoke(main, ["compare", str(tmp_path / "whole"), str(gap)])
    assert done.exit_code == 0, done.output
    rows = done.output.splitlines()[2:4]
    assert rows[0].startswith("whole") and rows[0].endswith("1.00x"), done.output
    assert rows[1].startswith("gap") and rows[1].endswith("steps missing"), done.output
    assert "steps missing: its metrics.csv lacks steps before the target" in done.output


def test_a_default_target_close_to_every_runs_best_is_not_noted(tmp_path):
    """Runs whose best accuracies lie within two points of each other learned alike: no note."""
    _run(tmp_path / "a", step_seconds=1.0, accuracies={9: 0.80})
    _run(tmp_path / "b", step_seconds=0.5, accuracies={9: 0.785})
    done = CliRunner().invoke(main, ["compare", str(tmp_path / "a"), str(tmp_path / "b")])
    assert done.exit_code == 0 and "set the target" not in done.output, done.output
    _run(tmp_path / "c", step_seconds=0.5, accuracies={9: 0.775})
    done = CliRunner().invoke(main, ["compare", str(tmp_path / "a"), str(tmp_path / "c")])
    assert "note: c set the target, its best accuracy, while a reached 0.800" in done.output, done.output
