"""A run setting is declared once: its click option, --help section, docs/cli.md row, allowed
values, "set but unused" refusal and config.json round trip all come from that declaration."""

from __future__ import annotations

import dataclasses
import json
import re

import click
import pytest
from click.testing import CliRunner

from psgrad.clidoc import command_lines
from psgrad.config import RunConfig
from psgrad.config.refusals import refuse_unused, unused_option
from psgrad.options import SectionedCommand, run_options, section_of
from psgrad.settings import TRAINING, setting, unless


@dataclasses.dataclass
class Extended(RunConfig):
    """RunConfig plus one new setting, declared as psgrad's own are, and touched nowhere else."""

    knob_steps: int = setting(
        3,
        section=TRAINING,
        low=0,
        unused=(unless(lambda cfg: cfg.optimizer == "adam", "--knob-steps is Adam's: --optimizer {cfg.optimizer}"),),
        help="A new knob, in steps.",
    )


def _command() -> click.Command:
    seen: dict = {}

    def body(**options) -> None:
        seen.update(options)

    command = SectionedCommand("knobbed", callback=body, params=[])
    run_options(command.callback, config_class=Extended)
    command.params = list(reversed(getattr(command.callback, "__click_params__", [])))
    command.seen = seen
    return command


def test_a_new_setting_is_a_click_option_with_its_type_and_section():
    command = _command()
    done = CliRunner().invoke(command, ["--knob-steps", "7", "--optimizer", "adam"])
    assert done.exit_code == 0, done.output
    assert command.seen["knob_steps"] == 7 and command.seen["optimizer"] == "adam"
    refused = CliRunner().invoke(command, ["--knob-steps", "-1"])
    assert refused.exit_code == 2 and "--knob-steps" in refused.output
    knob = next(p for p in command.params if p.name == "knob_steps")
    assert section_of(knob) == TRAINING
    help_text = CliRunner().invoke(command, ["--help"]).output
    assert help_text.index("--knob-steps") > help_text.index(f"{TRAINING}:")


def test_a_new_setting_has_its_row_in_the_cli_reference():
    lines = command_lines("knobbed", _command())
    row = next(line for line in lines if line.startswith("| `--knob-steps`"))
    assert "| 3 |" in row and "A new knob, in steps." in row
    assert lines.index(row) > lines.index(f"### {TRAINING}")


def test_a_new_setting_is_checked_against_its_declaration():
    with pytest.raises(ValueError, match=r"--knob-steps must be >= 0, got -2"):
        Extended(knob_steps=-2).validate()
    assert Extended(knob_steps=0).validate().knob_steps == 0


def test_a_setting_of_the_wrong_type_is_named_not_a_failed_comparison():
    """A config.json (or a Python caller) giving a setting a value of another type: one error
    naming the setting and the type it takes. It used to be "'<=' not supported between
    instances of 'str' and 'int'", or a crash later in the run."""
    for changes, text in [
        ({"lr": "fast"}, "--lr must be a number, got 'fast'"),
        ({"lr": True}, "--lr must be a number, got True"),
        ({"lr": None}, "--lr must be set, got None"),
        ({"steps": 2.5}, "--steps must be an integer, got 2.5"),
        ({"augment": 2}, "--augment must be true or false, got 2"),
        ({"log_dir": 3}, "--log-dir must be a string, got 3"),
        ({"lr_milestones": [1, "a"]}, "--lr-milestones must be a list of integers"),
        ({"knob_steps": "3"}, "--knob-steps must be an integer, got '3'"),  # a new setting: from its declaration
    ]:
        with pytest.raises(ValueError, match=re.escape(text)):
            Extended.from_json(json.dumps(changes))
    for fine in (
        {"lr": 1, "steps": None, "log_dir": "runs/a", "lr_milestones": [1, 2], "augment": 1},
        {"knob_steps": 4},
    ):
        Extended.from_json(json.dumps(fine))  # an int is a number; optional settings take null
    with pytest.raises(ValueError, match="a JSON object of settings expected, got a list"):
        RunConfig.from_json("[1, 2]")
    with pytest.raises(ValueError, match=re.escape("unknown config keys: epoch (did you mean epochs?), zz")):
        RunConfig.from_json('{"epoch": 3, "zz": 1}')  # a misspelt key names the setting it likely meant


def test_a_new_setting_is_refused_where_it_means_nothing():
    sgd = Extended(knob_steps=5).validate()
    assert unused_option("knob_steps", sgd) == "--knob-steps is Adam's: --optimizer sgd"
    with pytest.raises(ValueError, match="Adam's"):
        refuse_unused(["knob_steps"], sgd)
    refuse_unused(["knob_steps"], Extended().validate())  # left at its default: quiet
    refuse_unused(["knob_steps"], Extended(knob_steps=5, optimizer="adam", momentum=0.0).validate())


def test_a_new_setting_round_trips_through_config_json():
    cfg = Extended(knob_steps=9, lr_milestones=(2, 4)).validate()
    back = Extended.from_json(cfg.to_json())
    assert back == cfg and json.loads(cfg.to_json())["knob_steps"] == 9


def test_every_choice_and_range_holds_outside_the_command_line():
    """The allowed values the command line offers hold for a RunConfig built in Python too."""
    for changes, text in [
        ({"amp": "fp8"}, "--amp must be one of off, bf16, fp16, got 'fp8'"),
        ({"partition": "striped"}, "--partition must be one of random, contiguous"),
        ({"momentum": 1.0}, r"--momentum must be in \[0, 1\), got 1.0"),
        ({"consensus_step": 0.0, "topology": "ring"}, r"--consensus-step must be in \(0, 1\], got 0.0"),
        ({"synthetic_classes": 7}, "--synthetic-classes must be one of 10, 100, got 7"),
        ({"topology": "star"}, "--topology must be one of ps, colocated, alltoall, ring, torus"),
    ]:
        with pytest.raises(ValueError, match=text):
            RunConfig(**changes).validate()


def test_a_new_topology_is_one_file_and_one_registry_line(monkeypatch):
    """A topology declared as psgrad's own are (its Topology, here in place of its own file under
    psgrad/roles/) and registered with one line is a choice of --topology, checked, refused
    where it cannot run, refuses the options it ignores, and trains through its role factory."""
    from psgrad.cli import main
    from psgrad.comm.layout import Topology, without_gossip, without_servers
    from psgrad.roles import TOPOLOGIES

    refuses, ignores = without_servers("pair")
    pair = Topology(
        name="pair",
        kind="peers",
        role="psgrad.engine.alltoall:PeerRole",
        busiest_link=lambda m, servers, workers: m["bytes_up"] / workers,
        refuses=refuses,
        ignores={**ignores, **without_gossip("pair")},
    )
    monkeypatch.setitem(TOPOLOGIES, "pair", pair)  # the registry line

    cfg = RunConfig(topology="pair", model="mlp", steps=2, batch_size=8, synthetic_size=64, progress=False)
    assert cfg.validate().topology == "pair"
    with pytest.raises(ValueError, match="--mode async needs servers"):
        dataclasses.replace(cfg, mode="async").validate()
    assert unused_option("servers", dataclasses.replace(cfg, servers=2)) == (
        "--servers counts the server ranks of --topology ps: pair has none"
    )
    args = ["simulate", "--workers", "2", "--model", "mlp", "--steps", "2", "--batch-size", "8"]
    args += ["--synthetic-size", "64", "--no-progress", "--topology", "pair"]
    done = CliRunner().invoke(main, args)
    assert done.exit_code == 0, done.output
    refused = CliRunner().invoke(main, [*args, "--servers", "2"])
    assert refused.exit_code == 2 and "pair has none" in refused.output
    TOPOLOGIES.pop("pair")
    unknown = CliRunner().invoke(main, args)
    assert unknown.exit_code == 2 and "'pair' is not one of" in unknown.output


def test_workers_take_a_gpu_by_default_where_torch_sees_one(monkeypatch):
    import torch

    from psgrad.config import RunConfig
    from psgrad.devices import worker_device

    assert RunConfig().device == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert worker_device(RunConfig().device, local_worker=3) == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert worker_device(RunConfig().device, local_worker=3) == torch.device("cpu")


def test_renamed_settings_say_their_unit_and_the_old_names_still_work_with_a_note(tmp_path):
    import json

    from click.testing import CliRunner

    from psgrad.choices import current_flags
    from psgrad.cli import main
    from psgrad.config import RunConfig

    args, notes = current_flags(["--eval-every=2", "--checkpoint-every", "5", "--", "--eval-steps"])
    assert args == ["--eval-every-epochs=2", "--checkpoint-every-steps", "5", "--", "--eval-steps"]
    assert len(notes) == 2 and "--checkpoint-every is now --checkpoint-every-steps" in notes[1]
    log = tmp_path / "run"
    options = ["simulate", "--workers", "2", "--model", "mlp", "--steps", "4", "--no-progress"]
    done = CliRunner().invoke(main, [*options, "--checkpoint-every", "2", "--log-dir", str(log)])
    assert done.exit_code == 0, done.output[-2000:]
    assert done.stderr.count("--checkpoint-every is now --checkpoint-every-steps") == 1
    saved = json.loads((log / "config.json").read_text())
    assert saved["checkpoint_every_steps"] == 2 and (log / "ckpt-step2").is_dir()
    saved["eval_every"] = saved.pop("eval_every_epochs")  # a config.json written before the rename
    saved["eval_every"] = 3
    assert RunConfig.from_json(json.dumps(saved)).eval_every_epochs == 3
