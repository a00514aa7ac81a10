"""The start-up note for combinations that trailed dense training on the accuracy proxy or on
the held-out set."""

from __future__ import annotations

from dataclasses import replace

import pytest

from psgrad.accuracy import MEASURED, PARITY, accuracy_note, measured
from psgrad.codecs import available_codecs, make_codec, parse_spec
from psgrad.config import RunConfig
from psgrad.roles import TOPOLOGIES


@pytest.mark.parametrize(
    "options, of_dense",
    [
        ({"codec": "topk:ratio=0.01", "feedback": "ef", "down_codec": "topk:ratio=0.01"}, "0.84x"),
        ({"codec": "topk:ratio=0.01", "feedback": "ef"}, "0.93x"),
        ({"codec": "sign", "feedback": "ef", "down_codec": "sign"}, "0.97x"),
        ({"codec": "sign:bucket=0", "feedback": "ef", "down_codec": "sign"}, "0.97x"),
        ({"codec": "sign:bucket=32", "feedback": "ef", "down_codec": "sign:bucket=32"}, "0.98x"),
        # 0.988: rounded down, so a combination under the bar never reads as "0.99x"
        ({"codec": "sign:bucket=16", "feedback": "ef", "down_codec": "sign:bucket=16"}, "0.98x"),
        ({"codec": "powersgd:rank=2", "topology": "colocated"}, "0.98x"),
        ({"codec": "powersgd:rank=4", "topology": "colocated"}, "0.98x"),
        # an entry measured on the torus holds there
        ({"codec": "sign", "topology": "torus", "grid": "2x4"}, "0.95x"),
        # no down-link: a top-k ring counts as top-k with a dense down-link
        ({"codec": "topk:ratio=0.01", "feedback": "ef", "topology": "alltoall"}, "0.93x"),
    ],
)
def test_a_combination_that_trailed_dense_gets_a_note_with_its_measurement(options, of_dense):
    note = accuracy_note(RunConfig(**options))
    assert note is not None and of_dense in note and "docs/" in note


@pytest.mark.parametrize(
    "options",
    [
        {"codec": "none"},
        {"codec": "qsgd:levels=16", "down_codec": "qsgd:levels=16"},  # measured at parity
        {"codec": "qsgd:levels=16"},  # measured at parity (the README's first command)
        {"codec": "qsgd:levels=4", "down_codec": "qsgd:levels=4"},  # never measured: no note
        {"codec": "terngrad"},
        # a parameter the entry pins sets the codec apart: bucketed sign is not one-scale sign
        {"codec": "sign:bucket=64", "feedback": "ef", "down_codec": "sign:bucket=64"},
        {"codec": "powersgd:rank=8", "topology": "colocated"},  # at parity; the rank sets PowerSGDs apart
        {"codec": "powersgd:rank=16", "topology": "colocated"},  # never measured
        {"codec": "sign", "topology": "ring"},  # the torus entry is not the ring's (at parity there)
        {"codec": "sign"},  # ... nor sign's without error feedback through a server (never measured)
    ],
)
def test_parity_or_no_measurement_gets_no_note(options):
    assert accuracy_note(RunConfig(**options)) is None


def test_a_combination_at_parity_on_the_proxy_that_trails_off_it_gets_a_note_naming_both():
    """The proxy's classes are separable in a way real images are not: bucketed sign with a
    QSGD-16 down-link reached 0.990x dense there and 0.96x on the held-out set."""
    note = accuracy_note(RunConfig(codec="sign:bucket=32", feedback="ef", down_codec="qsgd:levels=16"))
    assert (
        note is not None
        and "0.99x dense test accuracy at equal epochs on the accuracy proxy" in note
        and "0.96x on a held-out" in note
    )
    at_parity_on_both = RunConfig(codec="powersgd:rank=8", topology="colocated")
    found = measured(at_parity_on_both)
    assert found.held_out >= 0.98 and found.digits >= 0.98 and accuracy_note(at_parity_on_both) is None


def test_a_note_names_the_digits_where_they_were_measured():
    """psgrad's own second dataset: top-k with a dense down-link trailed there too."""
    note = accuracy_note(RunConfig(codec="topk:ratio=0.01", feedback="ef"))
    assert note is not None and "0.96x on real handwritten digits (--dataset digits, 3 seeds)" in note
    assert measured(RunConfig(codec="topk:ratio=0.01", feedback="ef")).trails


def test_a_combination_at_parity_that_did_not_learn_a_larger_model_is_not_recommended():
    """Sign both ways with 8 local steps overlapped by 4 matched dense on WRN-10-1 but left
    WRN-16-4 at chance: the start-up note says so."""
    cfg = RunConfig(
        codec="sign", feedback="ef", down_codec="sign", topology="colocated",
        local_steps=8, overlap_exchange=True, overlap_steps=4,
    )  # fmt: skip
    found = measured(cfg)
    assert found is not None and found.of_dense >= PARITY and found.trails
    note = accuracy_note(cfg)
    assert note is not None and "but it did not learn WRN-16-4" in note and "compare it with --codec none" in note


def test_every_entry_names_a_real_codec_and_a_docs_section():
    codecs = {name.split(":")[0] for name in available_codecs()}
    for entry in MEASURED:
        assert {parse_spec(entry.codec)[0], parse_spec(entry.down)[0]} <= codecs | {"none"}, entry
        make_codec(entry.codec), make_codec(entry.down)  # parameters the codecs accept
        assert entry.feedback in ("none", "ef", "dgc")
        assert entry.where.startswith("docs/") and 0 < entry.of_dense <= 1.1, (
            entry
        )  # a median ratio: noise can lift it past 1
        assert entry.topology in ("", *TOPOLOGIES), entry
        assert entry.held_out is None or 0 < entry.held_out <= 1.1, entry
        assert entry.digits is None or 0 < entry.digits <= 1.1, entry
    assert measured(RunConfig(codec="qsgd:levels=16", down_codec="qsgd:levels=16")).of_dense >= PARITY


def test_the_bench_default_rows_were_measured_at_parity():
    """`psgrad bench`'s default rows are what it recommends: each must have a measurement at or
    above the bar on both datasets (dense itself aside), so a row that trailed dense cannot
    become a default."""
    from psgrad.bench.rows import item_config
    from psgrad.cli import bench

    default = next(p.default for p in bench.params if p.name == "bench_codecs")
    rows = [row for row in default.split(";") if row.split()[0] != "none"]
    assert rows
    for row in rows:
        _, cfg = item_config(row, RunConfig())
        found = measured(cfg)
        assert found is not None and not found.trails and found.held_out is not None and found.digits is not None, row


def test_local_steps_are_measured_apart_from_the_per_step_codecs():
    """A codec's per-step figure says nothing of it under --local-steps: PowerSGD rank 8 is at
    parity per step and trails with 32 local steps; the outer momentum and the overlap are part
    of what was measured; local steps nothing measured say so."""
    assert accuracy_note(RunConfig(codec="powersgd:rank=8", topology="colocated")) is None
    note = accuracy_note(RunConfig(codec="powersgd:rank=8", topology="colocated", local_steps=32))
    assert note is not None and "these local steps and codec reached 0.95x" in note and "Slow links" in note
    assert accuracy_note(RunConfig(local_steps=32)) is None  # at parity on both datasets
    assert accuracy_note(RunConfig(local_steps=32, codec="qsgd:levels=16", feedback="ef")) is None
    q64_down = RunConfig(local_steps=32, codec="qsgd:levels=16", feedback="ef", down_codec="qsgd:levels=64")
    assert accuracy_note(q64_down) is None  # 64 levels down keep parity; 16 cost a point
    assert "0.98x" in accuracy_note(replace(q64_down, local_steps=64))  # 0.986: half the exchanges trail
    assert "0.98x" in accuracy_note(replace(q64_down, down_codec="qsgd:levels=16"))
    assert "0.98x" in accuracy_note(RunConfig(local_steps=32, outer_momentum=0.9))
    assert "0.96x" in accuracy_note(RunConfig(local_steps=32, overlap_exchange=True))
    assert "0.81x" in accuracy_note(RunConfig(local_steps=32, overlap_exchange=True, outer_momentum=0.9))
    streamed = replace(q64_down, overlap_exchange=True, overlap_steps=8)
    assert "0.98x" in accuracy_note(replace(streamed, fragments=4))
    assert "was never measured" in accuracy_note(replace(streamed, fragments=2))
    unmeasured = accuracy_note(RunConfig(local_steps=16, codec="qsgd:levels=16"))
    assert unmeasured is not None and "was never measured" in unmeasured


def test_your_loops_note_speaks_of_inits_keyword_and_not_of_its_inner_optimizer():
    """In your loop the inner optimizer is the script's: the note does not name psgrad's, and says
    the figures were measured with it; local steps are init's keyword, not the command line's flag."""
    unmeasured = accuracy_note(RunConfig(local_steps=16, codec="qsgd:levels=16"), your_loop=True)
    assert "local_steps with these settings (H=16, outer nesterov" in unmeasured and "inner" not in unmeasured
    assert "--local-steps" not in unmeasured and unmeasured.endswith("a run without local_steps")
    trailing = accuracy_note(RunConfig(codec="powersgd:rank=8", topology="colocated", local_steps=32), your_loop=True)
    assert "reached 0.95x" in trailing and "measured with psgrad train's inner SGD" in trailing
    per_step = accuracy_note(RunConfig(codec="topk:ratio=0.1", feedback="ef"), your_loop=True)
    assert per_step is not None and "inner SGD" not in per_step
