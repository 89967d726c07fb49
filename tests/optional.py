"""What some tests need beyond loom's own dependencies (the test extra's packages, DeepSpeed,
libaio, Chromium, a tmpfs mount). Missing, such a test fails, saying how to get it: a test that
skips quietly is a test that can no longer fail. `LOOM_TEST_WITHOUT=deepspeed,libaio` (names as
the failure gives them, comma-separated) opts out explicitly: those tests then skip, saying why.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import pytest

OPT_OUT = "LOOM_TEST_WITHOUT"


def opted_out(what: str) -> bool:
    return what in {w.strip() for w in os.environ.get(OPT_OUT, "").split(",")}


def require(what: str, available: bool, how: str) -> None:
    """Fail (or, opted out, skip) the test or module unless `what` is available; `how` gets it."""
    if available:
        return
    if opted_out(what):
        pytest.skip(f"{what} is not available ({OPT_OUT} names it)", allow_module_level=True)
    pytest.fail(f"{what} is not available: {how}; or set {OPT_OUT}={what} to skip the tests that need it",
                pytrace=False)


def require_module(name: str, how: str) -> ModuleType:
    """The module `name`, imported; missing: as `require`."""
    require(name, importlib.util.find_spec(name) is not None, how)
    return importlib.import_module(name)


TEST_EXTRA = 'pip install -e ".[test]"'
DEEPSPEED = 'pip install -e ".[deepspeed]"'
