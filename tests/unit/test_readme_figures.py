"""Every figure the README and the docs pages quote comes from a command, and each is checked here
against that command: the planner's figures by running `loom plan` as written, arithmetic by its
formula, and measured figures against the bench record the bench wrote (a speed is never timed in a
test: the bench measures it, the record keeps it, the docs quote the record). A figure the docs
change or a command whose answer drifts fails here with both numbers.

Each figure is written as the docs say it, the checked number in braces: "DDP needs {1120} GB per
GPU". The docs must contain the phrase (braces dropped, whitespace as one space), and the number
must be the command's within half a unit of its last digit or 1%, whichever is larger."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import readme

from loom.cli import main

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Figure:
    said: str                                   # as the docs say it, each checked number in {braces}
    source: str                                 # a `loom plan ...` command, or a bench record's path
    measured: tuple[Callable[[str], float], ...]  # per braced number: its value from the source's text


def _docs() -> str:
    """Every user page (tests/readme.py), whitespace as one space."""
    return " ".join(readme.text().split())


@functools.cache
def _output(source: str) -> str:
    """A `loom ...` command's stdout (run in this process), a record file's text, or none ("")."""
    if not source:
        return ""
    if not source.startswith("loom "):
        return (ROOT / source).read_text(encoding="utf-8")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(shlex.split(source)[1:]) in (0, None), source
    return out.getvalue()


def row(pattern: str, column: int = 1) -> Callable[[str], float]:
    """The number in a regex group of the command's output (its first line that matches)."""
    def find(text: str) -> float:
        m = re.search(pattern, text, re.MULTILINE)
        assert m, f"no line of the output matches {pattern!r}"
        return float(m.group(column).replace(",", ""))
    return find


def record(*keys: str | int) -> Callable[[str], float]:
    """A value of a JSON record, by its path of keys: a dict's key, a list's index, or `key=value`
    (`,`-joined for several) to pick the list item with those values."""
    def find(text: str) -> float:
        node = json.loads(text)
        for key in keys:
            if isinstance(key, str) and "=" in key:
                want = dict(term.split("=", 1) for term in key.split(","))
                node = next(item for item in node if all(str(item.get(k)) == v for k, v in want.items()))
            else:
                node = node[key]
        return float(node)
    return find


def value(number: float) -> Callable[[str], float]:
    """Arithmetic: the figure as its formula gives it."""
    return lambda _text: number


PLAN_70B = "loom plan --params 70e9 --recipe zero --gpu H100-SXM"
PLAN_70B_2 = "loom plan --params 70e9 --recipe zero --gpu H100-SXM --nodes 2"
PLAN_8B = "loom plan --model 8b --gpu H100-SXM --set train.batch_size=64 --set data.seq_len=2048"
LORA_70B = "loom plan --model 70b --gpu H100-SXM --gpus-per-node 8 --set lora.rank=16"
LORA_70B_1 = "loom plan --model 70b --gpu H100-SXM --gpus-per-node 1 --set lora.rank=16"
FULL_70B = "loom plan --model 70b --gpu H100-SXM --gpus-per-node 8"
RESULTS = "bench/results.json"
LORA = "bench/lora_results.json"


def _states(strategy: str, where: str = "GPU") -> Callable[[str], float]:
    """A row of the plan's "model states per GPU" table: its GPU (or host) GB."""
    return row(rf"^  {re.escape(strategy)}\s+GPU\s+([\d.]+)\s+host\s+([\d.]+)", 1 if where == "GPU" else 2)


# A candidate row: # name  mb×acc  GPU GB  act GB  host GB/node  comm  inter%  step s  tok/s  MFU  fits
COLUMNS = {"gpu": 0, "host": 2, "tok/s": 6}


def _candidate(name: str, column: str, recommended: bool = False) -> Callable[[str], float]:
    """A candidate row's column: the recommended one (marked *), else the first by that name."""
    def find(text: str) -> float:
        mark = r"\*" if recommended else "[* ]"
        for line in text.splitlines():
            if m := re.match(rf"^{mark}\s*\d+ {re.escape(name)}\s+\d+×\d+\s+(.*)$", line):
                return float(m.group(1).split()[COLUMNS[column]].replace(",", ""))
        raise AssertionError(f"no candidate row {name!r} in the plan")
    return find


FIGURES = [
    # The 70B example of the planner's page (a parameter count, the ZeRO paper's recipe).
    Figure("DDP needs {1120} GB per GPU, ZeRO-3 on 8 GPUs {140} GB", PLAN_70B,
           (_states("ddp"), _states("zero3"))),
    Figure("ZeRO-3 on 16 GPUs (`--nodes 2`) {70} GB", PLAN_70B_2, (_states("zero3"),)),
    Figure("optimizer offloaded {17.5} GB on each GPU plus {122.5} GB per GPU ({980} GB per node)", PLAN_70B,
           (_states("zero3 offload optimizer"), _states("zero3 offload optimizer", "host"),
            _candidate("zero3 offload optimizer", "host"))),
    Figure("ZeRO-Offload, and ties go to the torch engine): {3.8} GB on each GPU", PLAN_70B,
           (_candidate("zero3 offload optimizer+params", "gpu", recommended=True),)),
    # The engines: DeepSpeed frees its gradient partitions after each step.
    Figure("micro-batch 1 needs {45.6} GB on the torch engine, {41.7} GB on DeepSpeed", PLAN_8B,
           (_candidate("zero2", "gpu"), _candidate("zero2 on deepspeed", "gpu"))),
    # LoRA on a 70B.
    Figure("prices the frozen base at {141} GB and the adapters' states at {3.3} GB", LORA_70B,
           (row(r"the frozen base ([\d.]+) GB"), row(r"what trains ([\d.]+) GB"))),
    Figure("zero3 holds {18.1} GB per GPU of model states, ddp and zero1 {144} GB", LORA_70B,
           (_states("zero3"), _states("ddp"))),
    Figure("recommends `zero3 cp8 ring` ({52} GB per GPU, {11,807} tokens/s predicted", LORA_70B,
           (_candidate("zero3 cp8 ring", "gpu", recommended=True),
            _candidate("zero3 cp8 ring", "tok/s", recommended=True))),
    Figure("against {6,636} for full fine-tuning on that node", FULL_70B,
           (_candidate("zero3 cp4 ring offload optimizer+params", "tok/s", recommended=True),)),
    Figure("offload ({4}, zero3 with full checkpointing)", LORA_70B_1,
           (row(r"the fewest that fit are 1 node\(s\) × (\d+)"),)),
    # The loss chunk by chunk: bf16 logits 2 + their fp32 copy 4 + log-softmax 4 + fp32 gradients 4.
    Figure("{14} bytes per token per vocabulary entry", "", (value(2 + 4 + 4 + 4),)),
    Figure("{29} GB for Llama-3's 128k vocabulary at 2 × 8192 tokens", "",
           (value(14 * 128_256 * 2 * 8192 / 1e9),)),
    # Measured, from bench records.
    Figure("8 ranks × 100 MB of trace in {7.2} s with a {0.33} GB peak", RESULTS,
           (record("observability", "comparison=loom analyze of 8 × 100 MB traces", "seconds"),
            record("observability", "comparison=loom analyze of 8 × 100 MB traces", "peak_rss_gb"))),
]
CP = "bench/context_parallel_results.json"
MOE = "bench/moe_results.json"


def _case(case: str, key: str) -> Callable[[str], float]:
    """A bench record's row by its case."""
    return record("rows", f"case={case}", key)


def _ratio(case: str, key: str, case_below: str, key_below: str) -> Callable[[str], float]:
    """One row's value over another's (a share the docs quote)."""
    return lambda text: _case(case, key)(text) / _case(case_below, key_below)(text)


RING, A2A, EP2, EP2_DDP = "cp2 ring", "cp2 alltoall", "moe ep2", "moe ep2 ddp"
# The context-parallel and MoE benches (docs/long-context.md, docs/moe.md).
FIGURES += [
    Figure("no cp on one rank {1,037} tokens/s, activation peak {228.9} MiB; cp2 ring {2,128} tokens/s, "
           "{128.0} MiB ({0.559}×", CP,
           (_case("no cp", "tokens_per_s"), _case("no cp", "activation_peak_mib"),
            _case(RING, "tokens_per_s"), _case(RING, "activation_peak_mib"),
            _ratio(RING, "activation_peak_mib", "no cp", "activation_peak_mib"))),
    Figure("{1.04} of its plan, which prices wo's sequence-major copy of the split attention's output: "
           "1.12 before), exposed exchange {42} ms of {1,183} ms of attention per step ({0.04}; {997} ms "
           "hidden", CP,
           (_ratio(RING, "activation_peak_mib", RING, "activation_planned_mib"), _case(RING, "cp_exposed_ms"),
            _case(RING, "attention_ms"), _ratio(RING, "cp_exposed_ms", RING, "attention_ms"),
            _case(RING, "cp_hidden_ms"))),
    Figure("cp2 alltoall {2,053} tokens/s, {128.0} MiB, {104} ms exposed of {1,111} ms ({0.09}", CP,
           (_case(A2A, "tokens_per_s"), _case(A2A, "activation_peak_mib"), _case(A2A, "cp_exposed_ms"),
            _case(A2A, "attention_ms"), _ratio(A2A, "cp_exposed_ms", A2A, "attention_ms"))),
    Figure("the dense equivalent {4,504} tokens/s; zero3 ep 1 {1,994} and ep 2 {2,687}", MOE,
           tuple(_case(c, "tokens_per_s") for c in ("dense", "moe ep1", EP2))),
    Figure("ddp ep 1 {4,380} and ep 2 {3,506}. Expert states per rank under ddp: ep 2 ÷ ep 1 = {0.50} "
           "(under zero3 {1.00}", MOE,
           (_case("moe ep1 ddp", "tokens_per_s"), _case(EP2_DDP, "tokens_per_s"),
            _ratio(EP2_DDP, "expert_states_mib", "moe ep1 ddp", "expert_states_mib"),
            _ratio(EP2, "expert_states_mib", "moe ep1", "expert_states_mib"))),
    Figure("The all-to-all is {0.48} (zero3) and {0.36} (ddp) of the MoE blocks' forward", MOE,
           (_ratio(EP2, "a2a_in_forward_ms", EP2, "moe_forward_ms"),
            _ratio(EP2_DDP, "a2a_in_forward_ms", EP2_DDP, "moe_forward_ms"))),
]
PIPELINE = "bench/pipeline_schedules_results.json"


def _worst_rank(key: str, schedule: str, pp: int) -> Callable[[str], float]:
    """The pipeline bench's measured ÷ planned activation peak of the rank farthest from its plan."""
    def find(text: str) -> float:
        row = next(r for r in json.loads(text)[key] if r["schedule"] == schedule and r["pp"] == pp)
        ratios = [m / p for m, p in zip(row["activation_peak_mib"], row["activation_planned_mib"])]
        return max(ratios, key=lambda x: abs(x - 1))
    return find


def _schedule(key: str, schedule: str, pp: int, field: str) -> Callable[[str], float]:
    """A row of the pipeline bench's record (`rows`: pp 4, `own_cores`: pp 2); a per-rank list: its max."""
    def find(text: str) -> float:
        row = next(r for r in json.loads(text)[key] if r["schedule"] == schedule and r["pp"] == pp)
        value = row[field]
        return float(max(value) if isinstance(value, list) else value)
    return find


# README's pipeline-schedules table, row by row (the last column: the rank farthest from its plan).
FIGURES += [
    Figure(f"| {schedule} | {pp} | {{{tokens}}} | {{{bubble}}} | {{{planned}}} | {{{peak}}} "
           f"| {{{peak_plan}}} | {{{worst}}} |", PIPELINE,
           (*(_schedule("rows" if pp == 4 else "own_cores", schedule, pp, field) for field in (
               "tokens_per_s", "bubble_share", "planned_bubble", "activation_peak_mib",
               "activation_planned_mib")), _worst_rank("rows" if pp == 4 else "own_cores", schedule, pp)))
    for schedule, pp, tokens, bubble, planned, peak, peak_plan, worst in (
        ("gpipe", 4, "752", "0.35", "0.158", "60.7", "59.3", "1.03"),
        ("1f1b", 4, "750", "0.38", "0.158", "21.7", "21.3", "1.04"),
        ("interleaved", 4, "875", "0.35", "0.086", "36.8", "36.9", "0.98"),
        ("zb", 4, "680", "0.41", "0.035", "38.1", "39.2", "0.96"),
        ("zbv", 4, "738", "0.38", "0.007", "38.7", "40.2", "0.96"),
        ("dualpipev", 4, "896", "0.40", "0.065", "35.8", "36.2", "0.98"),
        ("1f1b", 2, "880", "0.17", "0.059", "24.2", "23.8", "1.02"),
        ("zbv", 2, "855", "0.20", "0.002", "42.6", "43.3", "0.98"))]


def _moe_schedule(schedule: str, field: str) -> Callable[[str], float]:
    """A row of the pipeline bench's MoE part (1f1b, dualpipev with its overlap off, dualpipev)."""
    return lambda text: float(next(r for r in json.loads(text)["moe"] if r["schedule"] == schedule)[field])


# README's DualPipeV-overlap table, row by row.
FIGURES += [
    Figure(f"| {label} | {{{tokens}}} | {{{wall}}} | {{{exposed}}} | {{{hidden}}} |", PIPELINE,
           tuple(_moe_schedule(schedule, field)
                 for field in ("tokens_per_s", "wall_ms", "ep_exposed_ms", "ep_hidden_ms")))
    for label, schedule, tokens, wall, exposed, hidden in (
        ("1f1b", "1f1b", "917", "4,428", "1,390", "0"),
        ("dualpipev, overlap off", "dualpipev, no overlap", "956", "4,498", "1,800", "0"),
        ("dualpipev", "dualpipev", "890", "4,758", "1,745", "837"))]
FIGURES.append(Figure("{837} ms of all-to-all per step now run under the other side's compute", PIPELINE,
                      (_moe_schedule("dualpipev", "ep_hidden_ms"),)))
# The LoRA bench's table, row by row: tokens/s full → LoRA, their ratio (the median of the pairs'),
# model states full → LoRA, their ratio, the peaks' ratio.
FIGURES += [
    Figure(f"| {strategy} {precision} | {{{full}}} → {{{lora}}} | {{{speed}}} "
           f"| {{{full_mib}}} → {{{lora_mib}}} | {{{states}}} | {{{peak}}} |", LORA,
           tuple(record("rows", f"strategy={strategy},precision={precision}", *path) for path in (
               ("full", "tokens_per_s"), ("lora", "tokens_per_s"), ("speed_ratio", "median"),
               ("full", "model_states_mib"), ("lora", "model_states_mib"), ("states_ratio",),
               ("peak_ratio",))))
    for strategy, precision, full, lora, speed, full_mib, lora_mib, states, peak in (
        ("zero3", "fp32", "1,427", "1,808", "1.27", "98.0", "29.3", "0.298", "0.93"),
        ("ddp", "fp32", "1,165", "1,433", "1.24", "196.1", "58.5", "0.298", "0.65"),
        ("zero3", "bf16", "1,259", "1,577", "1.31", "98.0", "17.0", "0.173", "0.67"),
        ("ddp", "bf16", "1,110", "1,484", "1.36", "196.1", "34.0", "0.173", "0.39"))]


MUON = "bench/muon_results.json"
MUON_8B = "loom plan --model 8b --gpu H100-SXM --set train.optimizer=muon"


def _muon(*path: str | int) -> Callable[[str], float]:
    return record("runs", *path)


def _adamw_final(text: str) -> float:
    """AdamW's final loss as the bench smooths it: the mean of the last 10 steps."""
    return sum(json.loads(text)["runs"]["adamw"]["losses"][-10:]) / 10


def _muon_steps_share(text: str) -> float:
    r = json.loads(text)
    return r["muon_steps_to_adamw_final"] / r["steps"]


def _muon_time(text: str) -> float:
    """Muon's time to AdamW's final loss over AdamW's whole run: steps × step time."""
    r = json.loads(text)
    return (r["muon_steps_to_adamw_final"] * r["runs"]["muon"]["step_ms"]
            / (r["steps"] * r["runs"]["adamw"]["step_ms"]))


def _ns_gflop_per_rank(_text: str) -> float:
    """The small preset's blocks: 5·(4m²n + 2m³) per m × n matrix (m ≤ n), over 2 owners."""
    def flops(m: int, n: int) -> int:
        return 5 * (4 * m * m * n + 2 * m ** 3)
    block = 2 * flops(256, 256) + 2 * flops(128, 256) + 3 * flops(256, 768)
    return 4 * block / 2 / 1e9


# The Muon bench (docs/muon.md) and plan (docs/planner.md).
FIGURES += [
    Figure("zero3 on 8 GPUs keeps {4.5} GB of optimizer states per GPU", MUON_8B,
           (row(r"^  zero3\s+GPU.*optimizer ([\d.]+)\)"),)),
    Figure("where AdamW keeps {8.0} GB", MUON_8B.replace(" --set train.optimizer=muon", ""),
           (row(r"^  zero3\s+GPU.*optimizer ([\d.]+)\)"),)),
    Figure("({6.98}B of its {8.03}B parameters are matrices)", MUON_8B,
           (row(r"muon: the blocks' matrices \(([\d.]+)B of"),
            row(r"muon: the blocks' matrices \([\d.]+B of ([\d.]+)B"))),
    Figure("final loss ({1.7673}, smoothed over 10 steps) at step {154} of {300}: {0.51}× the steps", MUON,
           (_adamw_final, record("muon_steps_to_adamw_final"), record("steps"), _muon_steps_share)),
    Figure("held-out loss at the end is {1.6211} against AdamW's {1.9604}", MUON,
           (_muon("muon", "eval_loss"), _muon("adamw", "eval_loss"))),
    Figure("states per rank are {6.51} MiB against {12.51} MiB: {0.520}×", MUON,
           (_muon("muon", "optimizer_mib", 0), _muon("adamw", "optimizer_mib", 0), record("states_ratio"))),
    Figure("phase takes {129.8} ms per step against AdamW's {12.5} ms: {10.42}× (goal ≤ 1.5×, missed; "
           "planned {160.3} ms)", MUON,
           (_muon("muon", "optimizer_ms"), _muon("adamw", "optimizer_ms"), record("time_ratio"),
            _muon("muon", "planned_optimizer_ms"))),
    Figure("the whole step {604} ms against {454} ms", MUON,
           (_muon("muon", "step_ms"), _muon("adamw", "step_ms"))),
    Figure("{9.5} GFLOP per rank per step", "", (_ns_gflop_per_rank,)),
    Figure("final loss in {0.68}× AdamW's time", MUON, (_muon_time,)),
]


def _numbers(said: str) -> list[str]:
    return re.findall(r"\{([^}]*)\}", said)


@pytest.mark.parametrize("figure", FIGURES, ids=lambda f: f.said[:40])
def test_the_docs_say_each_figure_as_its_command_gives_it(figure):
    plain = figure.said.replace("{", "").replace("}", "")
    assert plain in _docs(), f"no page says {plain!r}: the docs changed the figure; update it here or drop it"
    assert len(_numbers(figure.said)) == len(figure.measured)
    for number, measure in zip(_numbers(figure.said), figure.measured):
        said, got = float(number.replace(",", "")), measure(_output(figure.source))
        decimals = len(number.partition(".")[2])
        assert abs(said - got) <= max(0.5 * 10 ** -decimals, 0.01 * abs(got)), (
            f"the docs say {number} in {plain!r}; {figure.source or 'its formula'} gives {got:g}")


def test_each_figure_is_checked_once():
    said = [f.said for f in FIGURES]
    assert len(said) == len(set(said))
