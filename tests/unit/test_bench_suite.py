"""`loom bench`'s machinery (bench/suite.py), without running a benchmark: pairs and their median
ratio, results.md with its goals and the missed goals' evidence, the README's generated section,
the plots, and the command's errors. The benchmarks themselves are never run by the tests."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import loom.cli

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import benchmarks  # noqa: E402
import harness  # noqa: E402
import suite  # noqa: E402


def test_a_pair_is_the_median_of_pairwise_ratios_not_of_the_medians():
    pair = harness.Pair(a=[10.0, 30.0, 20.0], b=[10.0, 20.0, 40.0])
    fig = pair.figure()
    assert pair.ratios == [1.0, 1.5, 0.5]
    assert fig["ratio"] == 1.0 and (fig["ratio_min"], fig["ratio_max"]) == (0.5, 1.5)
    assert fig["a_median"] / fig["b_median"] == 1.0  # here equal by chance; the figure is the ratios'
    assert fig["pairs"] == 3


def test_alternate_runs_the_sides_in_turn(tmp_path):
    order = []
    ctx = harness.Context(False, tmp_path, {"benches": {}}, harness.Progress(1), tmp_path)
    ctx.alternate(lambda: order.append("a") or 1.0, lambda: order.append("b") or 1.0, pairs=3)
    assert order == ["a", "b", "a", "b", "a", "b"]
    assert ctx.pairs == 5 and harness.Context(True, tmp_path, {}, harness.Progress(1), tmp_path).pairs == 2


def _results() -> dict:
    prov = {"measured_at": "2026-12-01 06:00 UTC", "commit": "abc1234", "machine": "2 cores", "torch": "2.13"}
    return {
        "meta": {"command": "loom bench", "quick": False, "provenance": prov, "pairs": 5, "minutes": 42.0},
        "benches": {
            "overhead": {
                "title": "Overhead",
                "goal": "≥ 0.97×",
                "notes": ["a note"],
                "plots": ["results_x.svg"],
                "rows": [
                    {
                        "strategy": "ddp",
                        "ratio": 1.004,
                        "goal_met": True,
                        "command": "loom train A",
                        "plain_command": "torchrun B",
                    },
                    {"strategy": "zero3", "ratio": 0.95, "goal_met": False, "command": "loom train C"},
                ],
                "missed": [{"what": "zero3: loom/plain 0.950", "evidence": "ledger forward 40%"}],
            },
            "gpu": {
                "title": "GPU",
                "goal": "< 8 min",
                "rows": [],
                "notes": [],
                "plots": [],
                "missed": [],
                "error": "no GPU",
            },
        },
    }


def test_results_md_lists_goals_missed_evidence_and_commands():
    md = suite.write_markdown(_results())
    assert "measured 2026-12-01 06:00 UTC at commit abc1234 on 2 cores" in md
    assert "| [Overhead](#overhead) | ≥ 0.97× | missed (1) |" in md
    assert "| [GPU](#gpu) | < 8 min | did not run: no GPU |" in md
    assert "- **Overhead**: zero3: loom/plain 0.950. ledger forward 40%" in md
    assert "| strategy | ratio | goal_met |" in md and "| zero3 | 0.95 | no |" in md
    assert "loom train A\nloom train C\ntorchrun B" in md  # every command, the plain side's too
    assert "![results_x.svg](results_x.svg)" in md and "- a note" in md


def test_the_readme_section_is_replaced_from_results_md(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n{suite.README_START}\nold\n{suite.README_END}\nafter\n")
    assert suite.update_readme(suite.write_markdown(_results()), readme)
    text = readme.read_text()
    assert "old" not in text and text.startswith("# x\n\nbefore\n") and text.endswith("after\n")
    assert "| [Overhead](bench/results.md#overhead) | ≥ 0.97× | missed (1) |" in text
    assert "zero3: loom/plain 0.950" in text
    other = tmp_path / "other.md"
    other.write_text("no markers\n")
    assert not suite.update_readme(suite.write_markdown(_results()), other)
    assert other.read_text() == "no markers\n"


def test_a_partial_run_replaces_its_benchmarks_and_keeps_the_others(tmp_path):
    import json

    path = tmp_path / "results.json"
    path.write_text(json.dumps(_results()))
    rerun = _results()
    rerun["meta"] = {**rerun["meta"], "command": "loom bench --only gpu",
                     "provenance": {**rerun["meta"]["provenance"], "commit": "def5678"}}
    gpu = {**rerun["benches"]["gpu"], "error": None, "rows": [{"tokens_per_s": 1.0}],
           "measured": {"command": "loom bench --only gpu", "provenance": rerun["meta"]["provenance"]}}
    rerun["benches"] = {"gpu": gpu}
    merged = suite.merge_results(path, rerun)
    assert list(merged["benches"]) == ["overhead", "gpu"]  # the suite's order
    assert merged["benches"]["overhead"] == _results()["benches"]["overhead"]
    assert merged["benches"]["gpu"]["rows"] == [{"tokens_per_s": 1.0}]
    md = suite.write_markdown(merged)
    assert md.count("at commit abc1234") == 1  # the page's header: the run that measured the rest
    header = md.split("\n")[2]
    assert "Measured since by `loom bench --only gpu`" in header and header.endswith(": GPU.")
    assert "Measured by `loom bench --only gpu`: measured 2026-12-01 06:00 UTC at commit def5678" in md
    quick = {**rerun, "meta": {**rerun["meta"], "quick": True}}
    assert list(suite.merge_results(path, quick)["benches"]) == ["gpu"]  # quick never mixes with full
    assert suite.merge_results(tmp_path / "none.json", rerun) is rerun


def test_the_plot_is_svg_with_a_line_per_series():
    svg = benchmarks.svg_lines(
        {"ddp": [(1, 50), (2, 50), (4, 50)], "zero3": [(1, 50), (2, 25), (4, 12.5)]},
        "MiB per rank",
        "ranks N",
    )
    root = ET.fromstring(svg)
    lines = root.findall("{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == 2
    ys = [float(p.split(",")[1]) for p in lines[1].get("points").split()]
    assert ys[0] < ys[1] < ys[2]  # zero3 falls: larger y is lower on the page


def test_every_benchmark_is_registered_and_planned():
    assert sorted(harness.REGISTRY) == sorted(suite.NAMES) and suite.NAMES[-1] == "gpu"
    assert [n for n, b in harness.REGISTRY.items() if b.gpu] == ["gpu"]
    assert all(suite.planned_runs(n, q) >= 1 for n in suite.NAMES for q in (True, False))


def test_bench_imports_go_one_way():
    """suite → benchmarks, gpu → harness: no benchmark module imports the runner."""
    for name in ("benchmarks.py", "gpu.py", "harness.py", "lora.py", "gpu_baselines.py", "cp_pieces.py"):
        text = (ROOT / "bench" / name).read_text()
        assert "import suite" not in text and "from suite" not in text, name
    assert "import benchmarks" not in (ROOT / "bench" / "harness.py").read_text()


def test_results_are_written_after_every_row(tmp_path):
    """A run cut short (a lease ending, a case hanging) still reports the rows it measured."""
    saved = []
    bench = {"rows": [], "notes": [], "missed": [], "plots": []}
    ctx = harness.Context(True, tmp_path, {"benches": {"gpu": bench}}, harness.Progress(1), tmp_path,
                          save=lambda: saved.append(len(bench["rows"])))
    ctx.bench = "gpu"
    ctx.row(case="a")
    ctx.row(case="b")
    assert saved == [1, 2]


def test_a_command_past_its_time_limit_fails_with_one_line(tmp_path):
    ctx = harness.Context(True, tmp_path, {"benches": {}}, harness.Progress(1), tmp_path)
    with pytest.raises(RuntimeError, match=r"did not finish in 1 s"):
        ctx.command([sys.executable, "-c", "import time; time.sleep(30)"], "sleep", timeout=1)


def test_loom_bench_rejects_an_unknown_name(capsys):
    assert loom.cli.main(["bench", "--only", "nope"]) == 2
    assert "unknown benchmark nope; choose from overhead" in capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is here")
def test_loom_bench_gpu_without_a_gpu_is_one_line(capsys):
    assert loom.cli.main(["bench", "--gpu"]) == 2
    assert "loom bench --gpu needs an NVIDIA GPU" in capsys.readouterr().err
