"""The `alone` marker (tests/conftest.py): under pytest-xdist, as CI runs the suite, a test that times
the machine runs while no other test does, and the other tests still run side by side."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_an_alone_test_runs_while_no_other_test_does(tmp_path):
    log = tmp_path / "intervals.txt"
    (tmp_path / "test_timed.py").write_text(textwrap.dedent(f"""
        import time

        import pytest


        def record(name):
            start = time.monotonic()
            time.sleep(0.3)
            with open({str(log)!r}, "a") as f:
                f.write(f"{{name}} {{start}} {{time.monotonic()}}\\n")


        @pytest.mark.parametrize("i", range(6))
        def test_shared(i):
            record(f"shared{{i}}")


        @pytest.mark.alone
        @pytest.mark.parametrize("i", range(3))
        def test_alone(i):
            record(f"alone{{i}}")
    """))
    # loom's conftest as a plugin, in a folder of its own (no pyproject: no -m filter, no pythonpath)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "conftest",
                        "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)],
                       cwd=tmp_path, capture_output=True, text=True, env={**env, "PYTHONPATH": str(TESTS)},
                       timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = (line.split() for line in log.read_text().splitlines())
    spans = {name: (float(start), float(end)) for name, start, end in lines}
    assert len(spans) == 9

    def overlap(x: str, y: str) -> bool:
        return spans[x][0] < spans[y][1] and spans[y][0] < spans[x][1]

    for name in (n for n in spans if n.startswith("alone")):
        beside = [other for other in spans if other != name and overlap(name, other)]
        assert not beside, f"{name} ran beside {beside}"
    # the two workers did run the others side by side: the marker serializes what it marks alone
    assert any(overlap(f"shared{i}", f"shared{j}") for i in range(6) for j in range(i + 1, 6))
