"""The start-up note for combinations that trailed dense training on the accuracy proxy."""

from __future__ import annotations

import pytest

from psgrad.accuracy import MEASURED, PARITY, accuracy_note, measured
from psgrad.codecs import available_codecs, make_codec, parse_spec
from psgrad.config import RunConfig


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
        {"codec": "qsgd:levels=16"},  # never measured: no note
        {"codec": "terngrad"},
        # a parameter the entry pins sets the codec apart: bucketed sign is not one-scale sign
        {"codec": "sign:bucket=64", "feedback": "ef", "down_codec": "sign:bucket=64"},
        {"codec": "sign:bucket=32", "feedback": "ef", "down_codec": "qsgd:levels=16"},  # at parity
    ],
)
def test_parity_or_no_measurement_gets_no_note(options):
    assert accuracy_note(RunConfig(**options)) is None


def test_every_entry_names_a_real_codec_and_a_docs_section():
    codecs = {name.split(":")[0] for name in available_codecs()}
    for entry in MEASURED:
        assert {parse_spec(entry.codec)[0], parse_spec(entry.down)[0]} <= codecs | {"none"}, entry
        make_codec(entry.codec), make_codec(entry.down)  # parameters the codecs accept
        assert entry.feedback in ("none", "ef", "dgc")
        assert entry.where.startswith("docs/") and 0 < entry.of_dense <= 1.0 + 1e-9
    assert measured(RunConfig(codec="qsgd:levels=16", down_codec="qsgd:levels=16")).of_dense >= PARITY
