"""Checkpoints with torch.distributed.checkpoint (DCP): save, find, load, read whole.

A checkpoint is RUN_DIR/checkpoints/step_N/, holding
  - DCP's files: `model.<name>` and `optim.<name>.<state>` tensors under the full model's
    parameter names, sharded (DTensor) where the run shards them, so any layout loads any other;
  - meta.json (rank 0): step, resolved config, layout, LR schedule, data position;
  - rng_rank<r>.json (each rank): its torch/CUDA/numpy/python RNG states;
  - tokenizer/ (rank 0): the run's Hugging Face tokenizer files, by sha256 in meta.json, which
    `loom export --layout hf` copies (loom/train/tokenizer_copy.py).
It is written into `.tmp-step_N` and made visible by one atomic rename once every rank's files
are complete; `latest` names it afterwards; older ones beyond `train.keep_last` are removed.
A visible step_N is therefore always whole: a crash while writing leaves only a `.tmp-` folder.

Loading runs nothing from the files (loom/train/safe_load.py): DCP's index is unpickled with an
allow-list and checked entry by entry (its chunks covering each tensor exactly once) before any
tensor is read; non-tensor state is JSON, read through loom.checked. A resume never leaves the
run's checkpoints/: `latest` must name a step_N folder beside it, and a step_N that is a symbolic
link is refused, and never followed or deleted through by retention.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import math
import os
import random
import re
import shutil
import sys
import time
import tomllib
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from loom.checked import BadFile, Fields, read_json, read_text
from loom.config import Config, load_config_text, shape_overrides, to_toml
from loom.data import source_identity
from loom.errors import AgreedError, ConfigError, LoomError
from loom.files import atomic_write, fsync_dir
from loom.models.gpt.config import preset
from loom.models.lora import is_adapter
from loom.observe.report import size_text
from loom.parallel import deepspeed_engine
from loom.parallel.zero1 import is_zero1, local_optimizer, owned_states
from loom.train import faults, lora_base, safe_load, tokenizer_copy

CHECKPOINTS = "checkpoints"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
META = "meta.json"
# In a checkpoints folder: the run directory whose checkpoints it holds (the folder may be a link to a
# scratch disk, where loom must never write over, or clean up, another run's checkpoints).
OWNER = ".loom-owner"
_STEP_DIR = re.compile(r"^step_(\d+)$")
# Settings that decide which sequences step k trains on, or the model's shapes: a resume must keep them.
# (data.source: by what it is, source_identity's fingerprint, not by how the config names it)
RESUME_FIXED = ("data.tokenizer", "data.bpe_vocab_size", "data.seq_len", "data.eval_fraction",
                "train.batch_size", "train.seed", "lora.rank", "lora.alpha", "lora.targets",
                "lora.train_embeddings", "lora.train_norms", "lora.base_dtype")


def step_name(step: int) -> str:
    return f"step_{step}"


# ---------------------------------------------------------------------------------------------
# Finding checkpoints


def checkpoint_steps(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under RUN_DIR/checkpoints, oldest first: step_N folders of its own (a
    symbolic link named step_N is none of them: retention never counts, follows or deletes one)."""
    return sorted((n, p) for n, p in _step_names(root) if p.is_dir() and not p.is_symlink())


def _step_names(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    return [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))]


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run: the one `latest` names, else the newest step_N
    (found by a scan). `latest` must hold a plain step_N name, and the checkpoint found must be a
    folder of checkpoints/ itself, never a symbolic link that could lead a resume anywhere; else
    one line."""
    root = run_dir / CHECKPOINTS
    named = _latest_named(root)
    if named is None or not (named / META).is_file():  # no marker, or one a removed step left behind
        steps = sorted((n, p) for n, p in _step_names(root) if p.is_dir())
        named = steps[-1][1] if steps else None
    if named is not None:
        _not_a_link(named)
    return named


def _latest_named(root: Path) -> Path | None:
    """The folder `checkpoints/latest` names (None without the marker)."""
    marker = root / LATEST
    if not os.path.lexists(marker):
        return None
    fix = (f"loom writes there the name of the newest step_N folder beside it: delete {marker} to resume "
           f"from the newest step_N folder, or pass --resume {root}/step_N")
    if marker.is_symlink() or not marker.is_file():
        raise LoomError(f"{marker} is not a plain file (a link or a folder); {fix}")
    try:
        name = read_text(marker, max_bytes=256).strip()
    except BadFile as e:
        raise LoomError(f"{e}; {fix}") from None
    if not _STEP_DIR.match(name):
        raise LoomError(f"{marker} names {name[:80]!r}, not a step_N folder of {root}; {fix}")
    return root / name


def _not_a_link(path: Path) -> None:
    if path.is_symlink():
        raise LoomError(f"checkpoint {path} is a symbolic link (to {os.readlink(path)}); loom resumes only "
                        f"a step_N folder inside the run's checkpoints/, never a link out of it: pass the "
                        f"folder it points to to --resume if you trust it, or remove the link")


def check_checkpoints_dir(run_dir: Path) -> None:
    """Before a run writes into RUN_DIR/checkpoints (and removes stale writes and old steps there):
    it is a folder, and where it is a symbolic link (a scratch disk) the folder it leads to is this
    run's, empty or marked by loom with this run's directory. A folder inside the run is its own."""
    root = Path(run_dir) / CHECKPOINTS
    if not os.path.lexists(root):
        return
    if root.is_symlink() and not root.exists():
        raise LoomError(f"{root} is a symbolic link to {os.readlink(root)}, which does not exist; create "
                        f"that folder (loom writes the run's checkpoints there) or remove the link")
    if not root.is_dir():
        raise LoomError(f"{root} is a file, not the run's checkpoints folder; move it aside (loom writes its "
                        f"checkpoints there), or pick another --out")
    if not root.is_symlink():
        return
    owner = _checkpoints_owner(root)
    if owner == str(Path(run_dir).resolve()):
        return
    if owner is None and not any(p.name != OWNER for p in root.iterdir()):
        return
    target, me = root.resolve(), Path(run_dir).resolve()
    fresh = f"link checkpoints to an empty folder of its own, e.g. {target / me.name}"
    if owner:
        raise LoomError(f"{root} links to {target}, which holds the checkpoints of the run {owner}; "
                        f"loom writes and cleans up only this run's checkpoints: {fresh}")
    raise LoomError(f"{root} links to {target}, which holds files not marked as this run's (loom marks "
                    f"a linked checkpoints folder with {OWNER} naming its run); loom writes and cleans up "
                    f"only this run's checkpoints: {fresh}, or, if they are this run's checkpoints moved "
                    f"there, mark them: echo {me} > {target / OWNER}")


def claim_checkpoints_dir(run_dir: Path) -> None:
    """Make RUN_DIR/checkpoints (if need be); a linked one is marked as this run's
    (check_checkpoints_dir). A folder inside the run is its own by where it is: never marked."""
    check_checkpoints_dir(run_dir)
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    me = str(Path(run_dir).resolve())
    if root.is_symlink() and _checkpoints_owner(root) != me:
        atomic_write(root / OWNER, f"{me}\n".encode())


def _checkpoints_owner(root: Path) -> str | None:
    marker = root / OWNER
    if marker.is_symlink() or not marker.is_file():
        return None
    try:
        return read_text(marker, max_bytes=4096).strip()
    except BadFile:
        return "(unreadable)"


def resolve_resume(resume: str | None, run_dir: Path | None) -> Path | None:
    """`--resume auto` → the run directory's latest checkpoint (None: start fresh);
    `--resume PATH` → that checkpoint, or a run directory's latest."""
    if resume is None:
        return None
    if resume == "auto":
        if run_dir is None:
            raise LoomError("--resume auto needs the run directory: pass --out RUN_DIR")
        return latest_checkpoint(run_dir)
    path = Path(resume)
    if not path.exists():
        raise LoomError(f"--resume {resume}: no such checkpoint or run directory; pass "
                        f"RUN_DIR/checkpoints/step_N, a run directory, or auto")
    if (path / CHECKPOINTS).is_dir() or path.name == CHECKPOINTS:
        found = latest_checkpoint(path if path.name != CHECKPOINTS else path.parent)
        if found is None:
            raise LoomError(f"--resume {resume}: the run directory has no complete checkpoint yet; "
                            f"start without --resume")
        return found
    if path.parent.name == CHECKPOINTS:  # a run's own step_N: a link there leads out of the run
        _not_a_link(path)
    check_complete(path)
    return path


def check_complete(path: Path) -> None:
    if path.name.startswith(TMP_PREFIX):
        raise LoomError(f"{path} is an unfinished checkpoint (the writer stopped before it completed); "
                        f"resume from a step_N folder beside it")
    missing = [n for n in (META, ".metadata") if not (path / n).is_file()]
    if missing:
        raise LoomError(f"{path} is not a complete loom checkpoint (no {' or '.join(missing)}); "
                        f"pass RUN_DIR/checkpoints/step_N")


def read_meta(path: Path) -> dict:
    """meta.json, its fields typed and checked (loom.checked): the step, the world size, the run's
    config (TOML text loom's config reads), the LR schedule's counters, and, where present, the
    layout, data position and model record. Other keys are returned as they are, for the readers
    that check their own."""
    check_complete(path)
    source = path / META
    with _earlier_if_damaged():
        doc = Fields(read_json(source, max_bytes=_META_BYTES), source)
        doc.int("step", min=0)
        doc.int("world_size", min=1)
        text = doc.str("config")
        try:
            tomllib.loads(text)
            load_config_text(text)
        except tomllib.TOMLDecodeError as e:
            raise BadFile(f"{source}: config is not valid TOML ({e})") from None
        except ConfigError as e:
            raise BadFile(f"{source}: config holds a setting loom does not read ({e})") from None
        schedule = _schedule_fields(doc.section("scheduler"))
        doc.section("layout", default={}).str("strategy", default="?")
        data = doc.section("data", default={})
        for key in ("next_global_batch", "samples_seen", "tokens_seen"):
            data.int(key, default=0, min=0)
        if "sources" in data:  # source_identity's record of what the run trained on
            listed = _list_fields(data, "sources", len(data.list("sources", of=dict, max_len=4096)))
            for i in listed.keys():
                for key in ("spec", "path", "fingerprint"):
                    listed.section(i).str(key)
        _step_agrees(doc.raw, schedule, source)
        doc.section("model_config", default={})
        if "lora_base" in doc:  # a LoRA run's base (loom/train/lora_base.py)
            base = doc.section("lora_base")
            base.str("path")
            base.str("fingerprint", nonempty=True)
        doc.float("saved_at", default=0.0)
    return doc.raw


def _step_agrees(meta: dict, schedule: dict, source: Path) -> None:
    """meta.json's step is where the LR schedule and the data position stand too (both count one per
    step, skipped updates included): a step edited or damaged alone would resume the schedule and
    the data at one place and call it another."""
    step = meta["step"]
    others = [("the LR schedule (scheduler.last_epoch)", schedule["last_epoch"])]
    if "next_global_batch" in meta.get("data", {}):
        others.append(("the data position (data.next_global_batch)", meta["data"]["next_global_batch"]))
    wrong = [f"{what} says {value}" for what, value in others if value != step]
    if wrong:
        raise BadFile(f"{source}: step is {step}, but {' and '.join(wrong)}; the file was altered or damaged")


_EARLIER = "resume from an earlier checkpoint"
_META_BYTES = 64 << 20  # a meta.json is kilobytes: a bound on what a damaged or hostile one makes loom read


@contextlib.contextmanager
def _earlier_if_damaged() -> Iterator[None]:
    """A checkpoint file's one-line error (loom.checked's), with the way out added."""
    try:
        yield
    except BadFile as e:
        raise BadFile(f"{e}; {_EARLIER}") from None


def _schedule_fields(doc: Fields) -> dict:
    """The LR schedule's counters (meta.json's `scheduler`): whole numbers ≥ 0 and, one per
    parameter group, finite learning rates ≥ 0."""
    out = {key: doc.int(key, min=0) for key in ("last_epoch", "_step_count")}
    for key in ("base_lrs", "_last_lr"):
        lrs = _list_fields(doc, key, len(doc.list(key)))
        out[key] = [lrs.float(i, min=0) for i in lrs.keys()]
    return out


def _list_fields(doc: Fields, key: str, length: int) -> Fields:
    """`doc[key]`, a list of exactly `length` items, as Fields over its indexes (`key.0`, …)."""
    values = doc.list(key)
    if len(values) != length:
        raise doc.error(key, f"a list of {length} items", values)
    return Fields(dict(enumerate(values)), doc.source, doc.name(key))


# ---------------------------------------------------------------------------------------------
# The state: model and optimizer tensors under the full model's parameter names


@dataclass
class _Names:
    """Parameter names as the checkpoint writes them, for one rank's model part(s).

    Several pipeline stages on one rank are an nn.ModuleList whose names start with the stage's
    list index; the checkpoint drops it (stage modules keep the full model's names)."""

    model: nn.Module
    multi: bool

    def to_ckpt(self, name: str) -> str:
        return name.split(".", 1)[1] if self.multi else name

    def rename(self, d: dict, to_ckpt: bool, known: list[str]) -> dict:
        if not self.multi:
            return d
        back = {self.to_ckpt(k): k for k in known}
        return {(self.to_ckpt(k) if to_ckpt else back[k]): v for k, v in d.items()}


def _state(model: nn.Module, optimizer, d) -> tuple[dict[str, torch.Tensor], dict, _Names]:
    """(flat tensors for DCP, the optimizer's torch state dict to write back into, names)."""
    names = _Names(model, isinstance(model, nn.ModuleList))
    model_sd = get_model_state_dict(model, options=_options(model))
    known = list(model_sd)
    flat = {f"model.{k}": v for k, v in names.rename(model_sd, True, known).items()}
    if is_zero1(optimizer):
        osd = None
        opt_state = owned_states(optimizer, names.rename(model_sd, True, known), d)
    else:
        osd = get_optimizer_state_dict(model, optimizer)  # creates states when there are none yet
        opt_state = names.rename(osd["state"], True, known)
    for name, states in opt_state.items():
        for key, t in states.items():
            flat[f"optim.{name}.{key}"] = t
    return flat, {"torch": osd, "model_sd": model_sd, "known": known}, names


# ---------------------------------------------------------------------------------------------
# Saving


def _options(model: nn.Module) -> StateDictOptions:
    """What a checkpoint holds of the model: what trains. With a frozen base (LoRA), the adapters
    alone; the base is the run's model.init_from (or initialization), checked by lora_base."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def checkpoint_meta(cfg: Config, step: int, d, task) -> dict:
    """What a checkpoint records besides tensors: the layout that wrote it and the data position
    (global batch `step` is next; the sampler gives the same one under any layout)."""
    layout = {"strategy": cfg.parallel.strategy, "world_size": d.world_size,
              "mesh": dict(zip(d.mesh.mesh_dim_names, d.mesh.shape))}
    record = {"model_config": task.model_record} if task.model_record is not None else {}
    base = lora_base.identity(cfg)
    if base is not None:
        record["lora_base"] = base
    return {"layout": layout, "model": task.description, **record,
            "data": {"next_global_batch": step, "samples_seen": step * cfg.train.batch_size,
                     "tokens_seen": step * cfg.train.batch_size * task.tokens_per_sample,
                     "seed": cfg.train.seed, "sources": source_identity.identity(cfg.data)}}


def _rng_state() -> dict:
    def b64(t: torch.Tensor) -> str:
        return base64.b64encode(t.numpy().tobytes()).decode()

    np_state = np.random.get_state()
    py_state = random.getstate()
    return {
        "torch": b64(torch.get_rng_state()),
        "cuda": [b64(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }


def _set_rng_state(state: dict) -> None:
    """Restore the states `_read_rng` checked (CUDA's when this host has as many devices)."""
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def check_rng_files(path: Path, meta: dict) -> None:
    """Every rank's rng_rank<r>.json, read and checked as `load` will read it: the launcher does
    it once before any rank starts, so that a damaged one is one line, not one error per rank."""
    for rank in range(meta["world_size"]):
        _read_rng(path / f"rng_rank{rank}.json")


def _read_rng(path: Path) -> dict:
    """rng_rank<r>.json as the states `_rng_state` wrote, each field of its type and length."""
    with _earlier_if_damaged():
        doc = Fields(read_json(path, max_bytes=1 << 20), path)
        state = {"torch": _generator(doc, "torch", torch.get_rng_state().numel())}
        cuda = _list_fields(doc, "cuda", len(doc.list("cuda")))
        state["cuda"] = [_generator(cuda, i) for i in cuda.keys()]
        n = _list_fields(doc, "numpy", 5)
        key = n.list(1, of=int)
        if not _mt_words(key):
            raise n.error(1, "624 integers in [0, 2^32) (MT19937's key)", key)
        state["numpy"] = (n.str(0, choices=("MT19937",)), np.array(key, dtype=np.uint32),
                          n.int(2, min=0, max=624), n.int(3, min=0, max=1), n.float(4))
        py = _list_fields(doc, "python", 3)
        internal = py.list(1, of=int)
        if len(internal) != 625 or not _mt_words(internal[:624]) or not 1 <= internal[624] <= 624:
            raise py.error(1, "624 integers in [0, 2^32) and a position in [1, 624]", internal)
        gauss = None if py.raw[2] is None else py.float(2)
        state["python"] = (py.int(0, min=3, max=3), tuple(internal), gauss)
    return state


def _generator(fields: Fields, key, size: int | None = None) -> torch.Tensor:
    """A torch generator's state, base64 text of `size` bytes (any, when None)."""
    text = fields.str(key)
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        raw = None
    if not raw or (size is not None and len(raw) != size):
        raise fields.error(key, f"a torch generator's state ({size or 'its'} bytes, base64)", text)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _mt_words(values: list[int]) -> bool:
    return len(values) == 624 and all(0 <= w < 1 << 32 for w in values)  # a Mersenne Twister's key


class Checkpointer:
    """Saves this rank's share of each checkpoint; rank 0 publishes it when every rank is done.

    `async_save` overlaps the write with training: DCP stages the tensors to host memory, a
    background thread writes them (its collectives on a separate gloo group, never interleaved
    with training's), and the checkpoint is published once that write has completed.
    """

    def __init__(self, run_dir: Path, cfg: Config, d, keep_last: int, async_save: bool):
        self.root = run_dir / CHECKPOINTS
        self.cfg, self.d, self.keep_last, self.async_save = cfg, d, keep_last, async_save
        self.pending: tuple[Future, int] | None = None
        self.needed = 0  # bytes of the checkpoint being written
        self.group = dist.new_group(backend="gloo") if async_save else None
        self.stall_s: list[float] = []  # training time spent in each save call
        if d.is_main:
            claim_checkpoints_dir(run_dir)  # a linked folder of another run's: refused, never cleaned up
            for stale in self.root.glob(f"{TMP_PREFIX}*"):  # left by a killed writer (a link: only itself)
                if stale.is_dir() and not stale.is_symlink():
                    shutil.rmtree(stale, ignore_errors=True)
                else:
                    stale.unlink(missing_ok=True)
        dist.barrier()

    def save(self, step: int, model: nn.Module, optimizer, scheduler, meta: dict) -> None:
        start = time.perf_counter()
        self.wait()  # one write in flight at a time
        tmp = self.root / f"{TMP_PREFIX}{step_name(step)}"
        if deepspeed_engine.is_engine(model):
            flat = deepspeed_engine.full_states(model, optimizer, self.d.rank, self.d.world_size)
        else:
            flat, _, _ = _state(model, optimizer, self.d)
        local_error = None
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            (tmp / f"rng_rank{self.d.rank}.json").write_text(json.dumps(_rng_state()))
            if self.d.is_main:
                meta = {**meta, "step": step, "scheduler": scheduler.state_dict(),
                        "world_size": self.d.world_size, "config": to_toml(self.cfg), "saved_at": time.time()}
                # the tokenizer files export copies: carried inside the checkpoint, recorded by sha256
                meta[tokenizer_copy.META_KEY] = tokenizer_copy.save(self.cfg, tmp)
                (tmp / META).write_text(json.dumps(meta, indent=1))
        except OSError as e:
            local_error = e
        # Agreed before DCP starts: every rank's bytes and free space, and its small files' fate.
        views: list = [None] * self.d.world_size
        dist.all_gather_object(views, (_bytes_to_write(flat), _free_bytes(self.root), _errno_of(local_error)))
        self.needed = _checkpoint_bytes([v[0] for v in views])
        free = min(v[1] for v in views)
        failed = next((v[2] for v in views if v[2] is not None), None)
        if failed is not None or self.needed > free:
            return self._failed(step, failed if failed is not None else errno.ENOSPC, free)
        try:
            writer = faults.checkpoint_writer(step, self.d.rank, tmp)
            if self.async_save:
                self.pending = (dcp.async_save(flat, storage_writer=writer, process_group=self.group), step)
            else:
                dcp.save(flat, storage_writer=writer)
        except (CheckpointException, OSError, RuntimeError) as e:  # DCP raises it on every rank
            return self._failed(step, _errno_of(e), _free_bytes(self.root), e)
        if not self.async_save:
            self._publish(step)
        self.stall_s.append(time.perf_counter() - start)

    def write_failed(self) -> bool:
        """Whether this rank's background write has failed (the ranks agree on it at each step)."""
        return self.pending is not None and self.pending[0].done() and self.pending[0].exception() is not None

    def poll(self) -> None:
        """Publish a finished background write (cheap: no waiting). A failed one waits for the
        ranks' agreement (write_failed), so that they all handle it at the same step."""
        if self.pending is not None and self.pending[0].done() and self.pending[0].exception() is None:
            self.wait()

    def wait(self) -> None:
        if self.pending is None:
            return
        future, step = self.pending
        self.pending = None
        try:
            future.result()
        except (CheckpointException, OSError, RuntimeError) as e:
            return self._failed(step, _errno_of(e), _free_bytes(self.root), e)
        self._publish(step)

    def _failed(self, step: int, code: int | None, free: int, error: BaseException | None = None) -> None:
        """Every rank, together: remove the partial folder; a storage fault then stops the run with
        one line (or, under train.on_ckpt_error = "continue", a warning, and training goes on);
        anything else is re-raised as it is."""
        tmp = self.root / f"{TMP_PREFIX}{step_name(step)}"
        if code is None and free < _NEARLY_FULL:
            code = errno.ENOSPC  # DCP's own message hides it ("unexpected pos …"); the file system says it
        dist.barrier()  # every rank has stopped writing into the folder
        if self.d.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        if code not in _STORAGE_ERRORS and error is not None:
            raise error
        previous = latest_checkpoint(self.root.parent)
        intact = f"the previous checkpoint {previous.name} is intact" if previous \
            else "there is none before it"
        message = (f"checkpoint {step_name(step)} could not be written to {self.root}: "
                   f"{_STORAGE_ERRORS.get(code, os.strerror(code))}; it needs {size_text(self.needed)}, "
                   f"the file system has {size_text(_free_bytes(self.root))} free; nothing of it is left, "
                   f"and {intact}")
        if self.cfg.train.on_ckpt_error == "continue":
            if self.d.is_main:
                print(f"loom: warning: {message}; training goes on without it (train.on_ckpt_error = "
                      f"\"continue\")", file=sys.stderr, flush=True)
            return
        raise CheckpointWriteError(f"{message}; free space (or lower train.keep_last, or --out elsewhere) "
                                   f"and continue with --resume auto, or set train.on_ckpt_error = "
                                   f"\"continue\" to train on without checkpoints")

    def _publish(self, step: int) -> None:
        """Rank 0, after DCP wrote `.metadata` (which it does only once every rank has written)."""
        faults.maybe_kill_in_checkpoint(step, self.d.rank)
        if not self.d.is_main:
            return
        tmp, final = self.root / f"{TMP_PREFIX}{step_name(step)}", self.root / step_name(step)
        if final.is_symlink():  # a link in its place is replaced, never followed or deleted through
            final.unlink()
        elif final.exists():  # the same step saved again (a resumed run): replace it whole
            self._remove(final)
        os.rename(tmp, final)
        fsync_dir(self.root)
        try:
            atomic_write(self.root / LATEST, (final.name + "\n").encode(), durable=True)
        except OSError:  # a full disk: without the marker, the newest step_N is found by a scan
            (self.root / LATEST).unlink(missing_ok=True)
        steps = checkpoint_steps(self.root)
        for _, old in steps[:max(len(steps) - self.keep_last, 0)]:
            self._remove(old)

    def _remove(self, checkpoint: Path) -> None:
        """Invisible first (renamed to .tmp-), so a crash never leaves half of one in view."""
        trash = self.root / f"{TMP_PREFIX}old-{checkpoint.name}"
        os.rename(checkpoint, trash)
        shutil.rmtree(trash)

    def close(self) -> None:
        self.wait()
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


class CheckpointWriteError(AgreedError):
    """A checkpoint could not be written (every rank raises it at the same step)."""


_STORAGE_ERRORS = {errno.ENOSPC: "no space left on the device (ENOSPC)", errno.EDQUOT: "disk quota exceeded "
                   "(EDQUOT)", errno.EROFS: "read-only file system (EROFS)", errno.EIO: "I/O error (EIO)"}
_NEARLY_FULL = 1 << 20  # bytes free after a failed write below which the failure was the full disk
_PIECE_OVERHEAD = 2048  # bytes around each rank's piece of a tensor: DCP's record, its index entry
_RANK_OVERHEAD = 64 << 10  # each rank's RNG states (and rank 0's meta.json)


def _bytes_to_write(flat: dict) -> dict[str, int]:
    """Each tensor's bytes in the checkpoint by name: a DTensor's whole size (its shards are written
    once between them), a replicated tensor's once (the same name on every rank)."""
    return {k: math.prod(t.shape) * t.element_size() for k, t in flat.items() if torch.is_tensor(t)}


def _checkpoint_bytes(per_rank: list[dict[str, int]]) -> int:
    sizes = {k: n for rank in per_rank for k, n in rank.items()}
    return sum(sizes.values()) + _PIECE_OVERHEAD * sum(map(len, per_rank)) + _RANK_OVERHEAD * len(per_rank)


def _free_bytes(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def _errno_of(e: BaseException | None) -> int | None:
    """The storage errno behind a failed write, wherever DCP wrapped it: the exception's chain, or
    '[Errno N]' in the text another rank's failure was pickled to."""
    if e is None:
        return None
    found = [e]
    if isinstance(e, CheckpointException):
        found += [exc for exc, _ in e.failures.values()]
    texts = []
    for exc in found:
        while exc is not None:
            if isinstance(exc, OSError) and exc.errno:
                return exc.errno
            texts.append(str(exc))
            exc = exc.__cause__ or exc.__context__
    m = re.search(r"\[Errno (\d+)\]", " ".join(texts))
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------------------------------------
# Loading


def _damaged(path: Path, e: BaseException) -> LoomError:
    if isinstance(e, CheckpointException) and e.failures:  # DCP wraps each rank's error
        e = next(iter(e.failures.values()))
        e = e[0] if isinstance(e, tuple) else e
    if isinstance(e, LoomError):  # refused by the safe reader: its own message says why
        return e
    earlier = [p for s, p in checkpoint_steps(path.parent) if p != path]
    return safe_load.unreadable(path, e, f"resume from an earlier one ({earlier[-1]})" if earlier else
                                "start without --resume")


def check_resumable(meta: dict, cfg: Config, path: Path) -> None:
    """Refuse a resume whose settings would change the model or which sequences step k sees."""
    saved = load_config_text(meta["config"])
    before, now = _model_fields(saved), _model_fields(cfg)
    conflicts = [f"model.{key} = {before[key]!r} in the checkpoint, {now[key]!r} now"
                 for key in before if before[key] != now[key]]
    for dotted in RESUME_FIXED:
        section, key = dotted.split(".")
        before, now = getattr(getattr(saved, section), key), getattr(getattr(cfg, section), key)
        if before != now:
            conflicts.append(f"{dotted} = {before!r} in the checkpoint, {now!r} now")
    saved_sources = meta.get("data", {}).get("sources")
    if saved_sources is None and saved.data.source != cfg.data.source:  # written before loom recorded them
        conflicts.append(f"data.source = {saved.data.source!r} in the checkpoint, {cfg.data.source!r} now")
    if conflicts:
        raise LoomError(f"cannot resume from {path}: {'; '.join(conflicts)}; keep the checkpoint's values "
                        f"(its config is in {path / META}) or start a new run without --resume")
    lora_base.check(meta.get("lora_base"), lora_base.identity(cfg), path)
    if saved_sources is not None:
        source_identity.check(saved_sources, source_identity.identity(cfg.data), path)
    if meta["step"] >= cfg.train.steps:
        raise LoomError(f"{path} is at step {meta['step']} and train.steps = {cfg.train.steps}: nothing left "
                        f"to train; raise train.steps "
                        f"(e.g. --set train.steps={meta['step'] + cfg.train.steps})")


def _model_fields(cfg: Config) -> dict:
    """The model's resolved shape settings (the preset with the config's overrides)."""
    m = cfg.model
    overrides = shape_overrides(m)
    try:
        return asdict(preset(m.preset, **overrides))
    except LoomError:  # not one of loom's presets (a user's model): compare the settings as given
        return dict(vars(m))


def load(path: Path, model: nn.Module, optimizer, scheduler, cfg: Config, d) -> dict:
    """Fill this rank's (possibly differently sharded) model and optimizer from `path`; restore
    the LR schedule and RNG states. Returns the checkpoint's meta (its step, data position).

    Before any tensor is read, the checkpoint's index must hold exactly the entries this layout
    saves (every rank's, gathered), each a tensor of the same dtype and global shape."""
    meta = read_meta(path)
    check_resumable(meta, cfg, path)
    if deepspeed_engine.is_engine(model):
        _load_deepspeed(path, model, optimizer, d, meta["step"])
        return _restore_schedule_and_rng(path, meta, optimizer, scheduler, d)
    flat, held, names = _state(model, optimizer, d)
    mine = {k: (v.dtype, tuple(v.shape)) for k, v in flat.items()}
    everyone: list[dict] = [{} for _ in range(d.world_size)]
    dist.all_gather_object(everyone, mine)  # pipeline stages and ZeRO-1 owners each hold a part
    metadata = safe_load.read_metadata(path)
    safe_load.check_entries(path, metadata, {k: v for part in everyone for k, v in part.items()})
    try:
        dcp.load(flat, storage_reader=safe_load.SafeReader(path, metadata), planner=safe_load.SafePlanner())
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - any failure to read is the same advice
        raise _damaged(path, e) from None
    _check_adam_steps(path, flat, meta["step"])
    _check_finite(path, flat)
    model_sd = held["model_sd"]
    for k in model_sd:
        model_sd[k] = flat[f"model.{names.to_ckpt(k)}"]
    set_model_state_dict(model, model_sd, options=_options(model))
    osd = held["torch"]  # None for ZeRO-1: DCP filled its local optimizer's own state tensors in place
    if osd is not None:
        for name, states in osd["state"].items():
            for key in states:
                states[key] = flat[f"optim.{names.to_ckpt(name)}.{key}"]
        set_optimizer_state_dict(model, optimizer, osd)
    return _restore_schedule_and_rng(path, meta, optimizer, scheduler, d)


def load_weights(path: Path, model: nn.Module, d) -> None:
    """The model's weights alone from a checkpoint (`model.init_from`): each rank reads the chunks
    that overlap its shards; the optimizer, schedule and data position start fresh."""
    names = _Names(model, isinstance(model, nn.ModuleList))
    # LoRA's adapters start from their own initialization: the checkpoint gives the base
    model_sd = {k: v for k, v in get_model_state_dict(model).items() if not is_adapter(k)}
    flat = {f"model.{k}": v for k, v in names.rename(model_sd, True, list(model_sd)).items()}
    everyone: list[dict] = [{} for _ in range(d.world_size)]
    dist.all_gather_object(everyone, {k: (v.dtype, tuple(v.shape)) for k, v in flat.items()})
    metadata = safe_load.read_metadata(path)
    safe_load.check_entries(path, metadata, {k: v for part in everyone for k, v in part.items()}, "model.")
    _dcp_load(path, flat, metadata)
    _check_finite(path, flat, "point model.init_from at an earlier checkpoint")
    for k in model_sd:
        model_sd[k] = flat[f"model.{names.to_ckpt(k)}"]
    set_model_state_dict(model, model_sd, options=StateDictOptions(strict=False))


def _dcp_load(path: Path, state: dict, metadata) -> None:
    try:
        dcp.load(state, storage_reader=safe_load.SafeReader(path, metadata), planner=safe_load.SafePlanner())
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - any failure to read is the same advice
        raise _damaged(path, e) from None


def _load_deepspeed(path: Path, engine, optimizer, d, step: int) -> None:
    """The deepspeed engine reads whole tensors (every rank all of them: its fragments come from
    them) and writes them into its partitions."""
    expected = deepspeed_engine.checkpoint_entries(engine)
    metadata = safe_load.read_metadata(path)
    safe_load.check_entries(path, metadata, expected)
    tensors = {k: torch.empty(shape, dtype=dtype) for k, (dtype, shape) in expected.items()}
    try:
        dcp.load(tensors, storage_reader=safe_load.SafeReader(path, metadata),
                 planner=safe_load.SafePlanner())
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - any failure to read is the same advice
        raise _damaged(path, e) from None
    _check_adam_steps(path, tensors, step)
    _check_finite(path, tensors)
    deepspeed_engine.load_full_states(engine, optimizer, tensors)


def _check_adam_steps(path: Path, tensors: dict, step: int) -> None:
    """AdamW's step counts are whole numbers ≥ 0 (a NaN one would turn every update into NaN), at
    most the checkpoint's step (a skipped update does not count; a meta.json step edited below
    the optimizer's would restart the schedule and the data behind the moments)."""
    for name, t in tensors.items():
        if name.startswith("optim.") and name.endswith(".step") and type(t) is torch.Tensor \
                and t.numel() == 1:
            count = float(t)
            if not math.isfinite(count) or count < 0 or count != int(count):
                raise LoomError(f"checkpoint {path} holds {name} = {count}, not a step count (a whole number "
                                f"≥ 0); it is damaged or was altered: {_EARLIER}")
            if count > step:
                raise LoomError(f"checkpoint {path} holds {name} = {int(count)} updates, more than its step "
                                f"({step}, meta.json's); it is damaged or was altered: {_EARLIER}")


def _check_finite(path: Path, tensors: dict, way_out: str = _EARLIER) -> None:
    """Weights and optimizer states are finite: loom never applies a non-finite update, so a NaN or
    Inf was written into the file afterwards (or the disk damaged it); training from it would skip
    every update. Each rank checks what it read, and all ranks agree before any raises."""
    found = [name for name, t in tensors.items()  # fp32 sum: NaN/Inf where a value is (no weight nears 1e38)
             if isinstance(t, torch.Tensor) and t.is_floating_point()
             and not math.isfinite(float(_local(t).sum(dtype=torch.float32)))]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, found)
    bad = sorted({name for part in everyone for name in part})
    if bad:
        more = f" (and {len(bad) - 1} other tensors)" if len(bad) > 1 else ""
        raise AgreedError(f"checkpoint {path} holds non-finite values (NaN/Inf) in {bad[0]}{more}: the file "
                          f"was damaged or altered after loom wrote it; {way_out}")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _restore_schedule_and_rng(path: Path, meta: dict, optimizer, scheduler, d) -> dict:
    scheduler.load_state_dict(_scheduler_state(path, meta["scheduler"], scheduler))
    # The next step's LR from this run's config (a resume may change train.lr, steps or warmup):
    # the same product LambdaLR.step computes, so an unchanged config resumes bit for bit.
    scheduler._last_lr = [base * factor(scheduler.last_epoch)
                          for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr
    if is_zero1(optimizer):
        for group, lr in zip(local_optimizer(optimizer).param_groups, scheduler.get_last_lr()):
            group["lr"] = lr
    rng = path / f"rng_rank{d.rank}.json"
    if meta["world_size"] != d.world_size:
        rng = path / "rng_rank0.json"  # another layout: every rank takes rank 0's streams
    state = _read_rng(rng)
    try:
        _set_rng_state(state)
    except (ValueError, TypeError, RuntimeError) as e:  # the generators' own checks of a state's content
        raise LoomError(f"{rng} is damaged ({type(e).__name__}: {str(e)[:120]}); {_EARLIER}") from None
    return meta


def _scheduler_state(path: Path, saved: dict, scheduler) -> dict:
    """The LR schedule's counters from meta.json, checked: LambdaLR.load_state_dict would set
    any attribute a file names, so only these keys, of these types, finite, are taken."""
    state = scheduler.state_dict()
    groups = len(state["base_lrs"])
    doc = Fields(saved, path / META, "scheduler")
    with _earlier_if_damaged():
        for key in ("base_lrs", "_last_lr"):
            _list_fields(doc, key, groups)  # one learning rate per parameter group of this optimizer
        # the counters from the file; the base LRs are this run's train.lr (a resume may change it)
        return {**state, **_schedule_fields(doc), "base_lrs": state["base_lrs"]}


def read_tensors(path: Path, prefix: str = "model.", expected: safe_load.Expected | None = None
                 ) -> dict[str, torch.Tensor]:
    """Every tensor under `prefix`, whole, without a process group (export, inspection). With
    `expected`, the entries under `prefix` must be exactly those, with those dtypes and shapes."""
    check_complete(path)
    metadata = safe_load.read_metadata(path)
    entries = {k: m for k, m in metadata.state_dict_metadata.items() if k.startswith(prefix)}
    if expected is not None:
        safe_load.check_entries(path, metadata, expected, prefix)
    out = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in entries.items()}
    try:
        with warnings.catch_warnings():  # "no process group: loading in a single process" is the intent
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(out, storage_reader=safe_load.SafeReader(path, metadata),
                     planner=safe_load.SafePlanner(), no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001
        raise _damaged(path, e) from None
    return {k[len(prefix):]: v for k, v in out.items()}
