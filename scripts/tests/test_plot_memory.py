"""scripts/plot_memory.py on small fixtures (made-up numbers, not measurements)."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import plot_memory as pm  # noqa: E402

FIXTURES = pathlib.Path(__file__).with_name("fixtures")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_markdown_rows_from_matching_tables_only():
    rows = pm.load(FIXTURES / "results.md")
    assert len(rows) == 10
    first = rows[0]
    assert first == {"impl": "pytorch-cudnn", "format": "bf16", "tokens": 16384,
                     "peak_bytes": 1_170_000_000, "shape": "-"}
    crash = [r for r in rows if r["impl"] == "pytorch-efficient" and r["tokens"] == 152263]
    assert crash[0]["peak_bytes"] is None
    assert {"impl": "kvpack", "format": "int4", "tokens": 152263, "peak_bytes": 900_000_000,
            "shape": "-"} in rows, "backticks and _ separators are stripped"
    fa2 = [r for r in rows if r["impl"] == "pytorch-fa2"][0]
    assert fa2["peak_bytes"] == pytest.approx(10.25 * pm.GIB), "peak (GiB) converts to bytes"


def test_series_are_sorted_and_grouped():
    data = pm.series(pm.load(FIXTURES / "results.md"))
    labels = list(data)
    assert labels[0].startswith("PyTorch"), "PyTorch lines first"
    assert "kvpack INT4" in labels and "kvpack INT8" in labels
    xs, ys = data["kvpack INT4"]
    assert xs == [16384, 152263]
    assert ys[1] == pytest.approx(900_000_000 / pm.GIB)
    assert data["PyTorch x@W + SDPA (memory-efficient)"][1][-1] is None


def test_json_input():
    rows = pm.load(FIXTURES / "results.json")
    assert len(rows) == 4
    assert [r["peak_bytes"] for r in rows if r["tokens"] == 32768] == [None, 250000000]


@pytest.mark.parametrize("name", ["results.md", "results.json"])
def test_renders_png(tmp_path, name):
    out = tmp_path / "sub" / "peak.png"
    assert pm.main(["-i", str(FIXTURES / name), "-o", str(out), "--card", "H200=141",
                    "--card", "RTX 4070 (12 GiB)=12"] + (["--logy"] if name.endswith(".json") else [])) == 0
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "r.md"
    bad.write_text("| a | b |\n| --- | --- |\n| 1 | 2 |\n")
    assert pm.main(["-i", str(bad), "-o", str(tmp_path / "x.png")]) == 2
    assert "no rows with impl, format, tokens" in capsys.readouterr().err
    bad_json = tmp_path / "r.json"
    bad_json.write_text('[{"impl": "kvpack", "tokens": 1}]')
    assert pm.main(["-i", str(bad_json), "-o", str(tmp_path / "x.png")]) == 2
    assert "lacks" in capsys.readouterr().err
    assert pm.main(["-i", str(tmp_path / "missing.md"), "-o", str(tmp_path / "x.png")]) == 2


def test_card_argument():
    assert pm.parse_card("RTX 3060=12") == ("RTX 3060", 12.0)
    with pytest.raises(Exception):
        pm.parse_card("no-number")


def test_benchmark_layout_shape_and_impl_columns():
    rows = pm.load(FIXTURES / "bench_layout.md")
    assert len(rows) == 7, "the older run's duplicate row is dropped"
    first = rows[0]
    assert first == {"impl": "kvpack", "format": "int4", "tokens": 8192,
                     "peak_bytes": pytest.approx(0.30 * pm.GIB), "shape": "56x128"}
    assert {(r["impl"], r["format"]) for r in rows} == {
        ("kvpack", "int4"), ("kvpack", "int4 in place"), ("pytorch-cudnn", "bf16"),
        ("pytorch-fa2", "bf16")}
    picked, shape = pm.select_shape(rows)
    assert shape == "56x128" and len(picked) == 6
    assert len(pm.select_shape(rows, "112×64")[0]) == 1
    with pytest.raises(pm.InputError, match="shapes"):
        pm.select_shape(rows, "8x8")
    data = pm.series(picked)
    assert data["kvpack INT4, in place"][0] == [32768]


def test_benchmark_layout_renders(tmp_path):
    out = tmp_path / "peak.png"
    assert pm.main(["-i", str(FIXTURES / "bench_layout.md"), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
