"""Experiment tracking beside metrics.jsonl: TensorBoard and Weights & Biases (`train.log_to`).

Rank 0 opens the trackers the config names (`Trackers.open`); StepLog hands them each optimizer
step's entry when it writes the same entry to metrics.jsonl (a step late, from the host values it
has read back), and at the end the final eval and every rank's memory.json entry. The packages are
imported here, and only when asked for: a run with `train.log_to = []` never loads them.

  train/loss, train/lr, train/grad_norm, train/tokens_per_s, train/step_time_s, train/data_wait_s
  train/mfu          on a GPU the planner knows (loom/plan/hardware.py), or a device `loom plan
                     --calibrate` measured (its best matmul rate is the peak)
  ledger/<phase>     the step's share of time in data, forward, backward, pipeline, optimizer
  eval/loss          every train.eval_every steps and the final eval
  memory/rank<r>/<key>   at the end: memory.json's numbers for each rank (peak_bytes, resident_bytes, ...)
  comm/rank<r>/<key>     at the end: its collectives of step 2 (count, payload_bytes, modelled_wire_bytes)
  load/rank<r>/core_wait_share  at the end: the share of the timed steps it waited for a core
  config             the resolved config: TensorBoard text (TOML) and hparams; wandb's run config
"""

from __future__ import annotations

import atexit
import importlib.util
from pathlib import Path
from typing import Any

from loom.config import Config, to_toml
from loom.errors import ConfigError, LoomError

# train.log_to -> the pip package it needs
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}

# metrics.jsonl's per-step keys -> their tags
STEP_TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
             "tokens_per_s": "train/tokens_per_s", "step_time_s": "train/step_time_s",
             "data_wait_s": "train/data_wait_s", "eval_loss": "eval/loss",
             # a mixture of experts' routing, and expert parallelism's all-to-all (MoE runs only)
             "moe_aux_loss": "moe/aux_loss", "moe_load_imbalance": "moe/load_imbalance",
             "moe_dropped": "moe/dropped", "ep_bytes": "comm/ep_bytes", "ep_wait_s": "comm/ep_wait_s"}


def require_trackers(log_to: list[str]) -> None:
    """A ConfigError naming the pip package when a tracker's package is not installed (checked
    without importing it, so every rank can ask)."""
    for name in log_to:
        package = PACKAGES.get(name, name)
        if importlib.util.find_spec(package) is None:
            raise ConfigError(f"train.log_to = {name!r} needs the {package} package, which is not installed: "
                              f"pip install {package} (or pip install -e '.[track]'), or drop {name!r} from "
                              f"train.log_to")


def mfu_scale(plan: dict | None) -> float | None:
    """MFU per token/s for this run, from the planner's own prediction (plan.json): its MFU
    (FLOPs per token 6Ψ + attention over the GPUs' bf16 peak, loom/plan/search.py) divided by
    its predicted tokens/s. None where the hardware is unknown (CPU, an uncatalogued GPU)."""
    if not plan or not plan.get("mfu") or not plan.get("tokens_per_s"):
        return None
    return plan["mfu"] / plan["tokens_per_s"]


class Trackers:
    """The trackers of one run, on rank 0. Every method is a no-op after `close`."""

    _current: Trackers | None = None  # still open: a run that raised before closing them

    @classmethod
    def open(cls, cfg: Config, run_dir: Path | None, main: bool, plan: dict | None = None) -> Trackers | None:
        """The trackers `train.log_to` names, or None (nothing to log, not rank 0, no run directory)."""
        if not cfg.train.log_to or not main or run_dir is None:
            return None
        cls.close_current(failed=True)  # the last run in this process raised before closing them
        return cls(cfg, run_dir, plan)

    @classmethod
    def close_current(cls, failed: bool = True) -> None:
        """Close the trackers a run left open (it raised before StepLog.close); no-op if none.
        The process's exit closes them too (atexit)."""
        if cls._current is not None:
            cls._current.close(failed=failed)

    def __init__(self, cfg: Config, run_dir: Path, plan: dict | None = None):
        require_trackers(cfg.train.log_to)
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.mfu_scale = mfu_scale(plan)
        self.tensorboard = None
        self.wandb = None
        self.last_step: int | None = None
        Trackers._current = self
        try:
            if "tensorboard" in cfg.train.log_to:
                self.tensorboard = _open_tensorboard(cfg, self.run_dir)
            if "wandb" in cfg.train.log_to:
                self.wandb = _open_wandb(cfg, self.run_dir)
        except BaseException:
            self.close(failed=True)
            raise
        # After wandb.init, so that at exit this runs before wandb's own teardown (atexit is LIFO).
        atexit.register(self.close, failed=True)

    def step(self, entry: dict, phases: dict[str, float]) -> None:
        """One optimizer step: metrics.jsonl's entry and the ledger's seconds per phase (`<phase>_s`)."""
        step = entry["step"]
        scalars = {tag: float(entry[key]) for key, tag in STEP_TAGS.items() if entry.get(key) is not None}
        total = sum(phases.values())
        if total > 0:
            scalars.update({f"ledger/{name.removesuffix('_s')}": seconds / total
                            for name, seconds in phases.items() if seconds > 0})
        if self.mfu_scale is not None and entry.get("tokens_per_s"):
            scalars["train/mfu"] = entry["tokens_per_s"] * self.mfu_scale
        self._log(scalars, step)

    def finish(self, eval_loss: float | None, ranks: list[dict] | None) -> None:
        """The end of the run: the final eval and each rank's memory (memory.json's entries), at
        the last step."""
        scalars = {} if eval_loss is None else {"eval/loss": float(eval_loss)}
        for rank, measured in enumerate(ranks or ()):
            for key, value in measured.items():
                if not isinstance(value, int | float) or isinstance(value, bool) \
                        or key in ("pp_stage", "ep", "ep_rank"):  # places in the mesh, not memory
                    continue
                if key == "core_wait_share":  # not memory: the share of the run it waited for a core
                    scalars[f"load/rank{rank}/core_wait_share"] = float(value)
                elif key.startswith("comm_"):
                    scalars[f"comm/rank{rank}/{key.removeprefix('comm_')}"] = float(value)
                else:
                    scalars[f"memory/rank{rank}/{key}"] = float(value)
        self._log(scalars, self.last_step if self.last_step is not None else self.cfg.train.steps)
        if self.wandb is not None:
            self.wandb.summary.update(scalars)

    def close(self, failed: bool = False) -> None:
        """Flush and close every tracker (wandb: `finish` the run, marked failed if `failed`)."""
        atexit.unregister(self.close)
        if Trackers._current is self:
            Trackers._current = None
        tensorboard, self.tensorboard = self.tensorboard, None
        run, self.wandb = self.wandb, None
        try:
            if tensorboard is not None:
                tensorboard.close()
        finally:
            if run is not None:
                run.finish(exit_code=1 if failed else 0)

    def _log(self, scalars: dict[str, float], step: int) -> None:
        self.last_step = step
        if self.tensorboard is not None:
            for tag, value in scalars.items():
                self.tensorboard.add_scalar(tag, value, global_step=step)
        if self.wandb is not None and scalars:
            self.wandb.log(scalars, step=step)


def _open_tensorboard(cfg: Config, run_dir: Path):
    """A SummaryWriter on RUN_DIR/tensorboard, with the config as text and as hparams."""
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import hparams

    writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), flush_secs=10)
    writer.add_text("config", f"```toml\n{to_toml(cfg)}```", global_step=0)
    metrics = {"train/loss": 0.0, **({"eval/loss": 0.0} if cfg.train.eval_every else {})}
    for summary in hparams(_flat_hparams(cfg), metrics):
        writer.file_writer.add_summary(summary)
    return writer


def _flat_hparams(cfg: Config) -> dict[str, Any]:
    """`section.key` -> value, as TensorBoard's hparams take them (numbers, strings, booleans)."""
    flat = {}
    for section, table in cfg.to_dict().items():
        for key, value in table.items():
            plain = isinstance(value, bool | int | float | str)
            flat[f"{section}.{key}"] = value if plain else str(value)
    return flat


def _open_wandb(cfg: Config, run_dir: Path):
    """A wandb run in RUN_DIR/wandb (offline: no network; `wandb sync` uploads it later)."""
    import wandb

    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        return wandb.init(project=cfg.train.wandb_project, mode=cfg.train.wandb_mode, dir=str(run_dir),
                          name=run_dir.name, config=cfg.to_dict(), reinit="create_new",
                          settings=wandb.Settings(console="off"))
    except wandb.Error as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LoomError(f"wandb could not start a run ({first}); run `wandb login`, or set "
                        f"train.wandb_mode=offline to log without a network") from None
