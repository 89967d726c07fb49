#!/usr/bin/env bash
# Install loom and everything its test suite needs, on a fresh Debian/Ubuntu machine:
#   - PyTorch's CPU build (the pin; a plain `torch` would fetch a multi-GB CUDA build),
#   - loom with the test extra and DeepSpeed (editable, from this checkout),
#   - Debian's Chromium (the HTML report's render test) and libaio (DeepSpeed's NVMe offload),
#     through sudo when not root; skipped, with a note, where apt-get is not available.
# `.ci/run` runs this first; the README's quick start is `bash install.sh && loom train`.
set -euo pipefail
cd "$(dirname "$0")"
python -m pip install --quiet --disable-pip-version-check torch==2.13.0
python -m pip install --quiet --disable-pip-version-check -e ".[test,deepspeed]"
# Not `grep -q`: under pipefail its early exit fails the pipeline with ldconfig's SIGPIPE.
if ! command -v chromium >/dev/null || ! ldconfig -p | grep libaio >/dev/null; then
    if command -v apt-get >/dev/null; then
        sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
        $sudo apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium libaio-dev >/dev/null
    else
        echo "install.sh: no apt-get here; install Chromium and libaio yourself, or run the tests with" \
             "LOOM_TEST_WITHOUT=chromium,libaio" >&2
    fi
fi
