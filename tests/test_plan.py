"""The cost model (psgrad/plan.py) and ``psgrad plan``: its bytes against what psgrad sends, the
formulas of each topology, local steps, and the command's table and errors."""

import itertools
import math
import re

import pytest
from click.testing import CliRunner

from psgrad.cli import main
from psgrad.comm import wire
from psgrad.models import build_model
from psgrad.plan import (
    PSGRAD_LAYER_OVERHEAD_S,
    SERVING_SHARE,
    Scenario,
    coded_bytes,
    fragment_turn_bytes,
    link_bytes,
    message_bytes,
    plan,
)

SHAPES = [(64, 32, 3, 3), (128, 64, 3, 3), (10, 128), (64,), (128,), (10,)]
ELEMENTS = sum(math.prod(shape) for shape in SHAPES)


def test_a_codecs_bytes_are_typical_messages_with_the_vectors_dense_in_one_bucket():
    vectors = 64 + 128 + 10
    want = wire.max_message_bytes("none", (vectors,)) + sum(
        message_bytes("qsgd:levels=16", shape) for shape in SHAPES[:3]
    )
    assert coded_bytes("qsgd:levels=16", SHAPES) == want
    # a normal tensor's QSGD-16 levels are mostly 0 and 1: blosc packs them well under the bound
    assert message_bytes("qsgd:levels=16", (128, 64, 3, 3)) < 0.6 * wire.max_message_bytes(
        "qsgd:levels=16", (128, 64, 3, 3)
    )
    assert message_bytes("none", (10, 128)) == wire.max_message_bytes("none", (10, 128))


def test_a_large_layer_is_coded_from_a_sample_of_its_rows(monkeypatch):
    whole = message_bytes("qsgd:levels=16", (256, 64, 3, 3))
    monkeypatch.setattr("psgrad.plan.SAMPLE_ELEMENTS", 64 * 64 * 9)
    message_bytes.cache_clear()
    try:
        assert message_bytes("qsgd:levels=16", (256, 64, 3, 3)) == pytest.approx(whole, rel=0.02)
    finally:
        message_bytes.cache_clear()


def test_the_busiest_link_of_each_topology():
    up = coded_bytes("sign", SHAPES)
    dense = 4.0 * ELEMENTS
    s = dict(shapes=SHAPES, codec="sign", workers=8)
    assert link_bytes(Scenario(**s, topology="ps")) == 8 * dense  # the server sends dense values to 8
    assert link_bytes(Scenario(**s, topology="ps", servers=2)) == 4 * dense
    assert link_bytes(Scenario(**s, topology="colocated")) == pytest.approx(7 / 8 * (up + dense))
    assert link_bytes(Scenario(**s, topology="alltoall")) == 7 * up
    assert link_bytes(Scenario(**s, topology="ring")) == 2 * up
    assert link_bytes(Scenario(shapes=SHAPES, workers=8, topology="ddp")) == pytest.approx(2 * 7 / 8 * 4 * ELEMENTS)
    powersgd = Scenario(shapes=SHAPES, workers=8, topology="ddp-powersgd", codec="powersgd:rank=2")
    assert link_bytes(powersgd) == pytest.approx(2 * 7 / 8 * coded_bytes("powersgd:rank=2", SHAPES))


@pytest.mark.parametrize(
    ("topology", "workers", "fan_in"),
    [("ps", 2, True), ("ps", 1, False), ("colocated", 2, False), ("colocated", 3, True), ("alltoall", 4, True)]
    + [("ring", 2, False), ("ring", 8, True), ("ddp", 8, False), ("ddp-powersgd", 8, False)],
)
def test_a_link_that_several_ranks_send_into_at_once_runs_at_the_fan_in_efficiency(topology, workers, fan_in):
    """Incast: a ps server's link, a colocated or alltoall rank's past two ranks, a ring rank's two
    neighbours take the fan-in efficiency; a link with one sender (a ring all-reduce's) does not."""
    codec = "powersgd:rank=2" if topology == "ddp-powersgd" else "none"
    s = dict(shapes=SHAPES, codec=codec, topology=topology, workers=workers, local_steps=2)  # link: link time / 2
    full, lossy = plan(Scenario(**s)), plan(Scenario(**s, fan_in_efficiency=0.5))
    assert full.parts["link"] > 0
    assert lossy.parts["link"] == pytest.approx(full.parts["link"] * (2 if fan_in else 1))
    with pytest.raises(ValueError, match="fan_in_efficiency"):
        plan(Scenario(**s, fan_in_efficiency=0))


WRN = {"depth": 16, "widen_factor": 4}


@pytest.mark.parametrize(
    "model, codec, down",
    [
        ("wrn", "powersgd:rank=2", "none"),
        ("wrn", "qsgd:levels=16", "none"),
        ("resnet20", "powersgd:rank=8", "qsgd:levels=16"),
    ],
)
def test_the_predicted_bytes_are_what_a_colocated_run_sends(tmp_path, model, codec, down):
    """Two colocated workers send each other half their messages and the replies of their
    shards: the model's (N-1)/N x (up + down) a rank, from typical messages, is within 5 % of what
    psgrad's metrics count on the WRN-16-4 the model was validated with (QSGD's wire bound, 2.2x
    its messages, was not). PowerSGD at rank 8 sends 8 of ResNet-20's 20 matrices whole, and
    their replies go through the down-link codec, not as summed factors (priced as factors, the
    prediction was 12 % over)."""
    import csv

    from psgrad.models import build_model

    log = tmp_path / "run"
    sizes = [f"--{key.replace('_', '-')}={value}" for key, value in WRN.items()] if model == "wrn" else []
    options = ["simulate", "--workers", "2", "--topology", "colocated", "--model", model, *sizes, "--codec", codec]
    options += ["--down-codec", down, "--batch-size", "4", "--steps", "2"]
    done = CliRunner().invoke(main, [*options, "--no-progress", "--log-dir", str(log)])
    assert done.exit_code == 0, done.output[-3000:]
    with open(log / "metrics.csv", newline="") as f:
        row = list(csv.DictReader(f))[-1]  # the first step's pull sends the whole model
    sent = int(row["bytes_up"]) + int(row["bytes_down"])  # both ranks, both directions
    shapes = [tuple(p.shape) for p in build_model(model, 10, **(WRN if model == "wrn" else {})).parameters()]
    scenario = Scenario(shapes=shapes, codec=codec, down_codec=down, topology="colocated", workers=2)
    predicted = 2 * link_bytes(scenario)
    assert predicted == pytest.approx(sent, rel=0.05), (sent, predicted)


def test_local_steps_divide_an_exchange_and_overlapping_hides_it():
    base = dict(shapes=SHAPES, workers=2, bandwidth_bps=1e6, compute_s=0.1, layer_overhead_s=0.0)
    every = plan(Scenario(**base))
    h8 = plan(Scenario(**base, local_steps=8))
    link = link_bytes(Scenario(**base)) * 8 / 1e6
    assert h8.parts["link"] == pytest.approx(link / 8)
    assert every.parts["link"] == pytest.approx(link - 0.85 * 0.1)  # psgrad hides 0.85 of a step
    long = plan(Scenario(**{**base, "bandwidth_bps": 1e9}, local_steps=8, overlap_exchange=True))
    assert long.parts["link"] == 0 and long.utilisation == pytest.approx(1 / (1 + long.parts["coding"] / 0.1))
    # taken tau = 3 steps after the exchange, the reply hides behind 2 steps of compute, not 7
    overlapped = dict(local_steps=8, overlap_exchange=True)
    by3 = plan(Scenario(**base, **overlapped, overlap_steps=3))
    assert by3.parts["link"] == pytest.approx((link - 2 * 0.1) / 8)
    assert plan(Scenario(**base, **overlapped, overlap_steps=8)).step_s == plan(Scenario(**base, **overlapped)).step_s
    with pytest.raises(ValueError, match="overlap_steps"):
        plan(Scenario(**base, **overlapped, overlap_steps=9))


def test_psgrads_own_cost_is_per_layer_not_per_byte_and_once_an_exchange():
    small = [(16, 8, 3, 3), (32, 16, 3, 3), (10, 32), (16,), (32,), (10,)]  # 3 layers + the bucket
    big = [(512, 256, 3, 3), (512, 512, 3, 3), (1000, 512), (512,), (512,), (1000,)]
    for shapes in (small, big):
        cost = plan(Scenario(shapes=shapes, topology="colocated", compute_s=0.1)).parts["overhead"]
        assert cost == pytest.approx(4 * PSGRAD_LAYER_OVERHEAD_S)
    h8 = Scenario(shapes=big, topology="colocated", compute_s=0.1, local_steps=8)
    assert plan(h8).parts["overhead"] == pytest.approx(4 * PSGRAD_LAYER_OVERHEAD_S / 8)
    # a ps worker does not serve: its servers are ranks of their own
    ps = plan(Scenario(shapes=big, topology="ps", compute_s=0.1)).parts["overhead"]
    assert ps == pytest.approx(4 * PSGRAD_LAYER_OVERHEAD_S * (1 - SERVING_SHARE))
    assert plan(Scenario(shapes=big, topology="ddp")).parts["overhead"] == 0  # torch's own all-reduce
    # the link moves during the rank's own work as well as during its compute
    slow = Scenario(shapes=big, topology="colocated", compute_s=0.1, bandwidth_bps=1e6, layer_overhead_s=0.01)
    exposed = link_bytes(slow) * 8 / 1e6 - 0.85 * (0.1 + 0.04)
    assert plan(slow).parts["link"] == pytest.approx(exposed)
    given = plan(Scenario(shapes=big, compute_s=0.1, layer_overhead_s=0.01))
    assert given.parts["overhead"] == pytest.approx(0.04) and given.step_s == pytest.approx(sum(given.parts.values()))
    with pytest.raises(ValueError, match="layer_overhead_s"):
        plan(Scenario(shapes=big, layer_overhead_s=-1.0))


def test_a_fragment_served_by_one_rank_takes_its_serial_path():
    # two equal layers on two ranks: each fragment's layer is served by one rank, so its turn is
    # the other worker's push in, then the dense reply out, where an even split halves them
    shapes = [(256, 128, 3, 3), (256, 128, 3, 3), (256,), (256,)]
    s = Scenario(shapes=shapes, codec="qsgd:levels=16", topology="colocated", fragments=2, local_steps=2)
    layer = (256, 128, 3, 3)
    serial = message_bytes("qsgd:levels=16", layer) + message_bytes("none", layer)
    turns = fragment_turn_bytes(s)
    assert turns[1] == pytest.approx(serial) and turns[0] == pytest.approx(serial + 2 * message_bytes("none", (512,)))
    assert sum(turns) == pytest.approx(2 * link_bytes(s), rel=0.01)
    ps = Scenario(shapes=shapes, codec="qsgd:levels=16", topology="ps", fragments=2, local_steps=2)
    assert fragment_turn_bytes(ps) == [link_bytes(ps) / 2] * 2
    # overlapped by one step (nothing hidden), the run waits for both whole turns
    overlapped = plan(Scenario(**{**s.__dict__, "overlap_exchange": True, "overlap_steps": 1, "bandwidth_bps": 1e6}))
    seconds = sum(turns) * 8 / 1e6
    assert overlapped.parts["link"] == pytest.approx(seconds / 2)


def test_a_ring_all_reduce_waits_for_a_round_trip_per_rank():
    s = Scenario(shapes=SHAPES, workers=64, topology="ddp", rtt_s=0.01, compute_s=0.1)
    assert plan(s).parts["latency"] == pytest.approx(63 * 0.01) and plan(s).bottleneck == "latency"
    colocated = Scenario(shapes=SHAPES, workers=64, topology="colocated", codec="powersgd:rank=2", rtt_s=0.01)
    assert plan(colocated).parts["latency"] == pytest.approx(2 * 0.01)  # PowerSGD's two rounds


def test_the_command_prints_a_row_per_workers_and_link():
    done = CliRunner().invoke(
        main, ["plan", "--model", "mlp", "--step-ms", "50", "--workers", "2,8", "--bandwidth", "100gbit,10mbit"]
    )
    assert done.exit_code == 0, done.output
    lines = done.output.split("\n\n")[0].splitlines()[1:]  # the table, before the accuracy below it
    rows = [line.split() for line in lines[1:]]
    assert [(r[0], r[1] + r[2]) for r in rows] == [
        ("2", "100Gbit/s"),
        ("2", "10Mbit/s"),
        ("8", "100Gbit/s"),
        ("8", "10Mbit/s"),
    ]
    assert float(rows[0][4]) > float(rows[1][4])  # a faster link, more of compute
    # every figure ends under its heading's end, the widest link too
    ends = [m.end() for m in re.finditer(r"\S+(?: \S+)*", lines[0])][:4]
    for line in lines[1:]:
        assert [m.end() for m in re.finditer(r"\S+(?: \S+)?", line)][:4] == ends, "\n".join(lines)


def test_a_link_bound_cell_keeps_its_figure():
    # 1.2 B parameters of dense fp32 through one server at 1 Gbit/s: about 0.0002x compute
    done = CliRunner().invoke(
        main,
        ["plan", "--matrices", "96x2048x2048,48x2048x8192", "--step-ms", "100", "--workers", "16",
         "--topology", "ps", "--bandwidth", "1gbit"],
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    share = float(done.output.splitlines()[2].split()[4])
    assert 0 < share < 0.001


MLP_SHAPES = [tuple(p.shape) for p in build_model("mlp", 100).parameters()]
PLAN = ["plan", "--model", "mlp", "--step-ms", "50", "--workers", "2,8", "--bandwidth", "1gbit,10mbit"]


def test_several_codecs_and_topologies_compare_in_one_table_each_row_its_own_plan():
    """Every topology with every codec that can run on it, side by side under a label: each row
    the figures of that combination planned alone, the ones that cannot run said, not dropped."""
    both = ["--topology", "colocated", "--topology", "ddp", "--codec", "none", "--codec", "powersgd:rank=2"]
    done = CliRunner().invoke(main, [*PLAN, *both])
    assert done.exit_code == 0, done.output
    header, table = done.output.split("plan  workers")[0], done.output.split("\n\n")[0].splitlines()
    assert "  A: none up, none down, colocated" in header and "  B: powersgd:rank=2 up, none down, colocated" in header
    assert "  C: none up, none down, ddp\n" in header
    assert "  not planned: powersgd:rank=2 up, none down, ddp: --topology ddp all-reduces the dense gradient" in header
    rows = [line.split() for line in table if re.match(r" +[A-C] ", line)]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (label, workers, link) for workers in "28" for link in ("1", "10") for label in "ABC"
    ]
    for label, topology, codec in (
        ("A", "colocated", "none"),
        ("B", "colocated", "powersgd:rank=2"),
        ("C", "ddp", "none"),
    ):
        alone = CliRunner().invoke(main, [*PLAN, "--topology", topology, "--codec", codec])
        assert alone.exit_code == 0, alone.output
        own = [line.split() for line in alone.output.split("\n\n")[0].splitlines()[2:]]
        assert [r[1:] for r in rows if r[0] == label] == own
        # and the last row (8 workers, 10 Mbit/s) is the cost model's own figure
        alone_at_8 = plan(
            Scenario(shapes=MLP_SHAPES, topology=topology, codec=codec, workers=8, bandwidth_bps=10e6, compute_s=0.05)
        )
        assert own[-1][3] == f"{alone_at_8.step_s * 1e3:.1f}"
    accuracy = done.output.split("\n\n")[1]
    assert "A: accuracy: dense" in accuracy and "C: accuracy: dense" in accuracy
    assert "B: accuracy, measured" in accuracy and "\n     --feedback none: 0.98x on the proxy" in accuracy


def test_a_comparison_says_why_each_combination_that_cannot_run_is_not_planned():
    one_runs = CliRunner().invoke(main, [*PLAN, "--topology", "ddp", "--topology", "colocated", "--codec", "sign"])
    assert one_runs.exit_code == 0, one_runs.output
    assert one_runs.output.startswith("0.2 M parameters, sign up, none down, colocated, compute 50.0 ms a step")
    assert "\n  not planned: sign up, none down, ddp: --topology ddp all-reduces the dense gradient" in one_runs.output
    done = CliRunner().invoke(main, [*PLAN, "--topology", "ddp", "--codec", "sign", "--codec", "qsgd"])
    assert done.exit_code == 2, done.output
    assert "no combination can run:" in done.output
    assert (
        "sign up, none down, ddp: --topology ddp all-reduces" in done.output
        and "qsgd up, none down, ddp:" in done.output
    )


def test_down_link_codecs_compare_too():
    """Every codec with every down-link codec: PowerSGD and sign up, each with a dense and a
    QSGD-16 down-link, each row that pair's plan alone."""
    args = [
        "--codec",
        "powersgd:rank=8",
        "--codec",
        "sign:bucket=32",
        "--down-codec",
        "none",
        "--down-codec",
        "qsgd:levels=16",
    ]
    done = CliRunner().invoke(main, [*PLAN, *args])
    assert done.exit_code == 0, done.output
    header = done.output.split("plan  workers")[0]
    planned = re.findall(r"  ([A-Z]): (\S+) up, (\S+) down, colocated", header)
    assert planned == [
        (label, codec, down)
        for label, (codec, down) in zip(
            "ABCD", itertools.product(("powersgd:rank=8", "sign:bucket=32"), ("none", "qsgd:levels=16")), strict=True
        )
    ], header
    for label, codec, down in planned:
        alone = CliRunner().invoke(main, [*PLAN, "--codec", codec, "--down-codec", down])
        assert alone.exit_code == 0, alone.output
        own = [line.split() for line in alone.output.split("\n\n")[0].splitlines()[2:]]
        rows = [
            line.split()[1:] for line in done.output.split("\n\n")[0].splitlines() if line.startswith(f"   {label} ")
        ]
        assert rows == own


def test_servers_are_refused_only_when_no_compared_topology_has_ranks_that_only_serve():
    with_ps = CliRunner().invoke(main, [*PLAN, "--servers", "2", "--topology", "ps", "--topology", "colocated"])
    assert with_ps.exit_code == 0, with_ps.output
    without = CliRunner().invoke(main, [*PLAN, "--servers", "2", "--topology", "alltoall", "--topology", "ddp"])
    assert without.exit_code == 2 and "--servers" in without.output, without.output


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--matrices", "3x4"], "COUNTxMxN"),
        (["--codec", "nope"], "nope"),
        (["--workers", "0"], "positive"),
        (["--bandwidth", "fast"], "100mbit"),
        (["--matrices", "2x10x10", "--step-ms", None], "give its --step-ms"),
        # a traceback, or accepted and ignored, before these were checked
        (["--depth", "11"], "WideResNet depth must be 6n+4"),
        (["--classes", "0"], "not in the range x>=1"),
        (["--code-gbps", "0"], "not in the range x>0"),
        (["--local-steps", "0"], "'--local-steps': 0 is not in the range x>=1"),
        (["--vector-params", "5"], "--vector-params adds to --matrices"),
        (["--matrices", "2x10x10", "--model", "mlp"], "mean nothing beside it"),
        (
            ["--model", "mlp", "--widen-factor", "8"],
            "--widen-factor shapes a WideResNet: it means nothing to --model mlp",
        ),
        (["--batch-size", "8"], "means nothing beside --step-ms"),
        (["--servers", "2"], "every rank serves a shard under colocated"),
        (["--servers", "2", "--topology", "ddp"], "--servers means nothing to --topology ddp"),
        # runs that cannot be started: planned without a word before these were checked
        (["--topology", "ddp-powersgd"], "give --codec powersgd:rank=R"),
        (["--topology", "ddp", "--codec", "sign"], "the dense gradient: --codec none"),
        (["--topology", "ddp", "--local-steps", "4"], "torch DDP's step: no --down-codec, --local-steps"),
        (
            ["--topology", "ring", "--codec", "powersgd"],
            "powersgd needs rounds through a server: run it with --topology ps",
        ),
        (["--topology", "alltoall", "--local-steps", "4"], "--local-steps needs servers"),
        (["--topology", "alltoall", "--down-codec", "sign"], "--topology alltoall has no servers"),
    ],
)
def test_the_command_says_what_is_wrong(args, fragment):
    given = ["--step-ms", "50", *args]
    if None in args:  # the case without a step time
        given = [a for a in args if a not in ("--step-ms", None)]
    done = CliRunner().invoke(main, ["plan", *given])
    assert done.exit_code == 2 and fragment in done.output, done.output


def test_the_command_takes_psgrads_cost_a_layer():
    args = ["plan", "--model", "mlp", "--step-ms", "50", "--workers", "2", "--bandwidth", "1gbit"]
    default, slow = (CliRunner().invoke(main, args + extra) for extra in ([], ["--layer-overhead-ms", "20"]))
    assert default.exit_code == 0 and slow.exit_code == 0, default.output + slow.output
    assert "psgrad's own 0.9 ms a layer" in default.output and "psgrad's own 20 ms a layer" in slow.output
    share = [float(done.output.splitlines()[2].split()[4]) for done in (default, slow)]
    assert share[1] < share[0]
    assert slow.output.splitlines()[2].split()[-1] == "overhead"


def test_without_a_step_time_the_model_is_timed_here():
    done = CliRunner().invoke(main, ["plan", "--model", "mlp", "--batch-size", "4", "--bandwidth", "1gbit"])
    assert done.exit_code == 0, done.output
    measured = float(done.output.split("compute-only step measured here: ")[1].split(" ms")[0])
    assert measured > 0 and f"compute {measured:.1f} ms a step" in done.output


@pytest.mark.parametrize(
    "args, said",
    [
        # top-k was measured with two feedbacks: both, each trailing dense
        (["--codec", "topk:ratio=0.01"], ["--feedback dgc: 0.90x on the proxy, 0.99x held-out: trails dense",
                                          "--feedback ef: 0.93x on the proxy, 0.96x on digits, 0.93x held-out: trails"]),
        (["--codec", "powersgd:rank=8"], ["--feedback none: 0.99x on the proxy, 0.99x on digits, 1.00x held-out: at parity"]),
        (["--codec", "none"], ["accuracy: dense, the reference"]),
        (["--topology", "ddp"], ["accuracy: dense, the reference"]),
        (["--codec", "qsgd:levels=4"], ["accuracy: psgrad never measured this combination"]),
        (["--codec", "none", "--local-steps", "32"], ["--feedback none: 0.99x on the proxy, 1.00x on digits: at parity"]),
        (["--codec", "none", "--local-steps", "5"], ["never measured"]),
        (["--codec", "sign", "--down-codec", "sign", "--local-steps", "8", "--overlap-exchange", "--overlap-steps", "4"],
         ["--feedback ef: 0.99x on the proxy, 0.99x on digits, but it did not learn WRN-16-4"]),
        (["--topology", "ddp-powersgd", "--codec", "powersgd:rank=2"],
         ["accuracy of psgrad's powersgd (torch's hook matched it at rank 2)", "--feedback none: 0.98x on the proxy"]),
    ],
)  # fmt: skip
def test_the_predicted_speeds_come_with_the_accuracy_psgrad_measured(args, said):
    """A speed ranks nothing alone: below its table the plan says what psgrad measured of the
    combination's accuracy, under each feedback it was measured with, or that it never was."""
    done = CliRunner().invoke(main, ["plan", "--model", "mlp", "--step-ms", "50", "--bandwidth", "1gbit", *args])
    assert done.exit_code == 0, done.output
    accuracy = done.output.split("\n\n")[1]
    for fragment in said:
        assert fragment in accuracy, accuracy
    assert accuracy.count("--feedback") == sum("--feedback" in fragment for fragment in said), accuracy


def test_the_examples_in_docs_print_what_the_docs_show():
    """docs/planning.md's console examples are the command's output, line for line (what a page
    shows past a cut is left out there: every line shown must be printed, in order)."""
    import shlex
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "planning.md").read_text()
    examples = re.findall(r"```console\n\$ psgrad (plan [^\n]*)\n(.*?)```", text, flags=re.S)
    assert len(examples) >= 2
    for command, shown in examples:
        done = CliRunner().invoke(main, shlex.split(command))
        assert done.exit_code == 0, done.output
        printed = iter(done.output.splitlines())
        for line in shown.splitlines():
            assert line in printed, f"{command}: {line!r} is not printed (in that order):\n{done.output}"


def test_compared_combinations_are_labelled_past_z():
    from psgrad.cli.planning import _label

    assert [_label(i) for i in (0, 25, 26, 27, 51, 52, 701, 702)] == ["A", "Z", "AA", "AB", "AZ", "BA", "ZZ", "AAA"]
