"""Planted bugs in "nothing of the user's is lost or escaped into" (issue 38, third pass): where
`--resume auto` may write and what a run directory loom cannot make says (loom/cli.py), a linked
checkpoints folder (loom/train/checkpoint.py), what an export's --overwrite replaces and where a
folder export may go (loom/train/export.py), loom analyze's outputs (loom/observe/analyze.py) and
its traces (loom/observe/trace_events.py)."""

from __future__ import annotations

from planted import Bug

CASES = "tests/unit/test_bad_input.py::test_bad_input"
UNIT = "tests/unit/test_trust3_userfiles.py"

BUGS = [
    Bug('resume-auto-any-folder', '--resume auto writes its run files into a folder loom never made',
        'loom/cli.py',
        '    if not ours:  # what it holds',
        '    if False:  # what it holds',
        (f"{CASES}[resume-auto-not-a-loom-run]",)),
    Bug('resume-auto-home-cwd', '--resume auto continues into the working or home directory',
        'loom/cli.py',
        '            raise LoomError(f"--resume auto would write',
        '            (f"--resume auto would write',  # a string, not raised
        (f"{CASES}[resume-auto-home]", f"{CASES}[resume-auto-cwd]")),
    Bug('resume-auto-unchecked', '--resume auto reads and writes --out before checking what it is',
        'loom/cli.py',
        '        _check_continued_dir(args.out)  # before',
        '        pass  # before',
        (f"{CASES}[resume-auto-not-a-loom-run]", f"{CASES}[resume-auto-out-is-file]")),
    Bug('out-unmakeable-traceback', 'a run directory loom cannot make is a traceback',
        'loom/cli.py',
        '    except OSError as e:  # an unwritable folder',
        '    except ImportError as e:  # an unwritable folder',
        (f"{CASES}[out-not-writable]", f"{UNIT}::test_a_run_directory_loom_cannot_make_is_one_line")),
    Bug('checkpoints-file-unchecked', 'a file named checkpoints in the run is found by the writer (a '
        'FileExistsError in the rank)',
        'loom/train/checkpoint.py',
        '    if not root.is_dir():\n        raise LoomError(f"{root} is a file, not',
        '    if False:\n        raise LoomError(f"{root} is a file, not',
        (f"{CASES}[checkpoints-is-a-file]",)),
    Bug('checkpoints-link-foreign-taken', 'a linked checkpoints folder holding files of others is taken '
        'as the run\'s (its .tmp- entries and old steps removed)',
        'loom/train/checkpoint.py',
        '    if owner is None and not any(p.name != OWNER for p in root.iterdir()):\n',
        '    if owner is None:\n',
        (f"{CASES}[checkpoints-link-foreign]",
         f"{UNIT}::test_linked_checkpoints_cleanup_and_keep_last_touch_only_this_runs")),
    Bug('checkpoints-link-any-owner', 'a linked checkpoints folder marked as another run\'s is written',
        'loom/train/checkpoint.py',
        '    if owner == str(Path(run_dir).resolve()):\n',
        '    if owner is not None:\n',
        (f"{CASES}[checkpoints-link-other-run]",)),
    Bug('checkpointer-unclaimed', 'the checkpoint writer cleans up a linked folder without checking it is '
        'the run\'s',
        'loom/train/checkpoint.py',
        '            claim_checkpoints_dir(run_dir)  # a linked',
        '            self.root.mkdir(parents=True, exist_ok=True)  # a linked',
        (f"{UNIT}::test_linked_checkpoints_cleanup_and_keep_last_touch_only_this_runs",)),
    Bug('adapter-overwrite-removes-model', 'an adapter export with --overwrite removes the folder\'s model '
        'files (config.json, tokenizer.json, any .safetensors)',
        'loom/train/export.py',
        '    return _write_model_folder(folder, files, [])  # the adapter',
        '    return _write_model_folder(folder, files, _model_files(folder) if overwrite else [])  '
        '# the adapter',
        (f"{UNIT}::test_adapter_export_overwrite_replaces_only_the_adapter_files",)),
    Bug('hf-overwrite-removes-any', 'an hf export with --overwrite removes every *.safetensors, vocab.json, '
        'merges.txt beside it',
        'loom/train/export.py',
        '    return [p for p in _model_files(folder) if p.name in _HF_WRITES or _OLD_WEIGHTS.match(p.na'
        'me)]\n',
        '    return _model_files(folder)\n',
        (f"{UNIT}::test_hf_export_overwrite_keeps_files_it_does_not_write",)),
    Bug('export-into-home-cwd', 'a folder export writes into the home or working directory',
        'loom/train/export.py',
        '        if folder.resolve() == place:\n',
        '        if False:\n',
        (f"{CASES}[export-adapter-home]", f"{CASES}[export-hf-home]", f"{CASES}[export-hf-cwd]")),
    Bug('analyze-replaces-users', 'loom analyze replaces a report.html / ledger.json of the user\'s',
        'loom/observe/analyze.py',
        '    for name in () if overwrite else OUTPUTS:\n',
        '    for name in ():\n',
        (f"{CASES}[analyze-outputs-not-loom]",
         f"{UNIT}::test_analyze_replaces_its_own_outputs_and_the_users_only_with_overwrite")),
    Bug('analyze-own-unrecognised', 'loom analyze does not recognise its own earlier ledger.json',
        'loom/observe/analyze.py',
        '    if path.name == "report.html":',
        '    if True:',
        (f"{UNIT}::test_analyze_replaces_its_own_outputs_and_the_users_only_with_overwrite",)),
    Bug('trace-follows-link', 'loom analyze reads a trace that links out of its folder, or a FIFO',
        'loom/observe/trace_events.py',
        '    for p in named:\n        _own_regular_file(folder, p)\n',
        '    for p in named[:0]:\n        _own_regular_file(folder, p)\n',
        (f"{CASES}[trace-link-outside]", f"{CASES}[trace-not-regular]")),
    Bug('scratch-link-is-a-used-run',
        "a new run's folder holding only a checkpoints link to an empty scratch folder taken as used",
        'loom/cli.py', 'not run_dir.is_dir() or not _set_up_for_a_run(run_dir))',
        'not run_dir.is_dir() or any(p.name != RUN_MARKER for p in run_dir.iterdir()))',
        (f"{UNIT}::test_a_scratch_disk_linked_before_the_first_run_takes_its_checkpoints",)),
]
