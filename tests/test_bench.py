import json
import sys

from conftest import run_mpi

from psgrad.bench import hidden_share


def test_bench_table_and_json(tmp_path):
    out = tmp_path / "bench.json"
    png = tmp_path / "bench.png"
    args = [
        "--model",
        "mlp",
        "--batch-size",
        "8",
        "--synthetic-size",
        "256",
        "--steps",
        "4",
        "--warmup",
        "1",
        "--repeat",
        "2",
    ]
    proc = run_mpi(
        [
            sys.executable,
            "-m",
            "psgrad",
            "bench",
            *args,
            "--codecs",
            "none;topk:ratio=0.01",
            "--json",
            str(out),
            "--plot",
            str(png),
        ],
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "speedup" in proc.stdout and "topk:ratio=0.01" in proc.stdout
    rows = json.loads(out.read_text())
    assert [r["codec"] for r in rows] == ["none", "topk:ratio=0.01"]
    assert rows[0]["speedup"] == 1.0 and rows[1]["runs"] == 2
    assert rows[1]["bytes_up"] < rows[0]["bytes_up"] / 10  # top-1% sends far fewer bytes up (down stays dense)
    assert all(r["it_per_s"] > 0 for r in rows)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_hidden_share():
    base = {"forward": 1.0, "backward": 3.0, "push_wait": 0.0, "pull_wait": 0.0}
    assert hidden_share(base) == 1.0
    assert hidden_share({**base, "pull_wait": 4.0}) == 0.5
