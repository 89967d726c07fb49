"""`loom plan --explain` against its recorded output (tests/data/explain_golden.txt), line for line.

The planner records each term as it computes it (loom/plan/terms.py); --explain renders the record.
The golden file was written by the explanation before that change (which recomputed the planner's
arithmetic itself) and then checked equal to the recorded one over 652 candidates: these cases keep
it so. A deliberate change of the planner's numbers or words rewrites the file:

    python tests/unit/test_plan_explain_golden.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from loom.plan import device
from loom.plan.candidate import Workload
from loom.plan.command import local_cluster
from loom.plan.explain import explain
from loom.plan.hardware import Cluster, lookup
from loom.plan.search import search
from loom.plan.shapes import from_params, from_preset

DATA = Path(__file__).resolve().parents[1] / "data"
GOLDEN = DATA / "explain_golden.txt"
SEPARATOR = "\n=====\n"


def cases() -> list[tuple[str, object, str]]:
    """(name, plan, candidate label): every branch of the memory, communication and time accounts."""
    h100, a100 = lookup("H100-SXM"), lookup("A100-40GB")
    cpu = local_cluster(device.load(DATA / "device_cpu.json"), 2)
    eight_b = search(Workload(from_preset("8b"), 8192, 128, "bf16", "torch", 512), Cluster(h100, 8, 1))
    once = search(Workload(from_preset("8b"), 4096, 64, "bf16", "torch", 0, False), Cluster(h100, 8, 2))
    seventy = search(Workload(from_params(70e9), 4096, 64, "bf16", "zero"), Cluster(h100, 8, 1))
    one_b = search(Workload(from_preset("1b"), 2048, 64, "fp32"), Cluster(a100, 4, 4))
    small = search(Workload(from_preset("small"), 256, 16, "fp32"), cpu)
    tiny = search(Workload(from_preset("tiny"), 128, 16, "bf16"), cpu)
    return [("8b zero3", eight_b, "zero3"), ("8b zero3 op", eight_b, "zero3 ac op"),
            ("8b zero2 tp2+sp", eight_b, "zero2 tp2+sp"), ("8b zero3 pp2", eight_b, "zero3 pp2 1f1b"),
            ("8b interleaved", eight_b, "zero1 tp2+sp pp2×v2 interleaved"),
            ("8b zero3 pp2 zb", eight_b, "zero3 pp2 zb"), ("8b zero3 pp2 zbv", eight_b, "zero3 pp2×v2 zbv"),
            ("8b deepspeed", eight_b, "zero3 on deepspeed"),
            ("8b 2 nodes hsdp, once", once, "hsdp(2×4) tp2+sp ac full"),
            ("8b 2 nodes zero1", once, "zero1 ac full"),
            ("70e9 offload", seventy, "zero3 offload optimizer+params"),
            ("70e9 nvme", seventy, "zero3 offload nvme"),
            ("1b 4 nodes ddp tp4", one_b, "ddp tp4+sp"),
            ("1b 4 nodes ddp pp4, its stages balanced", one_b, "ddp pp4 1f1b"),
            ("small cpu zero3", small, "zero3"),
            ("small cpu ddp selective", small, "ddp ac selective/2"), ("tiny cpu zero2 bf16", tiny, "zero2"),
            ("8b zero3 cp4 ring selective", eight_b, "zero3 cp4 ring ac selective/2"),
            ("small cpu zero3 cp2 alltoall", small, "zero3 cp2 alltoall")]


def render() -> str:
    texts = []
    for name, plan, label in cases():
        # a pipeline's label also names the stages' blocks the search balanced (" blocks 17/15")
        index = next((i for i, r in enumerate(plan.candidates)
                      if re.sub(r" blocks [\d/]+", "", r["label"]) == label), None)
        assert index is not None, f"{name}: no candidate {label!r} in the plan"
        texts.append(f"# {name}\n{explain(plan, index)}")
    return SEPARATOR.join(texts) + "\n"


def test_explain_renders_the_recorded_terms_as_before():
    want, got = GOLDEN.read_text().split(SEPARATOR), render().split(SEPARATOR)
    assert len(got) == len(want)
    for expected, actual in zip(want, got):
        assert actual == expected, (f"{actual.splitlines()[0]}: --explain changed; if the planner changed on "
                                    f"purpose: python tests/unit/test_plan_explain_golden.py")


def test_the_record_checks_itself():
    """Every section's parts add up to the candidate's record (the check lines), none disagree."""
    text = render()
    assert text.count("✓") == 3 * len(cases()) and "✗" not in text


if __name__ == "__main__":
    GOLDEN.write_text(render())
    print(f"wrote {GOLDEN}", file=sys.stderr)
