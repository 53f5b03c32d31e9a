"""Charts and text histograms of `infertap probe` and `infertap compare` (issue 9).

The PNGs are checked from their bytes (signature and IHDR size) and with matplotlib's own image
reader (both sides' colours are drawn); the text histograms from the printed report.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from proxy.tools.probe import cli as probe
from proxy.tools.probe import compare, plot
from proxy.tools.probe.histogram import FULL, bar, bin_count, histogram
from tests.test_probe import closed_port, engine

JITTER = 0.3
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, which must come first in a PNG."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, data[:8]
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def has_colour(path: Path, hex_colour: str, tolerance: float = 0.04) -> bool:
    """Whether some pixel of the image is (nearly) this colour."""
    from matplotlib.image import imread

    pixels = imread(path)[..., :3]
    target = [int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    return bool((abs(pixels - target) <= tolerance).all(axis=-1).any())


def run(
    main: Callable[[list[str]], int], capsys: pytest.CaptureFixture[str], *argv: str
) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def histogram_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(("TTFT (s)", "TPOT (s)"))]


# -- acceptance: the charts ------------------------------------------------------------------------


def test_compare_plot_writes_a_png_of_the_fixed_size(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_png = tmp_path / "out.png"
    with (
        engine(ttft_s=0.03, tpot_s=0.008, tokens=8, jitter=JITTER, seed=1) as (_, url_a),
        engine(ttft_s=0.03, tpot_s=0.024, tokens=8, jitter=JITTER, seed=2) as (_, url_b),
    ):
        code, out, err = run(
            compare.main, capsys, "--a", url_a, "--b", url_b, "--model", "m", "-n", "8", "-c", "4",
            "--label-a", "kv-on", "--label-b", "kv-off", "--plot", str(out_png),
        )  # fmt: skip
    assert code == 0, err
    assert png_size(out_png) == (1200, 500)
    assert f"chart written to {out_png}" in err
    # Both sides are drawn, each in its own colour.
    assert has_colour(out_png, plot.COLOR_A) and has_colour(out_png, plot.COLOR_B)
    # The text histogram is there too, A and B side by side on one header line.
    heads = histogram_lines(out)
    assert len(heads) == 2, out
    assert all("kv-on (n=8)" in h and "kv-off (n=8)" in h for h in heads)
    assert out.index("TPOT (s)") < out.index("verdict:")


def test_probe_plot_writes_a_png_of_the_fixed_size(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_png = tmp_path / "probe.png"
    with engine(ttft_s=0.03, tpot_s=0.008, tokens=8, jitter=JITTER) as (_, url):
        code, out, err = run(
            probe.main, capsys, "--base-url", url, "--model", "m", "-n", "8", "-c", "4",
            "--plot", str(out_png),
        )  # fmt: skip
    assert code == 0, err
    assert png_size(out_png) == (1200, 500)
    assert has_colour(out_png, plot.COLOR_A)
    assert [h.split()[:3] for h in histogram_lines(out)] == [
        ["TTFT", "(s)", "requests"],
        ["TPOT", "(s)", "requests"],
    ]


def test_compare_plot_with_a_dead_side(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_png = tmp_path / "out.png"
    with engine(tokens=3, jitter=JITTER) as (_, url):
        dead = f"http://127.0.0.1:{closed_port()}/v1"
        code, out, err = run(
            compare.main, capsys, "--a", url, "--b", dead, "--model", "m", "-n", "3", "--retries", "0",
            "--plot", str(out_png),
        )  # fmt: skip
    assert code == 1 and "3 of 6 requests failed" in err  # the run's failure, and still a chart
    assert png_size(out_png) == (1200, 500) and has_colour(out_png, plot.COLOR_A)
    heads = histogram_lines(out)
    assert len(heads) == 2 and all("A (n=3)" in h and "B (n=0)" in h for h in heads)


def test_plot_format_follows_the_extension(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_svg = tmp_path / "probe.svg"
    with engine(tokens=4, jitter=JITTER) as (_, url):
        code, _, err = run(
            probe.main, capsys, "--base-url", url, "--model", "m", "-n", "3", "--plot", str(out_svg)
        )
    assert code == 0, err
    assert b"<svg" in out_svg.read_bytes()[:1000]


# -- the text histogram: on by default, off with --no-histogram and --json --------------------------


def test_histograms_by_default_not_with_no_histogram_or_json(capsys: pytest.CaptureFixture[str]) -> None:
    with engine(ttft_s=0.02, tpot_s=0.005, tokens=5, jitter=JITTER) as (_, url):
        common = ("--model", "m", "-n", "6", "-c", "3")
        code, out, _ = run(probe.main, capsys, "--base-url", url, *common)
        assert code == 0 and len(histogram_lines(out)) == 2 and FULL in out
        code, out, _ = run(probe.main, capsys, "--base-url", url, *common, "--no-histogram")
        assert code == 0 and histogram_lines(out) == [] and FULL not in out and "p50" in out
        code, out, _ = run(probe.main, capsys, "--base-url", url, *common, "--json")
        assert code == 0 and json.loads(out)["ok"] == 6 and FULL not in out

        code, out, _ = run(compare.main, capsys, "--a", url, *common)
        assert code == 0 and len(histogram_lines(out)) == 2 and FULL in out
        code, out, _ = run(compare.main, capsys, "--a", url, *common, "--no-histogram")
        assert code == 0 and histogram_lines(out) == [] and FULL not in out and "verdict:" in out
        code, out, _ = run(compare.main, capsys, "--a", url, *common, "--json")
        assert code == 0 and set(json.loads(out)) == {"labels", "a", "b", "bootstrap", "metrics"}
        # One request: probe prints the seed's five lines, nothing else.
        code, out, _ = run(probe.main, capsys, "--base-url", url, "--model", "m")
        assert code == 0 and histogram_lines(out) == [] and len(out.strip().splitlines()) == 5


# -- errors: before any request is sent ---------------------------------------------------------


@pytest.mark.parametrize(("main", "flag"), [(probe.main, "--base-url"), (compare.main, "--a")])
def test_without_matplotlib_plot_says_how_to_install_it(
    main: Callable[[list[str]], int],
    flag: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with engine(tokens=3) as (app, url):
        code, out, err = run(main, capsys, flag, url, "--model", "m", "--plot", str(tmp_path / "x.png"))
    assert code == 2
    # run from this checkout: the hint installs the extra into the environment that runs infertap
    root = Path(__file__).resolve().parent.parent
    assert f"{sys.executable} -m pip install -e '{root}[plot]'" in err and out == ""
    assert app.bodies == []  # failed before the run, not after it
    assert not (tmp_path / "x.png").exists()


def test_bad_plot_paths_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with engine(tokens=3) as (app, url):
        code, _, err = run(probe.main, capsys, "--base-url", url, "--plot", str(tmp_path / "x.nope"))
        assert code == 2 and "unknown image format .nope" in err
        code, _, err = run(compare.main, capsys, "--a", url, "--plot", str(tmp_path / "missing" / "x.png"))
        assert code == 2 and "does not exist" in err
    assert app.bodies == []


# -- the text histogram itself ------------------------------------------------------------------


def test_bar_uses_eighth_blocks_and_shows_any_count() -> None:
    assert bar(1.0, 4) == "████"
    assert bar(0.5, 4) == "██  "
    assert bar(0.5 + 1 / 32, 4) == "██▏ "
    assert bar(0.001, 4) == "▏   "  # tiny but not zero: still visible
    assert bar(0.0, 4) == "    "


def test_bin_count_follows_sturges() -> None:
    assert [bin_count(n) for n in (1, 2, 8, 20, 40, 100, 10**6)] == [1, 2, 4, 6, 7, 8, 12]


def test_histogram_shares_bins_between_series() -> None:
    a = [1.0, 1.1, 1.2, 1.3]
    b = [2.0, 2.1, 2.2, 2.3]
    lines = histogram("TPOT (s)", [("A", a), ("B", b)], digits=1)
    head, rows = lines[0], lines[1:]
    assert head.split() == ["TPOT", "(s)", "A", "(n=4)", "B", "(n=4)"]
    assert len(rows) == bin_count(8) == 4
    assert rows[0].startswith("1.0") and rows[-1].split("–")[1].startswith("2.3")
    a_col, b_col = head.index("A (n=4)"), head.index("B (n=4)")
    # A's values sit in the low bins only, B's in the high ones.
    assert FULL in rows[0][a_col:b_col] and FULL not in rows[0][b_col:]
    assert FULL in rows[-1][b_col:] and FULL not in rows[-1][a_col:b_col]
    counts = [int(tok) for row in rows for tok in row.split()[1:] if tok.isdigit()]
    assert sum(counts) == 8


def test_histogram_edge_cases() -> None:
    assert histogram("TTFT (s)", [("x", [0.5])]) == []  # one value: nothing to draw
    assert histogram("TTFT (s)", [("A", []), ("B", [])]) == []
    same = histogram("TTFT (s)", [("x", [0.25, 0.25, 0.25])])
    assert len(same) == 2 and same[1].startswith("0.250 ") and same[1].endswith(" 3")
    # Narrow bins get more decimals, so the edges stay apart.
    narrow = histogram("TPOT (s)", [("x", [0.02211, 0.02214, 0.02219, 0.02223])], digits=4)
    edges = [row.split()[0] for row in narrow[1:]]
    assert len(set(edges)) == len(edges) and all(len(e.split("–")[0]) >= 7 for e in edges)
