"""Bad-input cases: a folder of traces that are not one run's ranks (docs/bad-input.md, "Planner and
analysis inputs"): a rank's trace copied under another rank's name, and traces that record different
world sizes. Both would be analyzed as ranks of one run."""

from __future__ import annotations

import shutil
from pathlib import Path

from analysis_inputs import write_trace
from bad_input import Ctx, case, cli


def analyze(c: Ctx, folder: Path) -> str:
    return cli("analyze", str(folder), "--out", str(c.tmp / "out"), capsys=c.capsys)


@case("analyze-trace-copied-rank")
def _(c: Ctx) -> str:
    first = write_trace(c.tmp / "traces" / "rank0.json")
    shutil.copyfile(first, first.with_name("rank1.json"))
    return analyze(c, first.parent)


@case("analyze-trace-world-sizes")
def _(c: Ctx) -> str:
    info = {"backend": "gloo", "rank": 0, "world_size": 1, "pg_count": 1}
    write_trace(c.tmp / "traces" / "rank0.json", distributedInfo=info)
    write_trace(c.tmp / "traces" / "rank1.json", distributedInfo=dict(info, rank=1, world_size=4))
    return analyze(c, c.tmp / "traces")
