"""Stray lines: what a command prints that is neither loom's own output nor its progress bar —
third-party warnings, tracebacks, profiler marks. The README's commands and the quiet-run tests
count them (issue 40: "a test counts stray lines for each README command")."""

from __future__ import annotations

import re

# Progress bars: loom's (a log file gets one line per `train.log_every`; `loom data prepare` ends its
# with an ETA), an eval's, and a library's tqdm bar in a README command of its own
# ("Loading weights: 100%|████| 39/39").
PROGRESS = re.compile(r"^(step |eval )|^[^:|]+:\s+\d+%\||ETA \d\d:\d\d:\d\d\s*$")
# Lines that are noise wherever they appear, stdout included (a rank's own print goes there).
NOISE = re.compile(r"Warning\b|warning:|\[WARNING\]|Traceback|USDT|STAGE:|terminate called")


# A CUDA build of torch on a machine without a GPU (CI runs 2.11's so) says so: DeepSpeed's import of
# torch's extension builder and the profiler's kineto. Where a GPU is, neither prints.
NO_GPU = re.compile(r"No CUDA runtime is found, using CUDA_HOME|gpuGetDeviceCount failed with code")


def _cuda_build_without_gpu() -> bool:
    import torch

    return torch.version.cuda is not None and not torch.cuda.is_available()


def stray_lines(stdout: str, stderr: str) -> list[str]:
    """stderr's lines other than the progress bar, and stdout's lines that are warnings or worse."""
    err = [line for line in stderr.splitlines() if line.strip() and not PROGRESS.search(line)]
    if _cuda_build_without_gpu():
        err = [line for line in err if not NO_GPU.search(line)]
    out = [line for line in stdout.splitlines() if NOISE.search(line)]
    return err + out
