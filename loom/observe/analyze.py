"""`loom analyze`: traces → per-rank ledger → collectives across ranks → findings → table / JSON / HTML.

Works on any torch.profiler Chrome traces (one file per rank), loom's or not. When the traces sit
in a loom run directory (RUN_DIR/traces), its config, plan and measurements join the analysis:
each is optional, and one that is there but damaged or of the wrong types is one line naming the
file and the field (loom.checked), never a traceback or a report built on garbage. A mixture of
experts' routing comes from metrics.jsonl (`moe_*`, `ep_*`: `analysis["moe"]`, over the profiled
steps where summary.json maps them, else every logged step), its layout from config.toml
(`parallel.ep`, `model.moe_*`, else the preset's) and memory.json (`ep`, `ep_rank` per rank).
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import time
from pathlib import Path

import loom
from loom.checked import Fields, parse_json, read_json, read_text, read_toml
from loom.config import CP_MODES, MAX_EXPERTS
from loom.errors import LoomError
from loom.files import atomic_write, check_writable
from loom.observe.curves import read_curves
from loom.observe.diagnose import diagnose, moe_config, try_text
from loom.observe.ledger import analyze_dir
from loom.observe.report import render_report
from loom.observe.run_report import is_loom_report
from loom.observe.stragglers import find_stragglers, match_collectives


def analyze(trace_dir: Path) -> dict:
    analysis = analyze_dir(trace_dir)
    analysis["collectives"] = match_collectives(analysis["ranks"])
    analysis["stragglers"] = find_stragglers(analysis["collectives"], analysis["ranks"])
    run_dir = trace_dir.parent if trace_dir.name == "traces" else trace_dir
    config = run_config(run_dir / "config.toml")
    parallel = (config or {}).get("parallel", {})
    analysis["run"] = {"name": run_dir.name, "strategy": parallel.get("strategy"),
                       "world_size": len(analysis["ranks"])} | run_facts(run_dir, config, analysis)
    if config is not None:  # the layout's context parallelism and pipeline (the report's header, --compare)
        analysis["run"] |= {"cp": parallel.get("cp", 1), "cp_mode": parallel.get("cp_mode", "ring"),
                            "pp": parallel.get("pp", 1),
                            "pp_stage_layers": parallel.get("pp_stage_layers", [])}
    analysis["moe"] = analysis["run"].pop("_moe")
    analysis["plan"] = run_plan(run_dir / "plan.json")
    analysis["measured_vs_planned"] = measured_vs_planned(run_dir / "summary.json")
    analysis["pipeline_bubble"] = pipeline_bubble(analysis["ranks"], analysis["plan"])
    analysis["curves"] = read_curves(run_dir / "metrics.jsonl")  # the report's loss and tokens/s curves
    analysis["findings"] = diagnose(analysis, config)
    return analysis


# -- the run's records: absent is fine (any traces can be analyzed); present, they are typed -------

MAX_RECORD_BYTES = 64 << 20


def run_config(path: Path) -> dict | None:
    """The values of a run's config.toml that the analysis names (diagnose.py's findings: the
    layout that ran and current values; the report's header: model and batch)."""
    if not path.is_file():
        return None
    doc = Fields(read_toml(path), path)
    config: dict = {"parallel": {}, "data": {}}
    for section, keys in _CONFIG_KEYS.items():
        fields, out = doc.section(section, default={}), {}
        for key, (kind, low, high) in keys.items():
            if key not in fields:
                continue
            if kind is str:
                out[key] = fields.str(key, choices=low, nonempty=key != "init_from")
            elif kind is bool:
                out[key] = fields.bool(key)
            elif kind is list:  # of counts
                out[key] = fields.list(key, of=int, max_len=high)
            elif kind is int:
                out[key] = fields.int(key, min=low, max=high)
            else:  # sizes: ddp_bucket_mb above 0, fsdp_unit_mb 0 or more (0: one unit per module)
                out[key] = fields.float(key, min=low, min_open=key == "ddp_bucket_mb", max=high)
        if out or section in config:
            config[section] = out
    return config


# What run_config reads: section -> key -> (type, low, high); text: (str, the choices or None, None).
_TEXT, _COUNT = (str, None, None), (int, 0, 1 << 20)
_CONFIG_KEYS = {
    # the model's shape: the heads (cp's exchange), and for a pipeline's balanced split every count
    "model": {"preset": _TEXT, "n_heads": _COUNT, "n_kv_heads": _COUNT, "n_layers": _COUNT,
              "init_from": _TEXT, "vocab_size": _COUNT, "d_model": _COUNT, "ffn_hidden": _COUNT,
              "tie_embeddings": (bool, None, None), "moe_every": _COUNT, "moe_dense_first": _COUNT,
              "moe_ffn_hidden": _COUNT, "moe_shared_experts": _COUNT,
              "moe_experts": (int, 0, MAX_EXPERTS), "moe_top_k": (int, 1, MAX_EXPERTS),
              "moe_aux_loss_coef": (float, 0, 1e6), "moe_bias_update_rate": (float, 0, 1e6),
              "moe_capacity_factor": (float, 0, 1e6)},
    "data": {"num_workers": (int, 0, 4096), "seq_len": _COUNT},
    "parallel": {"strategy": _TEXT, "engine": _TEXT, "fsdp_prefetch": (int, 0, 1024),
                 "fsdp_unit_mb": (float, 0, 1e6), "ddp_bucket_mb": (float, 0, 1e6), "tp": _COUNT,
                 "pp": _COUNT, "pp_schedule": _TEXT, "microbatches": _COUNT, "cp": _COUNT,
                 "pp_virtual_stages": _COUNT, "pp_stage_layers": (list, None, 1 << 16),
                 "cp_mode": (str, CP_MODES, None), "ep": (int, 1, 1 << 20)},
    "train": {"batch_size": _COUNT, "grad_accum": _COUNT, "precision": _TEXT, "optimizer_impl": _TEXT},
}


def run_facts(run_dir: Path, config: dict | None, analysis: dict) -> dict:
    """What the report's header says about the run: model, batch, loss, per-rank peak memory,
    a mixture of experts (experts, top-k, ep), when it was profiled, loom's commit and the trace
    files (each only where known); and, as `_moe`, its routing over the analysed steps."""
    cfg = config or {}
    model, data, train = cfg.get("model", {}), cfg.get("data", {}), cfg.get("train", {})
    memory = run_memory(run_dir / "memory.json")
    facts: dict = {"model": model.get("preset"), "params": memory.get("num_params"),
                   "peak_memory_bytes": memory.get("peak_bytes") or None,
                   "precision": train.get("precision"), "commit": loom_commit()}
    if "batch_size" in train:
        facts["batch"] = (f"{train['batch_size']} sequences" + (f" × {data['seq_len']} tokens"
                                                               if "seq_len" in data else "")
                          + (f", grad_accum {train['grad_accum']}" if train.get("grad_accum", 1) > 1 else ""))
    # per rank its trace files (several where a repeating schedule wrote more than one: "a; b")
    facts["traces"] = {r: info["trace"].split("; ") for r, info in sorted(analysis["ranks"].items(),
                                                                       key=lambda kv: int(kv[0]))
                       if info.get("trace")}
    stamps = [Path(t).stat().st_mtime for ts in facts["traces"].values() for t in ts if Path(t).is_file()]
    if stamps:
        facts["profiled_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(max(stamps)))
    profiled = {s["step"] for info in analysis["ranks"].values() for s in info.get("steps", [])}
    facts["loss"], facts["_moe"] = run_metrics(run_dir / "summary.json", run_dir / "metrics.jsonl", profiled)
    experts = moe_config(cfg) if config is not None else {}
    tokens = (facts["_moe"] or {}).get("expert_tokens")
    if experts.get("experts") or tokens:  # a mixture of experts: config.toml's, else metrics.jsonl's
        facts["moe"] = {"top_k": None, **experts, "experts": experts.get("experts") or len(tokens)}
    ep = cfg.get("parallel", {}).get("ep", memory.get("ep", 1 if config is not None else None))
    if ep is not None:
        facts["ep"] = ep
    if memory.get("ep_ranks"):
        facts["ep_ranks"] = memory["ep_ranks"]
    return facts


def loom_commit() -> str | None:
    """The git commit of the loom checkout doing the analysis (`+` when it has changes), if any."""
    root = Path(loom.__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=10", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if sha.returncode != 0 or not sha.stdout.strip():
        return None
    return sha.stdout.strip() + ("+" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def run_memory(path: Path) -> dict:
    """memory.json's parameter count, per-rank peak bytes and, under expert parallelism, the ep
    degree and each rank's place among its ep ranks ({} when absent)."""
    if not path.is_file():
        return {}
    ranks = Fields(read_json(path, max_bytes=MAX_RECORD_BYTES), path).section("ranks", default={})
    out: dict = {"peak_bytes": {}}
    for rank in ranks.keys():
        row = ranks.section(rank)
        if row.raw.get("peak_bytes") is not None:
            out["peak_bytes"][rank] = row.int("peak_bytes", min=0)
        if row.raw.get("num_params") is not None:
            out["num_params"] = row.int("num_params", min=0)
        if row.raw.get("ep") is not None or row.raw.get("ep_rank") is not None:
            ep = row.int("ep", min=1, max=1 << 20)  # one without the other is a damaged record
            if out.setdefault("ep", ep) != ep:
                raise row.error("ep", f"the ep of every rank ({out['ep']}, as an earlier rank says)", ep)
            out.setdefault("ep_ranks", {})[rank] = row.int("ep_rank", min=0, max=ep - 1)
    return out


def run_metrics(summary: Path, metrics: Path, profiled: set) -> tuple[dict, dict | None]:
    """First, final and eval loss (summary.json) and the profiled steps' losses (metrics.jsonl);
    and a mixture of experts' routing (`run_moe`). The profiler starts before a run's first step, so
    its ProfilerStep#N is training step start_step + N + 1; without summary.json that mapping is
    unknown and the losses are left out (the routing is then every logged step's)."""
    out: dict = {}
    known = summary.is_file()
    start = 0
    if known:
        doc = Fields(read_json(summary, max_bytes=MAX_RECORD_BYTES), summary)
        for key in ("first_loss", "final_loss", "eval_loss"):
            if doc.raw.get(key) is not None:
                out[key.removesuffix("_loss")] = doc.float(key)
        start = doc.int("start_step", min=0, default=0)
    profiled = {start + n + 1 for n in profiled if isinstance(n, int) and n >= 0}
    if not known:
        profiled = set()
    if not metrics.is_file():
        return out, None
    steps, routed = {}, []
    for i, line in enumerate(read_text(metrics, max_bytes=MAX_RECORD_BYTES).splitlines()):
        if not line.strip():
            continue
        row = Fields(parse_json(line, f"{metrics}:{i + 1}"), f"{metrics}:{i + 1}")
        step = row.int("step", min=0) if "step" in row else None
        if step in profiled and row.raw.get("loss") is not None:
            steps[str(step)] = row.float("loss")
        if any(row.raw.get(k) is not None for k in MOE_FIELDS):
            routed.append((step, row))
    if steps:
        out["profiled_steps"] = steps
    return out, run_moe(routed, profiled)


# metrics.jsonl's fields of a mixture of experts (written for MoE runs only; loom/train/moe_step.py,
# loom/parallel/expert_parallel.py's tally)
MOE_FIELDS = ("moe_aux_loss", "moe_load_imbalance", "moe_expert_tokens", "moe_dropped", "ep_bytes",
              "ep_wait_s")


def run_moe(rows: list[tuple[int | None, Fields]], profiled: set) -> dict | None:
    """A mixture of experts' routing over the analysed steps: the profiled ones where metrics.jsonl
    logs them, else every logged step. Medians per step (aux loss, load imbalance, dropped choices
    and their percent of the tokens × top-k routed, ep bytes and host wait), tokens per expert summed
    over the steps; None for a dense run. Each row's fields are typed (one line otherwise), and
    consistent: as many experts in every row, no more dropped choices than routed ones."""
    chosen = [(step, row) for step, row in rows if step in profiled]
    rows = chosen or rows
    if not rows:
        return None
    values: dict[str, list] = {k: [] for k in (*MOE_FIELDS, "dropped_pct")}
    experts = None
    for _, row in rows:
        for key in ("moe_aux_loss", "ep_wait_s"):
            if row.raw.get(key) is not None:
                values[key].append(row.float(key, min=0))
        if row.raw.get("moe_load_imbalance") is not None:  # max over blocks of busiest / mean: ≤ experts
            values["moe_load_imbalance"].append(row.float("moe_load_imbalance", min=0, max=MAX_EXPERTS))
        for key in ("moe_dropped", "ep_bytes"):
            if row.raw.get(key) is not None:
                values[key].append(row.int(key, min=0))
        if row.raw.get("moe_expert_tokens") is None:
            continue
        tokens = row.list("moe_expert_tokens", of=int, max_len=MAX_EXPERTS)
        if not tokens or min(tokens) < 0:
            raise row.error("moe_expert_tokens", "a non-empty list of integers ≥ 0 (tokens per expert)",
                            tokens)
        if experts is not None and len(tokens) != experts:
            raise row.error("moe_expert_tokens", f"a list of {experts} counts, as on the lines before it "
                            "(one per expert)", tokens)
        experts = len(tokens)
        values["moe_expert_tokens"].append(tokens)
        if row.raw.get("moe_dropped") is not None:
            dropped = row.raw["moe_dropped"]
            if dropped > sum(tokens):
                raise row.error("moe_dropped", f"at most the {sum(tokens):,} choices routed "
                                "(sum of moe_expert_tokens)", dropped)
            if sum(tokens):
                values["dropped_pct"].append(100 * dropped / sum(tokens))

    def median(key: str):
        return statistics.median(values[key]) if values[key] else None

    tokens = values["moe_expert_tokens"]
    return {"steps": sorted({step for step, _ in rows if step is not None}), "profiled": bool(chosen),
            "aux_loss": median("moe_aux_loss"), "load_imbalance": median("moe_load_imbalance"),
            "dropped": median("moe_dropped"), "dropped_pct": median("dropped_pct"),
            "expert_tokens": [sum(col) for col in zip(*tokens)] if tokens else None,
            "ep_bytes": median("ep_bytes"), "ep_wait_s": median("ep_wait_s")}


def run_plan(path: Path) -> dict | None:
    """plan.json as written, once the fields the report reads are of their types."""
    if not path.is_file():
        return None
    doc = Fields(read_json(path, max_bytes=MAX_RECORD_BYTES), path)
    for key in ("label", "strategy"):
        if key in doc:
            doc.str(key)
    for key in ("step_time_s", "comm_payload_bytes_per_step", "comm_bytes_per_step", "pipeline_bubble"):
        _number_or_null(doc, key)
    if isinstance(doc.raw.get("memory_bytes"), dict):
        _number_or_null(doc.section("memory_bytes"), "total")
    else:
        _number_or_null(doc, "memory_bytes")
    return doc.raw


def measured_vs_planned(path: Path) -> list[dict] | None:
    """summary.json's measured-vs-planned rows: per rank, [measured, planned] pairs of numbers."""
    if not path.is_file():
        return None
    rows = Fields(read_json(path, max_bytes=MAX_RECORD_BYTES), path).list("measured_vs_planned", default=None)
    for i, raw in enumerate(rows or []):
        row = Fields(raw, path, f"measured_vs_planned[{i}]")
        for key in row.keys():
            if key == "rank":
                row.int(key, min=0)
            elif key == "comm_by_kind":
                kinds = row.section(key)
                for kind in kinds.keys():
                    per_kind = kinds.section(kind)
                    for part in per_kind.keys():
                        _pair(per_kind, part)
            else:
                _pair(row, key)
    return rows


def _number_or_null(doc: Fields, key: str) -> None:
    if doc.raw.get(key) is not None:
        doc.float(key, min=0)


def _pair(doc: Fields, key: str) -> None:
    """[measured, planned]: two finite numbers, either one null (not measured, not planned)."""
    pair = doc.list(key)
    if len(pair) != 2:
        raise doc.error(key, "a [measured, planned] pair", pair)
    for value in pair:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            raise doc.error(key, "a [measured, planned] pair of finite numbers (or null)", pair)


def pipeline_bubble(ranks: dict, plan: dict | None) -> list[dict] | None:
    """Per pipeline rank, the median measured bubble share of its steps beside the planned bubble
    fraction (plan.json's `pipeline_bubble`, as the planner priced the run's schedule) and their ratio.
    None without a pipeline in the traces."""
    planned = (plan or {}).get("pipeline_bubble")
    planned = float(planned) if type(planned) in (int, float) and math.isfinite(planned) else None
    rows = []
    for rank, info in sorted(ranks.items(), key=lambda kv: int(kv[0])):
        shares = [s["shares"]["bubble"] / 100 for s in info.get("steps", []) if "bubble" in s["shares"]]
        if not shares:
            continue
        measured = statistics.median(shares)
        ratio = measured / planned if planned else None
        rows.append({"rank": int(rank), "measured": round(measured, 4), "planned": planned,
                     "ratio": round(ratio, 2) if ratio is not None else None})
    return rows or None


def render_table(analysis: dict) -> str:
    # context parallelism's exchange: its part of the exposed and hidden comm, where a rank had one
    cp = any("cp_exposed_ms" in s for info in analysis["ranks"].values() for s in info.get("steps", []))
    # and expert parallelism's all-to-alls
    ep = any("ep_exposed_ms" in s for info in analysis["ranks"].values() for s in info.get("steps", []))
    # a pipeline's bubble (part of comm exp and idle) and zero-bubble B / W phases
    pp = any("bubble_ms" in s for info in analysis["ranks"].values() for s in info.get("steps", []))
    lines = [(f"{'rank':>4} {'step':>5} {'wall ms':>9} {'compute':>8} {'comm exp':>9} {'io':>6} {'idle':>6} "
              f"{'hidden ms':>9} {'overlap':>7} {'fwd ms':>8} {'bwd ms':>8} {'opt ms':>8}"
              + (f" {'cp exp ms':>9} {'cp hid ms':>9}" if cp else "")
              + (f" {'ep exp ms':>9} {'ep hid ms':>9}" if ep else "")
              + (f" {'bubble':>7} {'B ms':>8} {'W ms':>8}" if pp else ""))]
    # files skipped as no trace: said, or a rank's file that is not a trace vanishes from the table
    lines += [f"  warning: {w}" for w in analysis.get("warnings", [])]
    for rank, info in sorted(analysis["ranks"].items(), key=lambda kv: int(kv[0])):
        for w in info.get("warnings", []):
            lines.append(f"  rank {rank}: warning: {w}")
        for s in info.get("steps", []):
            sh = s["shares"]
            lines.append(f"{rank:>4} {s['step']:>5} {s['wall_ms']:9.1f} {sh['compute']:7.1f}% "
                         f"{sh['comm_exposed']:8.1f}% {sh['io']:5.1f}% {sh['idle']:5.1f}% "
                         f"{s['comm_hidden_ms']:9.1f} {s['overlap_pct']:6.0f}% "
                         f"{s['forward_ms']:8.1f} {s['backward_ms']:8.1f} {s['optimizer_ms']:8.1f}"
                         + (f" {s.get('cp_exposed_ms', 0.0):9.1f} {s.get('cp_hidden_ms', 0.0):9.1f}"
                            if cp else "")
                         + (f" {s.get('ep_exposed_ms', 0.0):9.1f} {s.get('ep_hidden_ms', 0.0):9.1f}"
                            if ep else "")
                         + (f" {sh.get('bubble', 0.0):6.1f}% {s.get('backward_input_ms', 0.0):8.1f}"
                            f" {s.get('backward_weight_ms', 0.0):8.1f}" if pp else ""))
    kinds: dict[str, list[float]] = {}
    for info in analysis["ranks"].values():
        for c in info.get("collectives", []):
            k = kinds.setdefault(c["kind"], [0, 0, 0.0])
            k[0] += 1
            k[1] += c.get("bytes") or 0
            k[2] += c.get("duration_ms", 0.0)
    if kinds:
        lines.append("\ncollectives (all ranks): " + "; ".join(
            f"{k} ×{n}, {b / 2**20:.1f} MiB, {ms:.1f} ms" for k, (n, b, ms) in sorted(kinds.items())))
    for s in analysis.get("stragglers", []):
        lines.append(f"straggler: {s['evidence']}")
    bubble = analysis.get("pipeline_bubble")
    if bubble:
        lines.append("\npipeline bubble (median share of the step; planned: plan.json's pipeline_bubble):")
        for b in bubble:
            planned = f"{b['planned']:.3f}" if b["planned"] is not None else "—"
            ratio = f"{b['ratio']:.2f}×" if b["ratio"] is not None else "—"
            lines.append(f"  rank {b['rank']}: measured {b['measured']:.3f}  planned {planned}  "
                         f"ratio {ratio}")
    moe = analysis.get("moe")
    if moe:
        parts = [f"{label} {fmt.format(moe[key])}" for key, label, fmt in (
            ("load_imbalance", "load imbalance", "{:.2f}"), ("aux_loss", "aux loss", "{:.4g}"),
            ("dropped_pct", "dropped", "{:.2f}%"), ("ep_bytes", "ep bytes", "{:,.0f}"),
            ("ep_wait_s", "ep wait s", "{:.4f}")) if moe.get(key) is not None]
        lines.append(f"\nexperts (median over {len(moe['steps'])} "
                     f"{'profiled' if moe['profiled'] else 'logged'} step(s)): " + (", ".join(parts) or "—"))
    findings = analysis.get("findings", [])
    lines.append("\nfindings:" if findings else "\nfindings: none (compute-bound, nothing to fix)")
    for i, f in enumerate(findings, 1):
        lines += [f"{i}. {f['title']}", f"   evidence: {f['evidence']}", f"   cause:    {f['cause']}",
                  f"   {'try:   ' if f.get('knob') else 'do:    '}   {try_text(f)}",
                  f"   expect:   {f['expected_effect']}"]
    return "\n".join(lines)


OUTPUTS = ("ledger.json", "report.html")


def check_outputs(out_dir: Path, overwrite: bool) -> None:
    """ledger.json and report.html replace only loom analyze's own earlier ones (or, under
    --overwrite, any): a file of those names that is the user's stays, and the command says so (a
    symbolic link there is replaced, its target untouched, as every write of loom's does)."""
    for name in () if overwrite else OUTPUTS:
        path = out_dir / name
        if path.exists() and not path.is_symlink() and not _written_by_analyze(path):
            raise LoomError(f"{path} exists and is not one loom analyze wrote; loom analyze writes "
                            f"{' and '.join(OUTPUTS)} there: pass --overwrite to replace it, or --out a "
                            f"folder for them")


def check_out_writable(out_dir: Path, command: str = "loom analyze") -> None:
    """Its outputs can be written to `out_dir` (or where it would be made): a read-only trace folder
    is told before the analysis runs, not by a traceback after it."""
    folder = next(p for p in (out_dir, *out_dir.parents) if p.exists())
    what = f"{command}'s output folder" if folder == out_dir else f"{out_dir}'s parent folder"
    check_writable(folder, what)


def _written_by_analyze(path: Path) -> bool:
    """Recognisably loom's: a page's title (analyze's, or the run's own report.html), or a ledger's
    top-level record."""
    if not path.is_file():
        return False
    if path.name == "report.html":  # the ledger report, or the run's own (loom/observe/run_report.py)
        return is_loom_report(path)
    try:
        if path.stat().st_size > MAX_RECORD_BYTES:
            return False
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and {"ranks", "collectives", "stragglers", "findings"} <= doc.keys()


def write_outputs(analysis: dict, out_dir: Path) -> tuple[Path, Path]:
    """ledger.json and report.html beside the traces' run."""
    ledger = out_dir / "ledger.json"
    atomic_write(ledger, json.dumps(analysis, indent=1).encode())  # replaces a planted link, never follows it
    return ledger, render_report(analysis, out_dir / "report.html")
