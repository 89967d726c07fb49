"""`loom analyze --compare RUN_A RUN_B`: two analyses side by side, and why B's step differs from A's.

Everything is per profiled step (the mean over all steps of all ranks, as diagnose.py reads a
ledger) so that runs with different step counts or rank counts compare. The "why" follows
diagnose.py's order: the compute share first, then the phase (forward / backward / optimizer /
data) holding most of the step-time difference, then the op, kernel or collective that grew most
in that phase. The config key it names comes from the runs' own findings (diagnose.py), never
from a table of its own; where the runs' layouts differ (context parallelism's cp / cp_mode, expert
parallelism's ep, a mixture of experts' model.moe_* keys), that key is the difference made.

The ledger does not record which phase an op ran in, so an op is placed by its name (Backward,
bwd, grad → backward; optimizer, adam, multi_tensor_apply → optimizer); an op whose name says
nothing may explain any phase.
"""

from __future__ import annotations

import json
import statistics
import textwrap
from pathlib import Path

from loom.errors import LoomError
from loom.files import atomic_write
from loom.observe.analyze import analyze
from loom.observe.diagnose import toml_value, try_text
from loom.observe.ledger import PHASES, TOP_OPS, collective_kind
from loom.observe.report import _CSS, _e, _section, _table, size_text

SHARES = (("compute", "compute"), ("comm_overlapped", "comm overlapped"), ("comm_exposed", "comm exposed"),
          ("io", "IO"), ("idle", "idle"))
# The parts that partition a step (comm overlapped runs under compute, so it is inside compute).
PARTS = (("compute", "compute_ms"), ("comm_exposed", "comm_exposed_ms"), ("io", "io_ms"), ("idle", "idle_ms"))
PHASE_NAMES = (*PHASES, "other")
TOP_CHANGED = 10
SAME_STEP = 0.02  # |B/A - 1| below this: the steps match
SHARE_POINTS = 2.0  # a share moving less than this many points has not changed

_WHY_LABEL = {"comm_exposed": "exposed communication", "io": "IO", "idle": "idle time"}
# Name hints placing an op in a phase, checked in this order (zero_grad is the optimizer's).
_OP_PHASE_HINTS = (("optimizer", ("optimizer", "adam", "sgd", "multi_tensor_apply", "zero_grad", "_foreach_",
                                  "clip_grad")),
                   ("backward", ("backward", "bwd", "grad", "autograd::")),
                   ("forward", ("forward", "fwd")),
                   ("data", ("dataloader", "loom/data")))
# Where a collective of each kind can run in a training step; a kind not listed may run anywhere.
_COLLECTIVE_PHASES = {"reduce_scatter": ("backward", "other"), "all_gather": ("forward", "backward", "other"),
                      "all_reduce": ("backward", "optimizer", "other"),
                      # context parallelism's exchanges run in attention, forward and backward
                      "cp_ring": ("forward", "backward", "other"),
                      "cp_alltoall": ("forward", "backward", "other"),
                      # expert parallelism's dispatch and combine run in the MoE blocks, both ways
                      "ep_alltoall": ("forward", "backward", "other")}
# Which findings (diagnose.py categories) speak to a part, phase or culprit of the difference.
# An expert load finding ("moe") speaks to exposed comm: under ep the ranks wait for the busiest experts.
_CATEGORIES = {"comm_exposed": ("comm", "straggler", "imbalance", "moe"), "io": ("io",),
               "idle": ("idle", "sync"), "optimizer": ("optimizer",), "data": ("io",),
               "collective": ("comm", "straggler", "imbalance", "moe"),
               "sync": ("sync",), "op": ("kernels",)}
_SYNC_OPS = ("aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize")


def _mean(values) -> float:
    values = list(values)
    return statistics.fmean(values) if values else 0.0


def op_phase(name: str) -> str | None:
    """The phase an op or kernel's name places it in (None: the name does not say)."""
    low = name.lower()
    for phase, hints in _OP_PHASE_HINTS:
        if any(h in low for h in hints):
            return phase
    return None


def _is_comm(name: str) -> bool:
    return collective_kind(name) is not None or name.startswith(("record_param_comms", "c10d::", "gloo:"))


# -- one analysis, per step ---------------------------------------------------------------------

def summarize(analysis: dict) -> dict:
    """One analysis as means per profiled step: wall, shares, parts, phases, collectives, ops."""
    ranks = analysis.get("ranks") or {}
    steps = [s for info in ranks.values() for s in info.get("steps") or []]
    timed = [s for s in steps if s.get("wall_ms", 0) > 0]
    shares = {k: _mean(s["shares"].get(k, 0.0) for s in timed) for k, _ in SHARES if k != "comm_overlapped"}
    shares["comm_overlapped"] = _mean(100 * s.get("comm_hidden_ms", 0.0) / s["wall_ms"] for s in timed)
    phases = {p: _mean(s.get(f"{p}_ms", 0.0) for s in timed) for p in PHASES}
    phases["other"] = _mean(max(0.0, s["wall_ms"] - sum(s.get(f"{p}_ms", 0.0) for p in PHASES))
                            for s in timed)

    stepped = [info for info in ranks.values() if info.get("steps")]
    kinds: dict[str, dict] = {}
    ops: dict[str, dict] = {}
    for info in stepped:
        n = len(info["steps"])
        for c in info.get("collectives") or []:
            if c.get("step") is None:  # outside every profiled step
                continue
            k = kinds.setdefault(c["kind"], {"count": 0.0, "bytes": None, "ms": 0.0})
            k["count"] += 1 / n
            if c.get("bytes") is not None:  # None: profiled without record_shapes
                k["bytes"] = (k["bytes"] or 0.0) + c["bytes"] / n
            k["ms"] += c.get("duration_ms", 0.0) / n
        for op in info.get("top_ops") or []:
            o = ops.setdefault(op["name"], {"ms": 0.0, "count": 0.0})
            o["ms"] += op.get("self_ms", op["total_ms"]) / n  # self: nested ops counted once
            o["count"] += op["count"] / n
    for table in (kinds, ops):  # per rank-step: the mean over ranks (a rank without it counts 0)
        for v in table.values():
            for key in v:
                v[key] = None if v[key] is None else v[key] / len(stepped)
    run = analysis.get("run") or {}
    kind = "/".join(sorted({info.get("kind") for info in ranks.values() if info.get("kind")})) or None
    return {"name": run.get("name"), "strategy": run.get("strategy"), "ranks": len(ranks),
            "steps": len(timed), "kind": kind, "cp": run.get("cp"), "cp_mode": run.get("cp_mode"),
            "pp": run.get("pp"), "pp_stage_layers": run.get("pp_stage_layers"),
            # a mixture of experts (analyze.py's run facts); with config.toml read (cp known), a dense run
            "ep": run.get("ep"),
            "moe": run.get("moe") or ({"experts": 0} if run.get("cp") is not None else None),
            "wall_ms": _mean(s["wall_ms"] for s in timed),
            "parts_ms": {k: _mean(s.get(key, 0.0) for s in timed) for k, key in PARTS},
            "shares": shares, "phases": phases, "collectives": kinds, "ops": ops,
            "findings": [f for f in analysis.get("findings") or [] if isinstance(f, dict)]}


def _ratio(a: float, b: float) -> float | None:
    return round(b / a, 4) if a > 0 else None


# -- the comparison -----------------------------------------------------------------------------

def compare(analysis_a: dict, analysis_b: dict) -> dict:
    """A vs B (each what `loom.observe.analyze.analyze` returns). All times are ms per profiled
    step (mean over ranks), shares percent of the step; `why` holds the explanation as text and
    as its parts."""
    a, b = summarize(analysis_a), summarize(analysis_b)
    warnings = [f"{label} has no profiled steps: nothing to compare" for label, s in (("A", a), ("B", b))
                if not s["steps"]]
    if a["kind"] and b["kind"] and a["kind"] != b["kind"]:
        warnings.append(f"A's traces are {a['kind']} and B's {b['kind']}: their ops and kernels differ by "
                        "nature")
    if a["ranks"] != b["ranks"]:
        warnings.append(f"A has {a['ranks']} rank(s) and B {b['ranks']}: collectives per rank differ by "
                        "design")
    shares = {k: {"a": round(a["shares"][k], 2), "b": round(b["shares"][k], 2),
                  "delta": round(b["shares"][k] - a["shares"][k], 2)} for k, _ in SHARES}
    parts = {k: {"a_ms": a["parts_ms"][k], "b_ms": b["parts_ms"][k],
                 "delta_ms": b["parts_ms"][k] - a["parts_ms"][k]} for k, _ in PARTS}
    phases = {p: {"a_ms": a["phases"][p], "b_ms": b["phases"][p], "delta_ms": b["phases"][p] - a["phases"][p],
                  "ratio": _ratio(a["phases"][p], b["phases"][p])} for p in PHASE_NAMES}
    collectives = {}
    empty = {"count": 0.0, "bytes": 0.0, "ms": 0.0}
    for kind in sorted(set(a["collectives"]) | set(b["collectives"])):
        ca, cb = a["collectives"].get(kind, empty), b["collectives"].get(kind, empty)
        sized = ca["bytes"] is not None and cb["bytes"] is not None
        collectives[kind] = {"a": ca, "b": cb, "delta_ms": cb["ms"] - ca["ms"],
                             "delta_bytes": cb["bytes"] - ca["bytes"] if sized else None,
                             "ratio_ms": _ratio(ca["ms"], cb["ms"])}
    ops = []
    for name in set(a["ops"]) | set(b["ops"]):
        oa, ob = a["ops"].get(name), b["ops"].get(name)
        a_ms, b_ms = (oa or {}).get("ms", 0.0), (ob or {}).get("ms", 0.0)
        ops.append({"name": name, "phase": op_phase(name), "collective": _is_comm(name),
                    # None: not among that run's top ops (ledger.TOP_OPS per rank); counted as 0
                    "a_ms": a_ms if oa else None, "b_ms": b_ms if ob else None, "delta_ms": b_ms - a_ms,
                    "ratio": _ratio(a_ms, b_ms) if oa and ob else None})
    ops.sort(key=lambda o: (-abs(o["delta_ms"]), o["name"]))
    step = {"a_ms": a["wall_ms"], "b_ms": b["wall_ms"], "delta_ms": b["wall_ms"] - a["wall_ms"],
            "ratio": _ratio(a["wall_ms"], b["wall_ms"])}
    result = {
        "a": {k: a[k] for k in _RUN_KEYS},
        "b": {k: b[k] for k in _RUN_KEYS},
        "step": step, "shares": shares, "parts": parts, "phases": phases, "collectives": collectives,
        "ops": ops[:TOP_CHANGED], "findings": _findings(a["findings"], b["findings"]), "warnings": warnings,
        "layout": _layout_keys(a, b),
    }
    result = _rounded(result)
    result["why"] = _why(result, _rounded(ops))
    if result["layout"]:  # the runs were set up differently: that key is the difference made
        result["why"]["config_key"] = result["layout"][0]["key"]
        keys = "; ".join(f"{d['key']} = {toml_value(d['b'])} in B, {toml_value(d['a'])} in A"
                         for d in result["layout"])
        result["why"]["text"] += f" The layout differs: {keys}."
    return result


_RUN_KEYS = ("name", "strategy", "ranks", "steps", "kind", "cp", "cp_mode", "pp", "pp_stage_layers", "ep",
             "moe")
# A mixture of experts' keys in config.toml, by analyze.py's names for them (diagnose.moe_config).
_MOE_KEYS = (("experts", "model.moe_experts"), ("top_k", "model.moe_top_k"),
             ("aux_loss_coef", "model.moe_aux_loss_coef"), ("bias_update_rate", "model.moe_bias_update_rate"),
             ("capacity_factor", "model.moe_capacity_factor"))


def _layout_keys(a: dict, b: dict) -> list[dict]:
    """The context-parallel keys set differently in the two runs' configs (both known): cp, and
    cp_mode where both split sequences (cp > 1); then expert parallelism's ep and the mixture of
    experts' keys (`_expert_keys`); then a pipeline's stages, split otherwise at the same pp ([]: evenly)."""
    experts = _expert_keys(a, b) + _stage_keys(a, b)
    if a["cp"] is None or b["cp"] is None:
        return experts
    out = []
    if a["cp"] != b["cp"]:
        out.append({"key": "parallel.cp", "a": a["cp"], "b": b["cp"]})
    if a["cp"] > 1 and b["cp"] > 1 and a["cp_mode"] != b["cp_mode"]:
        out.append({"key": "parallel.cp_mode", "a": a["cp_mode"], "b": b["cp_mode"]})
    return out + experts


def _stage_keys(a: dict, b: dict) -> list[dict]:
    """parallel.pp_stage_layers where both runs are the same pipeline (pp > 1) with their blocks split
    differently."""
    if a["pp"] is None or a["pp"] != b["pp"] or a["pp"] < 2 or a["pp_stage_layers"] == b["pp_stage_layers"]:
        return []
    return [{"key": "parallel.pp_stage_layers", "a": a["pp_stage_layers"], "b": b["pp_stage_layers"]}]


def _expert_keys(a: dict, b: dict) -> list[dict]:
    """parallel.ep where both runs' are known and differ, then each model.moe_* key both runs know
    (config.toml's, else the preset's) and set differently; a dense run's experts are 0."""
    out = []
    if a["ep"] is not None and b["ep"] is not None and a["ep"] != b["ep"]:
        out.append({"key": "parallel.ep", "a": a["ep"], "b": b["ep"]})
    ma, mb = a["moe"] or {}, b["moe"] or {}
    for name, key in _MOE_KEYS:
        va, vb = ma.get(name), mb.get(name)
        if va is not None and vb is not None and va != vb:
            out.append({"key": key, "a": va, "b": vb})
    return out


def _rounded(x):
    """Floats to 6 decimals (ns under a ms): no 50.00000000000001 in the JSON."""
    if isinstance(x, float):
        return round(x, 6)
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


def _key(f: dict) -> tuple:
    return f.get("category"), f.get("knob")


def _findings(fa: list[dict], fb: list[dict]) -> dict:
    ka, kb = {_key(f) for f in fa}, {_key(f) for f in fb}

    def brief(f: dict) -> dict:
        return {k: f.get(k) for k in ("category", "title", "knob", "value", "note")}

    return {"a": [brief(f) for f in fa], "b": [brief(f) for f in fb],
            "new_in_b": [brief(f) for f in fb if _key(f) not in ka],
            "gone_in_b": [brief(f) for f in fa if _key(f) not in kb]}


# -- why ----------------------------------------------------------------------------------------

def _why(r: dict, ops: list[dict]) -> dict:
    step, shares, parts = r["step"], r["shares"], r["parts"]
    out = {"text": "", "compute": None, "part": None, "phase": None, "culprit": None, "config_key": None,
           "finding": None}
    if not step["a_ms"] or not step["b_ms"]:
        out["text"] = "Nothing to compare: " + "; ".join(r["warnings"][:2]) + "."
        return out
    d, ratio = step["delta_ms"], step["ratio"]
    sign = 1.0 if d >= 0 else -1.0
    same = abs(ratio - 1) < SAME_STEP
    sentences = [f"B's step matches A's ({ratio:.2f}×, {_sdur(d)} per step)." if same else
                 f"B's step is {ratio:.2f}× A's: {_sdur(d)} per step ({_dur(step['a_ms'])} → "
                 f"{_dur(step['b_ms'])})."]

    # 1. The compute share, and which part of the step took (or gave back) the difference.
    c = shares["compute"]
    out["compute"] = {"a": c["a"], "b": c["b"], "delta": c["delta"],
                      "changed": abs(c["delta"]) >= SHARE_POINTS}
    top = max(parts, key=lambda k: sign * parts[k]["delta_ms"])
    out["part"] = {"part": top, **parts[top]}
    if not out["compute"]["changed"]:
        sentences.append(f"Compute share unchanged ({c['a']:.0f}% → {c['b']:.0f}%)"
                         + ("." if same else ": every part of the step changed in proportion."))
    elif same:
        up = max(parts, key=lambda k: parts[k]["delta_ms"])
        down = min(parts, key=lambda k: parts[k]["delta_ms"])
        sentences.append(f"Compute share {c['a']:.0f}% → {c['b']:.0f}% at the same step time: "
                         f"{_WHY_LABEL.get(up, up)} {_sdur(parts[up]['delta_ms'])}, "
                         f"{_WHY_LABEL.get(down, down)} {_sdur(parts[down]['delta_ms'])}.")
    elif top == "compute":
        sentences.append(f"Compute share {c['a']:.0f}% → {c['b']:.0f}%: the time "
                         f"{'added' if d >= 0 else 'saved'} is mostly compute "
                         f"({_sdur(parts['compute']['delta_ms'])}).")
    else:
        s, moved = shares[top], _sdur(parts[top]["delta_ms"])
        sentences.append(f"Compute share {c['a']:.0f}% → {c['b']:.0f}%: the difference is mostly "
                         f"{_WHY_LABEL[top]} ({s['a']:.0f}% → {s['b']:.0f}%, {moved}).")
    if same:
        out["text"] = " ".join(sentences)
        return out

    # 2. The phase holding most of the difference; 3. what grew (or shrank) most inside it.
    phases = r["phases"]
    phase = max(PHASE_NAMES, key=lambda p: sign * phases[p]["delta_ms"])
    ph = phases[phase]
    out["phase"] = {"phase": phase, **ph, "fraction": round(ph["delta_ms"] / d, 4)}
    text = (f"{ph['delta_ms'] / d:.0%} of the difference is in {phase} ({_dur(ph['a_ms'])} → "
            f"{_dur(ph['b_ms'])}" + (f", {ph['ratio']:.2f}×)" if ph["ratio"] else ")"))
    culprit = _culprit(phase, sign, ops, r["collectives"])
    out["culprit"] = culprit
    if culprit:
        grew = "grew" if culprit["delta_ms"] >= 0 else "shrank"
        what = f"{culprit['name']} time" if culprit["type"] == "collective" else culprit["name"]
        text += (f"; there {what} {grew} {_sdur(culprit['delta_ms'])} per step ({_dur(culprit['a_ms'])} → "
                 f"{_dur(culprit['b_ms'])}")
        if culprit["type"] == "collective":
            e = shares["comm_exposed"]
            text += f"; exposed communication {e['a']:.0f}% → {e['b']:.0f}%"
        text += ")"
    sentences.append(text + ".")

    # The config key: the slower run's finding that speaks to this chain, most specific first.
    chain = []
    if culprit:
        kind = culprit["type"]
        if kind == "op" and culprit["name"] in _SYNC_OPS:
            kind = "sync"
        chain += _CATEGORIES.get(kind, ())
    chain += _CATEGORIES.get(phase, ()) + _CATEGORIES.get(top, ())
    slow, fast = ((r["findings"]["b"], r["findings"]["a"]) if d >= 0
                  else (r["findings"]["a"], r["findings"]["b"]))
    fast_keys = {_key(f) for f in fast}
    ranked = sorted((f for f in slow if f.get("category") in chain),
                    key=lambda f: (chain.index(f["category"]), _key(f) in fast_keys))
    if ranked:
        f = ranked[0]
        out["config_key"], out["finding"] = f.get("knob"), f
        if d >= 0:
            sentences.append(f"B's diagnosis: \"{f['title']}\"; "
                             + (f"look at {try_text(f)}." if f.get("knob") else f"{f.get('note')}."))
        else:
            state = "is gone in B" if _key(f) not in fast_keys else "remains in B"
            sentences.append(f"A's finding \"{f['title']}\"" + (f" ({f['knob']})" if f.get("knob") else "")
                             + f" {state}.")
    out["text"] = " ".join(sentences)
    return out


def _culprit(phase: str, sign: float, ops: list[dict], collectives: dict) -> dict | None:
    """The op, kernel or collective whose time moved most in the phase's direction."""
    cands = []
    for o in ops:
        if o["collective"] or (o["phase"] not in (None, phase) and phase != "other"):
            continue  # a collective's kernels and ops are counted under its kind
        cands.append(({"type": "op", "name": o["name"], "a_ms": o["a_ms"] or 0.0, "b_ms": o["b_ms"] or 0.0,
                       "delta_ms": o["delta_ms"]}, o["phase"] == phase))
    for kind, c in collectives.items():
        if phase in _COLLECTIVE_PHASES.get(kind, PHASE_NAMES):
            cands.append(({"type": "collective", "name": kind, "a_ms": c["a"]["ms"], "b_ms": c["b"]["ms"],
                           "delta_ms": c["delta_ms"]}, True))
    if not cands:
        return None
    best, _ = max(cands, key=lambda t: (round(sign * t[0]["delta_ms"], 6), t[1],
                                        t[0]["type"] == "collective"))
    return best if sign * best["delta_ms"] > 0 else None


# -- paths --------------------------------------------------------------------------------------

def resolve_run(path: str | Path, label: str = "RUN") -> Path:
    """A folder of per-rank traces, or a run directory with traces/ (the folder analyze reads)."""
    path = Path(path)
    if not path.is_dir():
        state = "is not a directory" if path.exists() else "does not exist"
        raise LoomError(f"--compare {label}: {path} {state}; pass a folder of per-rank Chrome traces or a "
                        "loom run directory (the one holding traces/)")
    return path


def compare_runs(run_a: str | Path, run_b: str | Path) -> dict:
    """`compare` of two run directories or trace folders, analyzed here (nothing is written)."""
    paths = [("RUN_A", resolve_run(run_a, "RUN_A")), ("RUN_B", resolve_run(run_b, "RUN_B"))]
    analyses = []
    for label, path in paths:
        try:
            analyses.append(analyze(path))
        except LoomError as e:
            raise LoomError(f"--compare {label}: {e}") from None
    result = compare(*analyses)
    result["a"]["path"], result["b"]["path"] = str(run_a), str(run_b)
    return result


# -- rendering ----------------------------------------------------------------------------------

def _dur(ms: float | None) -> str:
    if ms is None:
        return "—"
    if abs(ms) >= 1000:
        return f"{ms / 1000:.2f} s"
    return f"{ms:.1f} ms" if abs(ms) >= 1 or ms == 0 else f"{ms:.2f} ms"


def _sdur(ms: float) -> str:
    return ("+" if ms >= 0 else "−") + _dur(abs(ms))


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}"


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}×"


def _short(name: str, width: int = 64) -> str:
    return name if len(name) <= width else name[:width - 1] + "…"


def _run_line(label: str, run: dict) -> str:
    where = run.get("path") or run.get("name") or "?"
    extra = f", {run['strategy']}" if run.get("strategy") else ""
    extra += f", cp {run['cp']} ({run.get('cp_mode') or 'ring'})" if (run.get("cp") or 1) > 1 else ""
    moe = run.get("moe") or {}
    if moe.get("experts"):
        extra += f", {moe['experts']} experts" + (f" top-{moe['top_k']}" if moe.get("top_k") else "")
    extra += f", ep {run['ep']}" if (run.get("ep") or 1) > 1 else ""
    return f"{label}: {where} ({run['ranks']} rank(s), {run['steps']} step(s), {run['kind'] or '?'}{extra})"


def _tables(result: dict, short=lambda name: name) -> list[tuple[str, list[str], list[list[str]], str]]:
    """(id, header, rows, note) of each table, shared by the text and the HTML rendering."""
    step = result["step"]
    shares = [[label, f"{result['shares'][k]['a']:.1f}%", f"{result['shares'][k]['b']:.1f}%",
               f"{result['shares'][k]['delta']:+.1f}"] for k, label in SHARES]
    phases = [[p, _ms(v["a_ms"]), _ms(v["b_ms"]), _x(v["ratio"])] for p, v in result["phases"].items()]
    phases.append(["step", _ms(step["a_ms"]), _ms(step["b_ms"]), _x(step["ratio"])])
    out = [("ledger", ["ledger (% of step)", "A", "B", "B−A pts"], shares,
            "comm overlapped runs under compute: it is part of the compute share"),
           ("phases", ["phase (ms per step)", "A", "B", "B/A"], phases, "")]
    kinds = sorted(result["collectives"].items(), key=lambda kv: -abs(kv[1]["delta_ms"]))
    if kinds:
        rows = [[k, f"{c['a']['count']:.1f}", f"{c['b']['count']:.1f}", size_text(c["a"]["bytes"]),
                 size_text(c["b"]["bytes"]), _ms(c["a"]["ms"]), _ms(c["b"]["ms"]), f"{c['delta_ms']:+.2f}"]
                for k, c in kinds]
        out.append(("collectives", ["collectives (per rank-step)", "count A", "count B", "bytes A", "bytes B",
                                    "ms A", "ms B", "Δ ms"], rows, ""))
    if result["ops"]:
        rows = [[short(o["name"]), _ms(o["a_ms"]), _ms(o["b_ms"]), f"{o['delta_ms']:+.2f}"]
                for o in result["ops"]]
        missing = any(o["a_ms"] is None or o["b_ms"] is None for o in result["ops"])
        out.append(("ops", ["ops / kernels changed most (ms per rank-step)", "A", "B", "Δ ms"], rows,
                    f"—: not among that run's top {TOP_OPS} ops per rank; counted as 0" if missing else ""))
    return out


def _grid(head: list[str], rows: list[list[str]]) -> list[str]:
    """Columns padded to their widest cell: the first left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
            for r in [head, *rows]]


def _step_line(result: dict) -> str:
    step = result["step"]
    return f"step: A {_dur(step['a_ms'])}, B {_dur(step['b_ms'])}, B/A {_x(step['ratio'])}"


def render_compare(result: dict) -> str:
    """The comparison as text tables (times are ms per step, the mean over ranks)."""
    lines = [_run_line("A", result["a"]), _run_line("B", result["b"])]
    lines += [f"  warning: {w}" for w in result["warnings"]]
    lines += ["", _step_line(result)]
    for _, head, rows, note in _tables(result, _short):
        lines += ["", *_grid(head, rows)] + ([f"({note})"] if note else [])
    f = result["findings"]
    for label, key in (("new in B", "new_in_b"), ("gone in B", "gone_in_b")):
        if f[key]:
            lines.append(f"\nfindings {label}: " + "; ".join(
                x["title"] + (f" ({x['knob']})" if x.get("knob") else "") for x in f[key]))
    lines += [""] + textwrap.wrap("why: " + result["why"]["text"], 100, break_on_hyphens=False)
    return "\n".join(lines)


def render_compare_html(result: dict) -> str:
    """The comparison as one self-contained HTML page (report.py's styles and tables)."""
    top = "".join(f"<p>{_e(line)}</p>" for line in (_run_line("A", result["a"]), _run_line("B", result["b"]),
                                                   _step_line(result)))
    top += "".join(f'<p class="note">warning: {_e(w)}</p>' for w in result["warnings"])
    sections = [f"<header><h1>loom · A vs B</h1>{top}</header>",
                _section("why", "Why", f"<p>{_e(result['why']['text'])}</p>")]
    for sid, head, rows, note in _tables(result):
        body = _table([(head[0], False)] + [(h, True) for h in head[1:]],
                      [([(_e(c), "name" if i == 0 else "n") for i, c in enumerate(r)], "") for r in rows])
        sections.append(_section(sid, head[0], body + (f'<p class="note">{_e(note)}</p>' if note else "")))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>loom · A vs B</title><style>{_CSS}</style></head>"
            f"<body><main>{''.join(sections)}</main></body></html>\n")


def write_compare(result: dict, out_dir: Path) -> tuple[Path, Path]:
    """compare.json and compare.html in `out_dir`."""
    js, page = out_dir / "compare.json", out_dir / "compare.html"
    atomic_write(js, json.dumps(result, indent=1).encode())  # a planted link is replaced, never followed
    atomic_write(page, render_compare_html(result).encode("utf-8"))
    return js, page
