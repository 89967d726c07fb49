"""Collectives matched across ranks: waiting for a late peer vs moving bytes, and who is late.

A collective cannot finish before its last member arrives, so for each matched collective the
rank that issued it last sets the pace: every other rank's time from its own arrival to that
last arrival is waiting, and only the time after it is transfer. Matching uses the collective's
sequence number where the trace records one (per process group), else its order among the
rank's collectives of the same kind and size.
"""

from __future__ import annotations

import statistics
from collections import defaultdict


def _key_fn(collectives_by_rank: dict[str, list[dict]]):
    with_seq = all(c.get("seq") is not None for cs in collectives_by_rank.values() for c in cs)
    if with_seq:
        return lambda c, _: (c.get("group"), c["kind"], c["seq"])
    return lambda c, nth: (c["kind"], c.get("bytes"), nth)


def match_collectives(ranks: dict[str, dict]) -> list[dict]:
    """One record per collective every rank issued: per rank wait and transfer (ms), the last rank."""
    by_rank = {r: [c for c in info.get("collectives", []) if (c.get("group_size") or 2) > 1]
               for r, info in ranks.items()}
    if len(by_rank) < 2:
        return []
    key = _key_fn(by_rank)
    tables: dict[str, dict] = {}
    for rank, collectives in by_rank.items():
        seen: dict[tuple, int] = defaultdict(int)
        table = {}
        for c in collectives:
            base = (c["kind"], c.get("bytes"))
            table[key(c, seen[base])] = c
            seen[base] += 1
        tables[rank] = table
    common = set.intersection(*(set(t) for t in tables.values()))
    first = next(iter(tables.values()))
    matched = []
    for k in sorted(common, key=lambda k: _arrival(first[k])):
        arrivals = {r: _arrival(t[k]) for r, t in tables.items()}
        last_rank = max(arrivals, key=arrivals.get)
        last = arrivals[last_rank]
        per_rank = {r: {"wait_ms": (last - a) / 1000,
                        "transfer_ms": max(tables[r][k].get("end_us", last) - last, 0.0) / 1000}
                    for r, a in arrivals.items()}
        c = first[k]
        matched.append({"index": len(matched), "kind": c["kind"], "bytes": c.get("bytes"),
                        "step": c.get("step"), "last_rank": int(last_rank), "per_rank": per_rank})
    return matched


def _arrival(c: dict) -> float:
    return c.get("enqueue_us") if c.get("enqueue_us") is not None else c["start_us"]


def find_stragglers(matched: list[dict], ranks: dict[str, dict]) -> list[dict]:
    """Ranks that arrive last at most collectives, by a margin that matters for the step.

    Per step, a late rank's delay is how far behind the next-latest rank it reached the step's
    most delayed collective (later collectives of the step wait for the same delay). A straggler
    is last at ≥ 75% of the collectives and delays its step by ≥ 40% of the mean step time on
    average: scheduling jitter between ranks sharing a host stays well below that.
    """
    if not matched:
        return []
    walls = [s["wall_ms"] for info in ranks.values() for s in info.get("steps", [])]
    mean_wall = statistics.fmean(walls) if walls else 0.0
    last_count: dict[int, int] = defaultdict(int)
    step_delay: dict[int, dict] = defaultdict(dict)  # rank -> step -> delay (ms)
    for m in matched:
        rank = m["last_rank"]
        last_count[rank] += 1
        waits = sorted((v["wait_ms"] for v in m["per_rank"].values()), reverse=True)
        ahead = waits[-2] if len(waits) > 1 else 0.0  # the next-latest rank's wait
        delays = step_delay[rank]
        delays[m.get("step")] = max(delays.get(m.get("step"), 0.0), ahead)
    steps = {m.get("step") for m in matched}
    out = []
    for rank, count in last_count.items():
        share = count / len(matched)
        late_ms = sum(step_delay[rank].values()) / len(steps)
        if share >= 0.75 and late_ms >= max(1.0, 0.4 * mean_wall):
            waiting = {r: _per_step_max(matched, r) for r in ranks if int(r) != rank}
            out.append({"rank": rank, "late_ms_mean": late_ms, "last_share": share,
                        "evidence": (f"rank {rank} arrived last at {count} of {len(matched)} collectives and "
                                     f"{late_ms:.1f} ms behind the others per step "
                                     f"(mean step {mean_wall:.1f} ms); per step the others waited "
                                     + ", ".join(f"rank {r}: {w:.1f} ms"
                                                 for r, w in sorted(waiting.items())))})
    return sorted(out, key=lambda s: -s["late_ms_mean"])


def _per_step_max(matched: list[dict], rank: str) -> float:
    """A rank's wait per step: its longest wait in each step (waits within a step overlap)."""
    worst: dict = {}
    for m in matched:
        worst[m.get("step")] = max(worst.get(m.get("step"), 0.0), m["per_rank"][rank]["wait_ms"])
    return statistics.fmean(worst.values())
