"""The planted-bug check: apply each bug of tests/planted/ to a scratch copy of the repository and
run the tests that must catch it. Not part of CI's time (pytest does not collect this file).

    python tests/planted_bugs.py                 # every bug, one scratch copy
    python tests/planted_bugs.py -j 2            # two scratch copies, two bugs at a time
    python tests/planted_bugs.py --only ID ...   # some bugs
    python tests/planted_bugs.py --list          # what there is, without running anything
    python tests/planted_bugs.py --markdown FILE # the table, also written to FILE

A bug is `old → new` in one file (`old` must occur exactly once there). Its tests run in the
scratch copy with the copy first on the import path (loom is installed editable from the real
checkout, so PYTHONPATH points at the copy, and a plugin checks inside the run that `loom` comes
from it). First every listed test runs once without any bug (`--no-baseline` skips that): a test
that fails already cannot catch anything. Result: caught (a listed test failed; "timed out" if
the run outlived --timeout), MISSED (all passed), broken (the edit did not apply, its tests fail
without the bug, or the run could not test it: an unknown test id, loom imported from
elsewhere). Exit status 1 if any bug is missed or broken.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from planted import Bug  # noqa: E402 - the tests folder is on the path only from here on

# Loaded by every pytest run in a scratch copy (-p): fails the run unless loom is the copy's own,
# and lists what failed (test ids; a file that failed to collect) in LOOM_PLANTED_FAILED.
CHECK_PLUGIN = '''\
import os

import pytest

import loom


def pytest_configure(config):
    root = os.path.realpath(os.environ["LOOM_PLANTED_ROOT"])
    if not os.path.realpath(loom.__file__).startswith(root + os.sep):
        raise pytest.UsageError(f"loom was imported from {loom.__file__}, not the scratch copy {root}")


def _failed(report):
    if report.failed:
        with open(os.environ["LOOM_PLANTED_FAILED"], "a") as f:
            f.write(report.nodeid + "\\n")


pytest_runtest_logreport = pytest_collectreport = _failed
'''
PLUGIN = "_planted_check"
# pytest's exit codes: 1 tests failed, 2 interrupted (a collection error: the bug broke an import)
CAUGHT_CODES = (1, 2)


@dataclass
class Outcome:
    bug: Bug
    result: str  # caught | MISSED | broken (+ why)
    seconds: float
    detail: str = ""  # the run's last lines, when it was not caught


def collect() -> list[Bug]:
    """BUGS of every module in tests/planted/, in module order; ids must be unique."""
    import planted

    bugs: list[Bug] = []
    for info in sorted(pkgutil.iter_modules(planted.__path__), key=lambda m: m.name):
        bugs += importlib.import_module(f"planted.{info.name}").BUGS
    seen: dict[str, int] = {}
    for b in bugs:
        seen[b.id] = seen.get(b.id, 0) + 1
    twice = [i for i, n in seen.items() if n > 1]
    if twice:
        raise SystemExit(f"planted_bugs: bug ids used twice: {', '.join(twice)}")
    return bugs


def repository_files(root: Path) -> list[str]:
    """Tracked and untracked-but-not-ignored files: the working tree as the suite sees it."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout.decode()
    return [f for f in out.split("\0") if f and (root / f).is_file()]


def make_scratch(parent: Path, index: int) -> Path:
    scratch = parent / f"copy{index}"
    for name in repository_files(ROOT):
        target = scratch / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    (scratch / f"{PLUGIN}.py").write_text(CHECK_PLUGIN)
    return scratch


def apply(bug: Bug, scratch: Path) -> tuple[str | None, str]:
    """Plant the bug; returns (the file's pristine text to restore, or None, and why not)."""
    path = scratch / bug.file
    if not path.is_file():
        return None, f"no file {bug.file}"
    text = path.read_text()
    count = text.count(bug.old)
    if count != 1:
        return None, f"`old` occurs {count} times in {bug.file}, not once"
    path.write_text(text.replace(bug.old, bug.new))
    return text, ""


def pytest_in(scratch: Path, tests: list[str], timeout: float, first_failure: bool = True
              ) -> tuple[int, str, list[str]]:
    """Run `tests` in the scratch copy: (pytest's exit code, -1 past the timeout; its output; the ids
    of what failed)."""
    failed = scratch / ".planted-failed"
    failed.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOOM_FAULTS", "PYTEST_"))}
    env.update(PYTHONPATH=str(scratch), LOOM_PLANTED_ROOT=str(scratch), LOOM_PLANTED_FAILED=str(failed),
               PYTHONDONTWRITEBYTECODE="1")
    # -m "": the extended set too (tests/extended.txt), which the default run leaves out
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "", *(["-x"] if first_failure else []),
           "-p", "no:cacheprovider", "-p", PLUGIN, *tests]
    # Its own session, so that a run past the timeout is ended with every rank it started.
    proc = subprocess.Popen(cmd, cwd=scratch, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        code, out = -1, f"{out}\ntimed out after {timeout:.0f} s"
    return code, out, failed.read_text().split() if failed.is_file() else []


def covers(test: str, nodeid: str) -> bool:
    """Whether a test id (or file) a bug lists and a failed pytest node id (or a file that failed
    to collect) overlap."""
    return nodeid == test or nodeid.startswith((test + "::", test + "[")) or test.startswith(nodeid + "::")


def collected(scratch: Path, tests: list[str]) -> set[str]:
    """The node ids pytest collects from the files `tests` name."""
    files = list(dict.fromkeys(t.split("::")[0] for t in tests))
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *files], cwd=scratch, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(scratch)})
    return {line.strip() for line in done.stdout.splitlines() if "::" in line}


def run_bug(bug: Bug, scratch: Path, timeout: float, failing: set[str], known: set[str] | None) -> Outcome:
    start = time.perf_counter()
    unknown = [t for t in bug.tests if known is not None and not any(covers(t, n) for n in known)]
    if unknown:
        return Outcome(bug, "broken (unknown test id)", 0.0, "\n".join(unknown))
    already = sorted(n for n in failing if any(covers(t, n) for t in bug.tests))
    if already:
        return Outcome(bug, "broken (its tests fail without the bug)", 0.0, "\n".join(already))
    pristine, why = apply(bug, scratch)
    if pristine is None:
        return Outcome(bug, f"broken ({why})", 0.0)
    try:
        code, out, _ = pytest_in(scratch, list(bug.tests), timeout)
    finally:
        (scratch / bug.file).write_text(pristine)
    tail = out.strip().splitlines()[-15:]
    seconds = time.perf_counter() - start
    if code in CAUGHT_CODES:
        return Outcome(bug, "caught", seconds)
    if code == -1:
        return Outcome(bug, "caught (timed out)", seconds, "\n".join(tail))
    if code == 0:
        return Outcome(bug, "MISSED", seconds, "\n".join(tail))
    return Outcome(bug, f"broken (pytest exit {code})", seconds, "\n".join(tail))


def table(outcomes: list[Outcome]) -> str:
    lines = ["| id | what | tests | result | seconds |", "| --- | --- | --- | --- | --- |"]
    for o in outcomes:
        tests = "<br>".join(f"`{t}`" for t in o.bug.tests)
        lines.append(f"| {o.bug.id} | {o.bug.what} | {tests} | {o.result} | {o.seconds:.0f} |")
    caught = sum(o.result.startswith("caught") for o in outcomes)
    lines += ["", f"{caught} of {len(outcomes)} planted bugs caught."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", metavar="ID", help="run only these bugs")
    ap.add_argument("--list", action="store_true", help="list the bugs and exit")
    ap.add_argument("-j", type=int, default=1, metavar="N", help="scratch copies (bugs run at once)")
    ap.add_argument("--markdown", type=Path, metavar="FILE", help="also write the table to FILE")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per bug's test run")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the first run of every listed test without any bug (a test that fails "
                         "already cannot catch anything: its bugs are marked broken)")
    a = ap.parse_args(argv)
    bugs = collect()
    if a.only:
        unknown = sorted(set(a.only) - {b.id for b in bugs})
        if unknown:
            ap.error(f"unknown bug id(s): {', '.join(unknown)}; --list shows them")
        bugs = [b for b in bugs if b.id in a.only]
    if a.list:
        for b in bugs:
            print(f"{b.id:32s} {b.file}  ({len(b.tests)} test(s))  {b.what}")
        return 0
    with tempfile.TemporaryDirectory(prefix="loom-planted-") as tmp:
        copies: queue.Queue[Path] = queue.Queue()
        for i in range(max(1, min(a.j, len(bugs)))):
            copies.put(make_scratch(Path(tmp), i))
        failing: set[str] = set()
        known: set[str] | None = None
        if not a.no_baseline:
            tests = list(dict.fromkeys(t for b in bugs for t in b.tests))
            known = collected(copies.queue[0], tests)
            tests = [t for t in tests if any(covers(t, n) for n in known)]  # unknown ids: their bugs' fault
            start = time.perf_counter()
            code, out, failed = pytest_in(copies.queue[0], tests, a.timeout * 4, first_failure=False)
            failing = set(failed) | ({"<timeout>"} if code == -1 else set())
            print(f"baseline: {len(tests)} test ids without any bug, {len(failing)} failed "
                  f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
            for n in sorted(failing):
                print(f"    fails without a bug: {n}", file=sys.stderr)

        def one(bug: Bug) -> Outcome:
            scratch = copies.get()
            try:
                outcome = run_bug(bug, scratch, a.timeout, failing, known)
            finally:
                copies.put(scratch)
            print(f"{outcome.result:>10s}  {outcome.seconds:6.0f} s  {bug.id}", file=sys.stderr, flush=True)
            if outcome.detail:
                print("    " + outcome.detail.replace("\n", "\n    "), file=sys.stderr, flush=True)
            return outcome

        with ThreadPoolExecutor(max_workers=copies.qsize()) as pool:
            outcomes = list(pool.map(one, bugs))
    text = table(outcomes)
    print(text)
    if a.markdown:
        a.markdown.write_text(text)
    return 0 if all(o.result.startswith("caught") for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
