"""The `loom` command: train, plan, profile and analyze.

User errors end as one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

from loom import __version__
from loom.errors import LoomError


def _add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="TOML config file (defaults are used without one)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value, e.g. --set parallel.strategy=ddp (repeatable)")
    # a string, not a Path: an empty --out (an unset $RUN) must be refused, not read as "."
    p.add_argument("--out", help="run directory (default runs/<time>-<strategy>)")
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks on this machine (default: one per GPU, or 2 on a CPU-only host)")
    p.add_argument("--nnodes", type=int, default=1, help="machines in the run")
    p.add_argument("--node-rank", type=int, default=None, help="this machine's rank (static rendezvous)")
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous, same on every node")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="torchrun restarts of a failed group; each restart resumes from the latest "
                        "checkpoint")
    p.add_argument("--resume", metavar="auto|PATH",
                   help="continue from a checkpoint: auto (the --out run's latest) or "
                        "RUN_DIR/checkpoints/step_N")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out run directory (only one loom made, holding nothing this "
                        "run reads; removed once every other check has passed)")


def cmd_train(args: argparse.Namespace) -> int:
    from loom.config import inert_settings, validate
    from loom.launch import LaunchSpec, check_spec, default_nproc, under_launcher

    if args.out is not None:
        args.out = _out_dir(args.out)
    if args.resume is not None and not args.resume.strip():  # an unset $CKPT, not "." (the working directory)
        raise LoomError('--resume is empty (an unset variable, as in --resume "$CKPT"?); pass auto or '
                        'RUN_DIR/checkpoints/step_N, or leave --resume out to start from scratch')
    launching = args.nproc is not None or args.nnodes > 1 or args.rdzv_endpoint is not None
    if args.resume == "auto" and args.out is not None and not under_launcher(launching):
        _check_continued_dir(args.out)  # before its config.toml is read as the run's
    cfg, run_config, note = _run_config(args)
    if under_launcher(launching):  # a rank started by torchrun/srun: join and train
        return _train_rank(cfg, args)

    from loom.train import faults

    faults.planted()  # a malformed LOOM_FAULTS fails here, once, not on every rank
    spec = LaunchSpec(nproc=args.nproc if args.nproc is not None else default_nproc(), nnodes=args.nnodes,
                      node_rank=args.node_rank,
                      rdzv_endpoint=args.rdzv_endpoint, max_restarts=args.max_restarts)
    check_spec(spec)
    for inert in inert_settings(cfg, validate(cfg, spec.world_size)):
        print(f"loom: note: {inert}", flush=True)
    from loom.plan import device

    device.load(required=False)  # plan.json prices the run on it: a damaged profile fails here, not in ranks
    run_dir = args.out or Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.parallel.strategy}"
    replace = _check_run_dir(cfg, run_dir, args, spec)
    from loom.data.source_identity import check_out

    check_out(cfg.data, run_dir)  # the run's own files would join a folder it reads
    model = _preflight_data(cfg, spec.world_size)
    _check_resume(cfg, run_dir, args.resume, model)
    if note:  # (on stdout, as the run's other news: stderr stays one line when a rank fails)
        print(f"loom: {note}", flush=True)
    if run_config is not None:
        _print_changes(run_config, cfg)
    if getattr(args, "dry_run", False):  # every check has passed: say what would run, start nothing
        from loom.train.dry_run import print_dry_run

        print_dry_run(cfg, model, spec.world_size, spec.nproc)
        return 0
    again = _continue_command(args, run_dir)
    from loom.files import release_run_dir

    lock = None
    if spec.nnodes == 1 or spec.node_rank == 0:  # every check has passed: only now is anything removed
        lock = _take_run_dir(run_dir, replace)
    try:
        return _launch_run(cfg, args, spec, run_dir, again)
    finally:
        release_run_dir(lock)


def _launch_run(cfg, args: argparse.Namespace, spec, run_dir: Path, again: str) -> int:
    """Train in this process (one rank) or under torchrun (several), and say how it ended."""
    from loom.train.stop import preempt_signal

    if spec.world_size == 1 and spec.nnodes == 1:
        from loom.parallel.mesh import shutdown
        from loom.train.driver import train
        from loom.train.stop import Stopped

        try:
            train(cfg, run_dir, resume=args.resume)
        except Stopped as e:
            return _stopped(e.signum, run_dir, again, e.note)
        finally:
            shutdown()
        return 0
    forwarded = ([args.config] if args.config else []) + [a for s in args.set for a in ("--set", s)]
    if args.resume:
        forwarded += ["--resume", args.resume]
    ended, launch = _relaunch(spec, ["train", *forwarded, "--out", str(run_dir)], preempt_signal(cfg),
                              run_dir / "logs")
    stopped = _stop_record(run_dir, launch)
    if stopped is not None:
        return _stopped(stopped["signal"], run_dir, again, stopped.get("note"))
    if ended.report is not None:
        print(f"loom: error: {ended.report}", file=sys.stderr)
        return 1
    if ended.asked and ended.code == -9:
        print(f"loom: aborted (second Ctrl-C); the last complete checkpoint: "
              f"{_latest(run_dir) or 'none'}", file=sys.stderr)
        return 130
    if ended.code != 0:
        print(f"loom: error: training exited with code {ended.code} (the failing rank's message is above)",
              file=sys.stderr)
    return ended.code


def _train_rank(cfg, args: argparse.Namespace) -> int:
    """One rank of a group torchrun or srun started. A stop or an error all ranks agreed on is left
    for loom's launcher to print once (the ranks exit 0, so torchrun adds no failure report of its
    own); under srun, rank 0 prints it and every rank exits with its code. Any other LoomError
    (one rank's, or each rank's on its own) is left for the launcher too, which then ends torchrun
    before it reports a failed rank (launch.end_launch): the user sees one line either way."""
    import traceback

    from loom.errors import AgreedError
    from loom.launch import (
        STOP_FILE_ENV,
        adopt_slurm_env,
        check_rank_env,
        die_with_parent,
        end_launch,
        keep_for_restart,
        report_to_launcher,
    )
    from loom.parallel.mesh import shutdown
    from loom.train.driver import train
    from loom.train.stop import Stopped, listen, preempt_signal

    check_rank_env()  # a RANK or SLURM_NTASKS left in a shell: one line, not torch's rendezvous error
    listen(preempt_signal(cfg))  # a stop signal during setup is honoured at step 1
    adopt_slurm_env()
    die_with_parent()  # never an orphan: torchrun's agent (or srun's step) gone, this rank goes
    first = os.environ.get("RANK") == "0"
    try:
        train(cfg, args.out, resume=args.resume)
    except Stopped as e:  # checkpoint saved: rank 0 left stopped.json
        if STOP_FILE_ENV in os.environ:
            return 0
        if first and args.out:
            return _stopped(e.signum, args.out, _continue_command(args, args.out), e.note)
        return e.code
    except AgreedError as e:
        if report_to_launcher(str(e)):
            return 0
        if first:
            print(f"loom: error: {e}", file=sys.stderr)
        return 1
    except LoomError as e:
        end_launch(str(e))  # under loom's launcher, does not return
        print(f"loom: error: {e}", file=sys.stderr)
        return 1
    except Exception:  # (a peer died: a broken collective) torchrun restarts the group, which says so
        if keep_for_restart(traceback.format_exc()):
            return 1
        raise
    finally:
        shutdown()
    return 0


def _relaunch(spec, loom_args: list[str], preempt: int, log_dir: Path):
    """The ranks under torchrun, told this launch's id (which rank 0 writes into stopped.json);
    torchrun's log, and the ranks' that fail with a restart left, in `log_dir`."""
    import uuid

    from loom.launch import relaunch
    from loom.train.driver import LAUNCH_ENV

    launch, before = uuid.uuid4().hex, os.environ.get(LAUNCH_ENV)
    os.environ[LAUNCH_ENV] = launch
    try:
        return relaunch(spec, loom_args, preempt, log_dir), launch
    finally:
        if before is None:
            os.environ.pop(LAUNCH_ENV, None)
        else:
            os.environ[LAUNCH_ENV] = before


def _stop_record(run_dir: Path, launch: str) -> dict | None:
    """What rank 0 wrote when the ranks stopped on request during this launch (stopped.json, which
    names the launch: a file left by another launch, or planted, is not this run's stop)."""
    import signal

    from loom.checked import BadFile, Fields, read_json

    path = run_dir / "stopped.json"
    if not path.is_file():
        return None
    try:
        doc = Fields(read_json(path, max_bytes=1 << 16), path)
    except BadFile:  # not written by this launch: rank 0 writes it whole (atomic_write)
        return None
    launches = doc.raw.get("launches")  # every node's launch id: only ours makes the record ours
    if not isinstance(launches, list) or launch not in launches:
        return None
    signum = doc.int("signal", min=1, max=signal.NSIG - 1)
    if signum not in {s.value for s in signal.Signals}:
        raise doc.error("signal", "a signal's number", signum)
    return {"signal": signum, "note": doc.str("note", default=None)}


def _latest(run_dir: Path):
    from loom.train.checkpoint import latest_checkpoint

    return latest_checkpoint(run_dir) if run_dir.is_dir() else None


def _stopped(signum: int, run_dir: Path, again: str, note: str | None = None) -> int:
    """The one line of a graceful stop (and what became of the Slurm job), the signal's exit code.
    `again`: the command that continues the run (_continue_command)."""
    import signal

    from loom.launch import exit_code
    from loom.train.checkpoint import read_meta

    last = _latest(run_dir)
    step = read_meta(last)["step"] if last is not None else None
    print(f"loom: interrupted ({signal.Signals(signum).name}) at step {step}; checkpoint {last}; "
          f"continue with: {again}", file=sys.stderr)
    if note:
        print(f"loom: {note}", file=sys.stderr)
    return exit_code(signum)


def _continue_command(args: argparse.Namespace, run_dir: Path) -> str:
    """The command that continues this run, to be copied as it is: --resume auto reads every
    setting from the run's config.toml; the launch options are this command's own."""
    import shlex

    from loom.launch import srun_tasks

    launch = []
    for flag, value, default in (("--nproc", args.nproc, None), ("--nnodes", args.nnodes, 1),
                                 ("--node-rank", args.node_rank, None),
                                 ("--rdzv-endpoint", args.rdzv_endpoint, None),
                                 ("--max-restarts", args.max_restarts, 0)):
        if value != default:
            launch += [flag, str(value)]
    return shlex.join([*srun_tasks(), "loom", "train", "--resume", "auto", "--out", str(run_dir), *launch])


def _run_config(args: argparse.Namespace):
    """(the config this command trains, the run's config it continues or None, a note or None).

    A resume continues the run as it was configured, its config.toml (what the run trains; the
    checkpoint's saved config where the run has none), with only what this command gives on top:
    a config file, then --set. Every rank computes the same: the file and --set applied again
    over a config.toml that already holds them (rank 0 rewrites it at the start) change nothing."""
    from loom.config import load_config

    base, note = _resumed_config(args) if args.resume else (None, None)
    return load_config(args.config, args.set, base), base, note


def _resumed_config(args: argparse.Namespace):
    """The config of the run --resume continues, and a note where it is not its config.toml."""
    from loom.checked import BadFile, read_text
    from loom.config import load_config_text
    from loom.errors import ConfigError
    from loom.train.checkpoint import CHECKPOINTS, read_meta, resolve_resume

    if args.resume == "auto":
        if args.out is None:
            raise LoomError("--resume auto continues the run --out names; pass --out RUN_DIR")
        run, ckpt = args.out, resolve_resume("auto", args.out) if args.out.is_dir() else None
    else:
        ckpt = resolve_resume(args.resume, None)
        run = ckpt.parent.parent if ckpt.parent.name == CHECKPOINTS else None
    path = run / "config.toml" if run is not None else None
    if path is not None and path.is_symlink() and ckpt is not None:  # planted: loom writes a file there
        return (load_config_text(read_meta(ckpt)["config"], f"{ckpt}'s config"),
                f"{path} is a symbolic link, not the config loom wrote; continuing with the config saved in "
                f"{ckpt} (the link is replaced, its target left as it is)")
    if path is not None and (path.exists() or path.is_symlink()):
        try:
            return load_config_text(read_text(path, max_bytes=1 << 20), str(path)), None
        except (BadFile, ConfigError) as e:
            instead = (f"to continue with the config saved in {ckpt / 'meta.json'}" if ckpt is not None
                       else "to start the run again from your config and --set")
            raise LoomError(f"{e} (config.toml is the run's config, which --resume continues: fix it, or "
                            f"delete it {instead})") from None
    if ckpt is None:  # nothing to continue yet: a new run
        return None, None
    note = None if run is None else f"{run} has no config.toml; continuing with the config saved in {ckpt}"
    return load_config_text(read_meta(ckpt)["config"], f"{ckpt}'s config"), note


def _print_changes(before, after) -> None:
    """One line per setting this command changes versus the run's config."""
    from loom.config import config_changes

    for key, old, new in config_changes(before, after):
        why = f" (the LR schedule follows the new total: it now decays to step {new})" \
            if key == "train.steps" else ""
        print(f"loom: resume changes {key} {old!r} → {new!r}{why}", flush=True)


def _out_dir(text: str) -> Path:
    if not str(text).strip():
        raise LoomError("--out is empty (an unset variable, as in --out \"$RUN\"?); name the run directory, "
                        "e.g. --out runs/first")
    return Path(text)


def _check_run_dir(cfg, run_dir: Path, args: argparse.Namespace, spec) -> bool:
    """Before anything is loaded: never write over a run without --overwrite, and let --overwrite
    replace only a run directory loom made (its marker, loom/files.py) that is not the working or
    home directory (or holds them) and holds nothing this run reads. Returns whether the directory
    is to be replaced, which `_take_run_dir` does once every other check has passed.

    Of several nodes sharing the run directory, node 0 alone owns it (the others would find the
    directory node 0 just made, or delete it); an elastic rendezvous names no node 0."""
    from loom.files import RUN_MARKER, is_loom_run

    resume, overwrite = args.resume, args.overwrite
    if overwrite and resume == "auto":
        raise LoomError("--overwrite deletes the run that --resume auto would continue; pass one of them")
    if overwrite and spec.nnodes > 1 and spec.node_rank is None:
        raise LoomError("--overwrite on several nodes: each would delete the run directory; delete it once "
                        "by hand, or give --node-rank (node 0 deletes it)")
    owner = spec.nnodes == 1 or spec.node_rank == 0
    exists = run_dir.exists() or run_dir.is_symlink()
    used = owner and exists and (not run_dir.is_dir() or not _set_up_for_a_run(run_dir))
    if not used:
        return False
    if not run_dir.is_dir():
        raise LoomError(f"--out {run_dir} is a file, not a run directory; pick another --out")
    if not overwrite:
        if resume != "auto":
            raise LoomError(f"run directory {run_dir} already exists; continue it with --resume auto, "
                            f"replace it with --overwrite, or pick a new --out")
        return False
    if run_dir.is_symlink():
        raise LoomError(f"--out {run_dir} is a symbolic link; --overwrite removes only a run directory "
                        f"itself: pass the folder it points to ({run_dir.resolve()}), or pick another --out")
    target = run_dir.resolve()
    for what, place in _never_removed():
        if target == place or place.is_relative_to(target):
            which = what if target == place else f"a folder holding {what} ({place})"
            raise LoomError(f"--overwrite would delete {run_dir}, which is {which}; loom replaces only a run "
                            f"directory of its own: pick another --out, e.g. --out runs/NAME")
    for what, path in _run_inputs(cfg, args):
        if Path(os.path.realpath(path)).is_relative_to(target):
            if what == "resume":
                raise LoomError(f"--overwrite would delete {run_dir}, which holds the checkpoint --resume "
                                f"{resume} names; pick a new --out to start from it")
            raise LoomError(f"--overwrite would delete {run_dir}, which holds {what} ({path}) that this run "
                            f"reads; move it out of the run directory, or pick another --out")
    if not is_loom_run(run_dir):
        raise LoomError(f"--overwrite would delete {run_dir}, which is not a run directory loom made (it has "
                        f"no {RUN_MARKER} marker); delete it by hand if you mean to, or pick another --out")
    return True


def _set_up_for_a_run(run_dir: Path) -> bool:
    """A folder nothing has run in yet: empty but for loom's marker and a `checkpoints` link to an
    empty folder (a scratch disk linked before the first run; the checkpoints' own check follows)."""
    from loom.files import RUN_MARKER
    from loom.train.checkpoint import CHECKPOINTS

    for p in run_dir.iterdir():
        linked_empty = p.name == CHECKPOINTS and p.is_symlink() and p.is_dir() and not any(p.iterdir())
        if p.name != RUN_MARKER and not linked_empty:
            return False
    return True


def _check_continued_dir(run_dir: Path) -> None:
    """`--resume auto` writes the run's files (summary.json, metrics.jsonl, checkpoints/ …) into
    --out: only into a run directory loom made, a new or empty folder, never the working or home
    directory (or above them), and only where its checkpoints folder is this run's."""
    from loom.files import RUN_ENTRIES, RUN_MARKER, check_run_entries, is_loom_run
    from loom.train.checkpoint import check_checkpoints_dir

    if not (run_dir.exists() or run_dir.is_symlink()):
        return
    if not run_dir.is_dir():
        raise LoomError(f"--out {run_dir} is a file, not a run directory; pick another --out")
    held = sorted(p.name for p in run_dir.iterdir() if p.name != RUN_MARKER)
    if not held:
        return
    target = run_dir.resolve()
    # A working folder an earlier `--out .` made holds only loom's entries: that run continues.
    # An older loom marked folders of the user's too, so the marker alone does not make it loom's.
    # Ranks that torchrun or srun started without the loom command never mark the run directory; one
    # holding a checkpoint of loom's is a run of loom's all the same.
    ours = is_loom_run(run_dir) or any((run_dir / "checkpoints").glob("step_*/meta.json"))
    only_loom = ours and set(held) <= RUN_ENTRIES
    for what, place in _never_removed():
        if not only_loom and (target == place or place.is_relative_to(target)):
            which = what if target == place else f"a folder holding {what} ({place})"
            raise LoomError(f"--resume auto would write loom's run files into {run_dir}, which is {which}; "
                            f"loom continues only a run directory of its own: pick another --out, e.g. "
                            f"--out runs/NAME")
    if not ours:  # what it holds is the user's
        shown = ", ".join(held[:3]) + (", …" if len(held) > 3 else "")
        raise LoomError(f"--resume auto --out {run_dir}: it is not a run directory loom made (no "
                        f"{RUN_MARKER} marker) and holds {shown}, which loom would write among; pick a new "
                        f"or empty --out")
    check_checkpoints_dir(run_dir)
    check_run_entries(run_dir)


def _never_removed() -> list[tuple[str, Path]]:
    """Folders --overwrite never removes, nor any folder above them."""
    places = [("the working directory", Path.cwd().resolve())]
    try:
        places.append(("your home directory", Path.home().resolve()))
    except RuntimeError:  # no $HOME and no user entry
        pass
    return places


def _run_inputs(cfg, args: argparse.Namespace) -> list[tuple[str, Path]]:
    """Every path this run reads (a glob by the folder it starts from), named as the user set it."""
    d, m, p = cfg.data, cfg.model, cfg.parallel
    named = [("the config file", args.config),
             *((f"data.mix source {e.get('source')!r}", e.get("source")) for e in d.mix),
             ("data.source", d.source if d.source != "stdlib" else None),
             ("data.tokenizer", d.tokenizer if d.tokenizer not in ("auto", "byte", "bpe") else None),
             ("model.init_from", m.init_from), ("parallel.deepspeed_config", p.deepspeed_config),
             ("parallel.nvme_path", p.nvme_path), ("resume", args.resume if args.resume != "auto" else None)]
    inputs = []
    for what, value in named:
        if isinstance(value, str | Path) and str(value):
            parts = Path(value).expanduser().parts
            glob = next((i for i, part in enumerate(parts) if any(c in part for c in "*?[")), len(parts))
            inputs.append((what, Path(*parts[:glob]) if glob else Path(".")))
    return inputs


def _take_run_dir(run_dir: Path, replace: bool) -> int:
    """The last moment before ranks start: --overwrite's removal (never of a run training now),
    then the run directory, made, marked as loom's and locked for this run (the lock's descriptor,
    for release_run_dir)."""
    import shutil

    from loom.files import RUN_LOCK, check_writable, claim_run_dir, lock_run_dir, release_run_dir
    from loom.train.checkpoint import CHECKPOINTS

    old = None
    if replace:
        if (run_dir / RUN_LOCK).is_file():  # (its lock goes with it: held until the new one is taken)
            old = lock_run_dir(run_dir)
        shutil.rmtree(run_dir)
    try:
        claim_run_dir(run_dir)
    except OSError as e:  # an unwritable folder (or one on the way to it)
        raise LoomError(f"cannot write the run directory {run_dir}: {e.strerror} ({e.filename}); pick an "
                        f"--out you can write to") from None
    check_writable(run_dir, "the run directory")  # one that exists, a continued run's
    if (run_dir / CHECKPOINTS).is_dir():
        check_writable(run_dir / CHECKPOINTS, "the run's checkpoints folder")
    try:
        return lock_run_dir(run_dir)
    finally:
        release_run_dir(old)


def _check_resume(cfg, run_dir: Path, resume: str | None, model) -> None:
    """Before any rank starts: the checkpoint to resume exists, is complete, matches the config and
    holds exactly the model's and AdamW's tensors (nothing in it is read as code; see
    loom/train/safe_load.py); the run's metrics.jsonl, which the resumed run keeps up to the
    checkpoint's step, is readable."""
    from loom.train import safe_load
    from loom.train.checkpoint import check_resumable, check_rng_files, read_meta, resolve_resume
    from loom.train.meters import kept_metrics

    path = resolve_resume(resume, run_dir) if resume else None
    if path is not None:
        meta = read_meta(path)
        check_resumable(meta, cfg, path)
        prof, done = cfg.profile, meta["step"]
        needs = prof.wait + prof.warmup + prof.active
        if prof.enabled and needs > cfg.train.steps - done:  # (the traces would be replaced by a part)
            raise LoomError(f"the profiler needs profile.wait + warmup + active = {needs} steps but this "
                            f"resume trains {cfg.train.steps - done} (steps {done + 1}..{cfg.train.steps}); "
                            f"raise train.steps to at least {done + needs}, or lower profile.active")
        _check_same_model(meta, cfg, model, path)
        check_rng_files(path, meta)
        expected = safe_load.trained_entries(_as_trained(cfg, model.build("meta")), cfg.train.optimizer)
        safe_load.check_entries(path, safe_load.read_metadata(path), expected)
        kept_metrics(run_dir / "metrics.jsonl", meta["step"])


def _as_trained(cfg, built):
    """The meta model as training holds it: under LoRA, adapters added and the base frozen (its
    checkpoint holds the adapters, what else trains and the buffers; loom/train/driver.py)."""
    if cfg.lora.rank is not None:
        from loom.config import lora_base_dtype
        from loom.models.lora import apply_lora, blocks_of
        from loom.models.registry import adapter_for
        from loom.parallel import precision

        apply_lora(built, blocks_of(adapter_for(built).layers(built)), cfg.lora,
                   precision.DTYPES[lora_base_dtype(cfg)], cfg.train.seed)
    return built


def _check_same_model(meta: dict, cfg, model, path: Path) -> None:
    """The model this config builds is the checkpoint's (its meta.json's model record): a resume
    that changes model.init_from, or the folder it names, is told so, not that the tensors of the
    other model it meets look altered."""
    from loom.config import load_config_text

    saved, now = meta.get("model_config") or {}, model.record() or {}
    kind = next((k for k in ("gpt", "hf_config") if isinstance(saved.get(k), dict)), None)
    if kind is None or saved[kind] == now.get(kind):  # (a checkpoint without a record: the tensor check)
        return
    names = {"gpt": "loom's GPT", "hf_config": "a Hugging Face model"}
    if isinstance(now.get(kind), dict):
        a, b = saved[kind], now[kind]
        differ = [f"{k} {a.get(k)!r} in the checkpoint, {b.get(k)!r} now" for k in sorted(a.keys() | b.keys())
                  if a.get(k) != b.get(k)]
    else:
        differ = [f"the checkpoint holds {names[kind]}, this config builds {names[next(iter(now), kind)]}"]
    init = load_config_text(meta["config"]).model.init_from
    what = (f"model.init_from = {init!r} in the checkpoint, {cfg.model.init_from!r} now"
            if init != cfg.model.init_from else f"model.init_from = {init!r} now gives another model")
    keep = f"keep model.init_from = {init!r}" if init else "leave model.init_from unset"
    raise LoomError(f"cannot resume from {path}: {what} ({'; '.join(differ[:3])}); {keep} (the run's "
                    f"config.toml has it), or start a new run from these weights with "
                    f"--set model.init_from={path} and no --resume")


def _preflight_data(cfg, world_size: int):
    """Load the data once before ranks start (tokenizing fills the cache the ranks read): a missing
    path or a too-small corpus fails here, a pretrained model's files are checked against the
    model, and the trackers' packages are looked for. Returns the model
    (loom.train.task.ConfigModel; a GPT's vocabulary follows the data's tokenizer)."""
    import torch.utils.data

    from loom.config import resolve_dims
    from loom.data.loader import GlobalBatchSampler
    from loom.data.run_data import build_run_data
    from loom.models.pretrained import open_pretrained
    from loom.train.task import resolve_model
    from loom.train.tracking import require_trackers

    require_trackers(cfg.train.log_to)
    pretrained = open_pretrained(cfg.model.init_from) if cfg.model.init_from else None
    if pretrained is not None and pretrained.note:  # once, here: the ranks open the folder again
        print(f"loom: note: {pretrained.note}", flush=True)
    data = build_run_data(cfg, pretrained.model_dir if pretrained is not None else None)
    if not isinstance(data.train, torch.utils.data.IterableDataset):  # a stream has no length to check
        dims = resolve_dims(cfg.parallel, world_size)
        GlobalBatchSampler(len(data.train), cfg.train.batch_size, 0, dims.dp, cfg.train.grad_accum,
                           cfg.train.seed, held_out=len(data.eval) if data.eval is not None else 0)
    return resolve_model(cfg, data.vocab_size, pretrained)


def cmd_profile(args: argparse.Namespace) -> int:
    """Train with the profiler on its schedule, then analyze the traces the ranks wrote."""
    from loom.launch import under_launcher

    # decided before training: a world of one trained in this process sets RANK itself
    launching = args.nproc is not None or args.nnodes > 1 or args.rdzv_endpoint is not None
    a_rank = under_launcher(launching)  # (then the launcher that started it analyzes the traces)
    args.set = [*args.set, "profile.enabled=true"]
    if args.out is None:
        args.out = Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-profile"
    rc = cmd_train(args)
    if rc != 0 or a_rank:
        return rc
    return _analyze_and_print(args.out / "traces", "table", None)


def not_a_folder(path: Path) -> str | None:
    """Why `path` cannot be (made) a folder: it, or a folder above it, is an existing file."""
    for part in (path, *path.parents):
        if part.exists() and not part.is_dir():
            return f"--out {path}: {part} is a file, not a folder; pass a folder (new or existing)"
    return None


def cmd_analyze(args: argparse.Namespace) -> int:
    if args.out is not None:  # a string: an empty --out (an unset variable) is not "."
        if not args.out.strip():
            raise LoomError("--out is empty (an unset variable, as in --out \"$OUT\"?); name the folder, "
                            "or leave --out out to write beside the traces")
        args.out = Path(args.out)
        if problem := not_a_folder(args.out):  # before the traces are read
            raise LoomError(problem)
    if args.compare is None:
        if args.trace_dir is None:
            raise LoomError("loom analyze needs traces: pass TRACE_DIR or --compare RUN_A RUN_B")
        return _analyze_and_print(args.trace_dir, args.format, args.out, args.overwrite)
    import json

    from loom.observe.analyze import check_out_writable
    from loom.observe.compare import compare_runs, render_compare, write_compare

    if args.trace_dir is not None:
        raise LoomError(f"pass TRACE_DIR ({args.trace_dir}) or --compare RUN_A RUN_B, not both")
    if args.format == "html" and args.out is None:
        raise LoomError("--compare --format html writes a page: pass --out DIR (compare.html goes there)")
    if args.out is not None:
        check_out_writable(args.out, "loom analyze --compare")
    result = compare_runs(*args.compare)
    written = write_compare(result, args.out) if args.out is not None else None
    if args.format == "json":
        print(json.dumps(result, indent=1))
    elif args.format == "html":
        print(written[1])
    else:
        print(render_compare(result))
        if written:
            print(f"\ncompare: {written[0]}\nreport:  {written[1]}")
    return 0


def _analyze_and_print(trace_dir: Path, fmt: str, out: Path | None, overwrite: bool = False) -> int:
    import json

    from loom.observe.analyze import analyze, check_out_writable, check_outputs, render_table, write_outputs

    if not trace_dir.is_dir():
        raise LoomError(f"{trace_dir} is not a directory; pass the folder holding the per-rank traces "
                        f"(a loom run's RUN_DIR/traces)")
    out_dir = out or (trace_dir.parent if trace_dir.name == "traces" else trace_dir)
    check_outputs(out_dir, overwrite)  # before the traces are read: nothing of the user's is replaced
    check_out_writable(out_dir)  # and the analysis has somewhere to go
    analysis = analyze(trace_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ledger, report = write_outputs(analysis, out_dir)
    if fmt == "json":
        print(json.dumps(analysis, indent=1))
    elif fmt == "html":
        print(report)
    else:
        print(render_table(analysis))
        print(f"\nledger: {ledger}\nreport: {report}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from loom.train.export import export

    written = export(args.checkpoint, args.output, args.layout, overwrite=args.overwrite, lora=args.lora)
    for path in written:
        print(f"wrote {path}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from loom.plan.device import default_path

    first = args.gpu == "local" and not default_path().is_file()
    if args.calibrate or first:  # measuring needs torch; planning after it does not
        from loom.plan.command import check_model_layout, plan_inputs

        cfg, _, shape = plan_inputs(args)  # a bad --model or --set: at once, not after the calibration
        check_model_layout(cfg, shape)
        from loom.plan.device import check_profile_target

        check_profile_target()  # and where the profile goes
        from loom.observe.calibrate import calibrate, calibration_notice
        from loom.plan.device import save

        quick = args.quick or (first and not args.calibrate)
        print(calibration_notice(default_path(), first, quick), file=sys.stderr)
        path = save(calibrate(quick=quick, say=lambda m: print(m, file=sys.stderr)))
        print(f"wrote {path}", file=sys.stderr)
    from loom.plan.command import run  # pure Python: `loom plan` imports no torch
    from loom.plan.hardware import alias_note

    alias = alias_note(args.gpu)
    if alias is not None:  # (stderr: --format json keeps stdout to the JSON)
        print(f"loom: note: {alias}", file=sys.stderr)
    cfg, plan, model = run(args)
    if args.trace:
        from loom.train.trace import print_trace  # the real model and strategy, on fake tensors

        print_trace(cfg, plan, model)
    return 0


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="TOML config (its model, data.seq_len, train.batch_size) or a "
                                             "Hugging Face config.json")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value, e.g. --set train.batch_size=512 (repeatable)")
    p.add_argument("--model", help="a preset (tiny, small, 125m, 1b, 8b, 70b) or a Hugging Face config.json")
    p.add_argument("--params", type=float, help="only a parameter count, e.g. 70e9 (model states alone)")
    p.add_argument("--gpu", default="local",
                   help="GPU model from the catalog (e.g. H100-SXM, A100-80GB), or local (default): this "
                        "machine as `loom plan --calibrate` measured it")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="devices (ranks) per node (default 8 for a catalog GPU; 2 ranks on a local CPU)")
    p.add_argument("--nodes", type=int, default=None, help="nodes (default 1)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine (matmul and attention rates, memory bandwidth, collectives) "
                        "into the device profile that --gpu local and loom train use, then plan")
    p.add_argument("--quick", action="store_true",
                   help="with --calibrate: shorter timings (a rougher profile in a fraction of the time)")
    p.add_argument("--explain", type=int, metavar="N",
                   help="print the memory and time arithmetic of candidate N (the # column)")
    p.add_argument("--recipe", default="torch", help="precision recipe: torch (16 B/param), "
                                                     "zero (ZeRO paper), megatron (18 B/param)")
    p.add_argument("--hw", action="append", default=[], metavar="KEY=VALUE",
                   help="override a GPU or cluster field, e.g. --hw bf16_tflops=700 "
                        "--hw achievable_fraction=0.4")
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument("--emit", help="write the recommended candidate as a loom config (TOML)")
    p.add_argument("--overwrite", action="store_true",
                   help="with --emit: replace existing files (the config and its alternatives)")
    p.add_argument("--trace", action="store_true",
                   help="also trace the real model and strategy under FakeTensorMode (imports torch)")


def cmd_data_prepare(args: argparse.Namespace) -> int:
    """Tokenize a corpus once into sharded token files that `data.source = OUT` memory-maps."""
    from loom.data.prepare import DEFAULT_SHARD_TOKENS, prepare

    if args.format == "sft":
        raise LoomError("loom data prepare makes text shards only; SFT data is tokenized at the start of the "
                        "run: set data.source to the records and data.format = 'sft'")
    shard_tokens = None if args.shard_docs is not None else (args.shard_tokens or DEFAULT_SHARD_TOKENS)
    index = prepare(args.source, args.out, tokenizer=args.tokenizer, text_field=args.text_field,
                    shard_tokens=shard_tokens, shard_docs=args.shard_docs, workers=args.workers,
                    cache_dir=args.cache_dir)
    shards = len(index["shards"])
    print(f"{args.out}: {index['num_tokens']:,} tokens of {index['num_docs']:,} documents in "
          f"{shards} shard{'s' * (shards != 1)} ({index['dtype']}, vocab {index['vocab_size']:,}); "
          f"train on it with --set data.source={args.out}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """The benchmark suite lives beside the package, in the repository's bench/ (a source checkout)."""
    import importlib

    folder = Path(__file__).resolve().parent.parent / "bench"
    if not (folder / "suite.py").is_file():
        raise LoomError(f"loom bench runs from a source checkout of loom ({folder}/suite.py not found); "
                        f"clone the repository and install it with pip install -e .")
    sys.path.insert(0, str(folder))
    return importlib.import_module("suite").main(args.args)


TRAIN_EPILOG = ("before a run: `loom config show [FILE] [--set …]` prints the resolved config, each key "
                "with what it means; `loom train --dry-run` checks and plans the run without starting it; "
                "`loom presets` lists the model shapes (model.preset)")


def cmd_config_show(args: argparse.Namespace) -> int:
    from loom.config import load_config
    from loom.config_show import show_config

    print(show_config(load_config(args.config, args.set), args.config, args.set), end="")
    return 0


def cmd_presets(args: argparse.Namespace) -> int:
    from loom.preset_table import presets_table

    print(presets_table())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loom", description="PyTorch-native distributed training")
    parser.add_argument("--version", action="version", version=f"loom {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model with the configured strategy",
                           description="Train a model with the configured strategy.", epilog=TRAIN_EPILOG)
    _add_train_args(train)
    train.add_argument("--dry-run", action="store_true",
                       help="resolve, check and plan the run, print its layout, and start nothing")
    train.set_defaults(func=cmd_train)
    config = sub.add_parser("config", help="the resolved config, each key with what it means")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print the resolved config (defaults ← FILE ← --set) as TOML, "
                                              "each key under its doc line")
    show.add_argument("config", nargs="?", help="TOML config file (defaults are used without one)")
    show.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                      help="override one config value, e.g. --set parallel.strategy=ddp (repeatable)")
    show.set_defaults(func=cmd_config_show)
    presets = sub.add_parser("presets", help="the model presets' shapes (model.preset, loom plan --model)")
    presets.set_defaults(func=cmd_presets)
    profile = sub.add_parser("profile", help="train with torch.profiler on, then analyze the traces")
    _add_train_args(profile)
    profile.set_defaults(func=cmd_profile)
    analyze = sub.add_parser("analyze", help="the step ledger and a diagnosis from torch.profiler traces")
    analyze.add_argument("trace_dir", type=Path, nargs="?",
                         help="folder of per-rank Chrome traces (.json or .json.gz)")
    analyze.add_argument("--compare", nargs=2, type=Path, metavar=("RUN_A", "RUN_B"),
                         help="two runs side by side (each a folder of traces or a run directory with "
                              "traces/): ledger shares, phases, collectives, the ops that changed most and "
                              "why B's step differs; writes nothing into the runs")
    analyze.add_argument("--format", choices=("table", "json", "html"), default="table",
                         help="with --compare, html needs --out")
    analyze.add_argument("--out",
                         help="where ledger.json and report.html go (default: the run directory); with "
                              "--compare: compare.json and compare.html, written only when given")
    analyze.add_argument("--overwrite", action="store_true",
                         help="replace a ledger.json or report.html there that loom analyze did not write")
    analyze.set_defaults(func=cmd_analyze)
    export = sub.add_parser("export", help="consolidate a sharded checkpoint into one safetensors file")
    export.add_argument("checkpoint", type=Path,
                        help="RUN_DIR/checkpoints/step_N (or a run directory: its latest)")
    export.add_argument("output", type=Path, help="the .safetensors file to write (--lora adapter: a folder)")
    export.add_argument("--layout", choices=("loom", "hf"), default="loom",
                        help="parameter names: loom's, or Hugging Face Llama's (+ config.json and the "
                             "run's tokenizer files beside the file)")
    export.add_argument("--overwrite", action="store_true",
                        help="replace an existing output (--layout hf: the old model's files too, so that "
                             "none is left beside the new one; files loom does not write stay)")
    export.add_argument("--lora", choices=("adapter", "merged"), default=None,
                        help="a LoRA run's checkpoint: adapter = a PEFT adapter folder "
                             "(adapter_model.safetensors + adapter_config.json); merged = the base with the "
                             "adapters merged in, in --layout")
    export.set_defaults(func=cmd_export)
    plan = sub.add_parser("plan", help="predict memory, communication and step time of every strategy")
    _add_plan_args(plan)
    plan.set_defaults(func=cmd_plan)
    data = sub.add_parser("data", help="prepare training data")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prep = data_sub.add_parser("prepare", help="tokenize a corpus once into sharded token files (resumable)")
    prep.add_argument("source", help="text file, folder or glob, JSONL / Parquet / Arrow records, a saved "
                                     "Hugging Face dataset, or stdlib")
    prep.add_argument("out", type=Path, help="the folder of shards (rerun into it to resume)")
    prep.add_argument("--tokenizer", default="byte",
                      help="a tokenizer.json, a model folder holding one, or byte (default)")
    prep.add_argument("--text-field", default="text", help="the records' text field (default text)")
    size = prep.add_mutually_exclusive_group()
    size.add_argument("--shard-tokens", type=int, default=None,
                      help="about this many tokens a shard (default 20,000,000)")
    size.add_argument("--shard-docs", type=int, default=None, help="exactly this many documents a shard")
    prep.add_argument("--workers", type=int, default=None,
                      help="tokenizing processes (default: one per CPU core)")
    prep.add_argument("--format", choices=("text", "sft"), default="text",
                      help="text only: SFT data is tokenized at the start of the run")
    prep.add_argument("--cache-dir", type=Path, default=Path("~/.cache/loom"),
                      help="where the datasets library converts records to Arrow (default ~/.cache/loom)")
    prep.set_defaults(func=cmd_data_prepare)
    bench = sub.add_parser("bench", add_help=False, help="every performance claim measured side by side "
                           "(written into the checkout's bench/); loom bench --help for its options")
    bench.add_argument("args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its options are the suite's own (bench/suite.py)
        args = argparse.Namespace(func=cmd_bench, args=argv[1:])
    else:
        args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return code
    except LoomError as e:
        print(f"loom: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `loom analyze … | head`: the reader has all it wanted, no traceback
        with contextlib.suppress(OSError, ValueError):  # (Python flushes stdout again at exit)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # what a shell reports for a writer its pipe closed on (128 + SIGPIPE)


if __name__ == "__main__":
    from loom.launch import exit_rank, under_launcher

    started_as_rank = under_launcher()  # decided now: an in-process run sets RANK itself
    code = main()
    if started_as_rank:
        exit_rank(code)
    sys.exit(code)
