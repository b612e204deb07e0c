"""`ds-inference bench predict`: the streamed and the accumulate-everything predict side by side. The ratios
and their spread are checked in-process on given runs; the command itself (four launches) in `make test-all`."""

import json
import subprocess

import pytest

from ds_inference_integration.tools.bench_predict import summarise


def run(path, scale, repeat, seconds, rss, sha="a", bleu=50.0):
    return {"path": path, "scale": scale, "repeat": repeat, "examples": 10 * scale, "seconds": seconds,
            "examples_per_s": 10 * scale / seconds, "peak_rss_mb": rss, "bleu": bleu, "predictions_sha": f"{sha}{scale}"}


def test_ratios_pair_each_repeats_runs_and_give_their_spread():
    runs = [run("streaming", 1, 0, 1.0, [100.0]), run("accumulating", 1, 0, 2.0, [110.0]),
            run("streaming", 10, 0, 10.0, [102.0, 101.0]), run("accumulating", 10, 0, 10.0, [150.0]),
            run("streaming", 1, 1, 1.0, [100.0]), run("accumulating", 1, 1, 1.0, [100.0]),
            run("streaming", 10, 1, 5.0, [100.0]), run("accumulating", 10, 1, 10.0, [200.0]),
            run("streaming", 1, 2, 1.0, [100.0]), run("accumulating", 1, 2, 4.0, [100.0]),
            run("streaming", 10, 2, 10.0, [110.0]), run("accumulating", 10, 2, 20.0, [100.0])]
    s = summarise(runs, [1, 10])
    r = s["ratios"]
    assert r["streaming_peak_rss_x10_over_x1"] == {"min": 1.0, "median": 1.02, "max": 1.1, "n": 3}  # worst rank
    assert r["accumulating_peak_rss_x10_over_x1"] == {"min": 1.0, "median": 1.3636, "max": 2.0, "n": 3}
    assert r["throughput_streaming_over_accumulating_x1"] == {"min": 1.0, "median": 2.0, "max": 4.0, "n": 3}
    assert r["throughput_streaming_over_accumulating_x10"] == {"min": 1.0, "median": 2.0, "max": 2.0, "n": 3}
    assert s["same_output"] and any("median 2.000 (min 1.000, max 4.000, 3 repeats)" in line for line in s["lines"])


def test_different_predictions_between_the_paths_fail_the_bench():
    runs = [run("streaming", 1, 0, 1.0, [100.0]), run("accumulating", 1, 0, 1.0, [100.0], sha="b")]
    assert not summarise(runs, [1])["same_output"]


@pytest.mark.slow  # four launches, about a minute: `make test-all` runs it
@pytest.mark.launched
def test_bench_predict_measures_both_paths_and_they_agree(tmp_path):
    from conftest import BIN

    proc = subprocess.run([str(BIN / "ds-inference"), "bench", "predict", "--scales", "1,2", "--repeats", "1",
                           "--max-examples", "12", "--batch-size", "5", "--output-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "bench_predict.json").read_text())
    assert report["same_output"] and len(report["runs"]) == 4
    assert {(r["path"], r["scale"], r["examples"]) for r in report["runs"]} == {
        ("streaming", 1, 12), ("accumulating", 1, 12), ("streaming", 2, 24), ("accumulating", 2, 24)}
    assert all(r["bleu"] is not None and r["peak_rss_mb"][0] > 0 for r in report["runs"])
    assert report["ratios"]["throughput_streaming_over_accumulating_x2"]["n"] == 1
