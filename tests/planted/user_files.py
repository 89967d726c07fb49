"""Planted bugs in what keeps the user's files: --overwrite's rules (loom/cli.py), the writer that
replaces a planted link and the run marker (loom/files.py), the run's records, analyze's and
compare's outputs, export's refusals and its tokenizer copies (loom/train/export.py,
loom/train/tokenizer_copy.py), --emit, and the launcher's stop record (docs/bad-input.md, "Your
files"; tests/unit/test_user_files.py)."""

from __future__ import annotations

from planted import Bug

CASES = "tests/unit/test_bad_input.py::test_bad_input"
FILES = "tests/unit/test_user_files.py"
FUZZ = "tests/unit/test_fuzz_user_files.py"

BUGS = [
    Bug('overwrite-before-checks', '--overwrite removes the run directory before the resume checks (then '
        'refuses)',
        'loom/cli.py',
        '    _check_resume(cfg, run_dir, args.resume, model)\n',
        '    if spec.nnodes == 1 or spec.node_rank == 0:\n        _take_run_dir(run_dir, replace)\n'
        '    _check_resume(cfg, run_dir, args.resume, model)\n',
        (f"{CASES}[overwrite-after-checks]",)),
    Bug('overwrite-cwd-home', '--overwrite may remove the working or home directory (or a folder above them)',
        'loom/cli.py',
        '    places = [("the working directory", Path.cwd().resolve())]\n',
        '    return []\n    places = [("the working directory", Path.cwd().resolve())]\n',
        (f"{CASES}[overwrite-cwd]", f"{CASES}[overwrite-home]", f"{CASES}[overwrite-parent-of-cwd]",)),
    Bug('overwrite-unmarked', '--overwrite removes a folder loom never made (no .loom-run)', 'loom/cli.py',
        '    if not is_loom_run(run_dir):\n',
        '    if False:\n',
        (f"{CASES}[overwrite-not-a-loom-run]",)),
    Bug('overwrite-inputs', '--overwrite removes a folder holding the data, model, tokenizer, '
        'config or checkpoint the run reads',
        'loom/cli.py',
        '    for what, path in _run_inputs(cfg, args):\n',
        '    for what, path in []:\n',
        (f"{CASES}[overwrite-holds-data]",
         f"{CASES}[overwrite-holds-model]",
         f"{CASES}[overwrite-holds-tokenizer]",
         f"{CASES}[overwrite-holds-config]",
         f"{CASES}[run-dir-overwrite-own-checkpoint]",)),
    Bug('overwrite-glob-pattern', 'a glob data.source is compared by its pattern, not the folder it '
        'starts from',
        'loom/cli.py',
        '            inputs.append((what, Path(*parts[:glob]) if glob else Path(".")))',
        '            inputs.append((what, Path(value)))',
        (f"{CASES}[overwrite-holds-data-glob]",)),
    Bug('out-empty-as-cwd', 'an empty --out (an unset $RUN) is read as the working directory', 'loom/cli.py',
        '    if not str(text).strip():\n',
        '    if False:\n',
        (f"{CASES}[overwrite-empty-out]",)),
    Bug('export-over-file', 'loom export replaces an existing file without --overwrite',
        'loom/train/export.py',
        '    if output.exists() or output.is_symlink():\n',
        '    if False:\n',
        (f"{CASES}[export-exists]",)),
    Bug('export-into-model-folder', 'an hf export writes into a folder that already holds a model',
        'loom/train/export.py',
        '    held = _model_files(parent) if layout == "hf" else []\n',
        '    held = []\n',
        (f"{CASES}[export-model-folder]",)),
    Bug('export-overwrite-mixed', 'an hf export with --overwrite leaves the old index, shards and '
        'tokenizer beside the new model',
        'loom/train/export.py',
        '        if overwrite:\n            for old in _model_files(folder):\n',
        '        if False:\n            for old in _model_files(folder):\n',
        (f"{FILES}::test_export_overwrite_replaces_a_model_folder_consistently",)),
    Bug('tokenizer-hash-unchecked', 'export copies a carried tokenizer file without checking its sha256',
        'loom/train/tokenizer_copy.py',
        '        if sha256(data) != digest:\n',
        '        if False:\n',
        (f"{CASES}[export-tokenizer-altered]",)),
    Bug('tokenizer-names-unchecked', 'export follows any name meta.json records as a tokenizer file',
        'loom/train/tokenizer_copy.py',
        '        if name not in NAMES or not _SHA256.match(digest):\n',
        '        if not _SHA256.match(digest):\n',
        (f"{CASES}[export-tokenizer-record]",)),
    Bug('tokenizer-not-recorded', 'a checkpoint records (and carries) no tokenizer files',
        'loom/train/checkpoint.py',
        '                meta[tokenizer_copy.META_KEY] = tokenizer_copy.save(self.cfg, tm'
        'p)\n',
        '                meta[tokenizer_copy.META_KEY] = {}  # planted\n',
        (f"{FILES}::test_export_copies_only_the_tokenizer_files_the_checkpoint_recorded",)),
    Bug('export-tokenizer-from-meta', 'export copies the tokenizer from the path in meta.json\'s config',
        'loom/train/export.py',
        '    tokenizer = tokenizer_copy.carried(path, meta) if layout == "hf" else {}\n',
        '    tokenizer = {f.name: f.read_bytes() for f in tokenizer_copy.run_tokenizer_fi'
        'les(load_config_text(meta[\'config\']))} if layout == "hf" else {}\n',
        (f"{FILES}::test_export_copies_only_the_tokenizer_files_the_checkpoint_recorded",)),
    Bug('record-follows-link', 'summary.json is written through a planted symbolic link',
        'loom/train/record.py',
        '    atomic_write(run_dir / "summary.json", json.dumps(summary, indent=2).encode('
        '))\n',
        '    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))\n',
        (f"{FILES}::test_a_resumed_run_replaces_planted_links_and_leaves_their_targets",)),
    Bug('metrics-follow-link', 'metrics.jsonl is rewritten and appended through a planted link',
        'loom/train/meters.py',
        '        atomic_write(path, "".join(line + "\\n" for line in kept).encode())\n     '
        '   self.file = open_append(path)\n',
        '        path.write_text("".join(line + "\\n" for line in kept))\n        self.file'
        ' = open(path, "a", buffering=1)\n',
        (f"{FILES}::test_a_resumed_run_replaces_planted_links_and_leaves_their_targets",
         f"{FILES}::test_appends_and_writes_refuse_a_link",)),
    Bug('append-follows-link', 'appending to metrics.jsonl follows a symbolic link', 'loom/files.py',
        'os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW',
        'os.O_WRONLY | os.O_APPEND | os.O_CREAT',
        (f"{FILES}::test_appends_and_writes_refuse_a_link",)),
    Bug('writer-linked-folder', 'a write goes through a linked folder inside the run directory',
        'loom/files.py',
        '        if at.is_symlink():\n            raise LoomError(f"{at} is a symbolic lin'
        'k; loom writes',
        '        if False:\n            raise LoomError(f"{at} is a symbolic link; loom wr'
        'ites',
        (f"{FILES}::test_appends_and_writes_refuse_a_link",)),
    Bug('ledger-follows-link', 'loom analyze writes ledger.json through a planted link',
        'loom/observe/analyze.py',
        '    atomic_write(ledger, json.dumps(analysis, indent=1).encode())',
        '    ledger.write_text(json.dumps(analysis, indent=1))',
        (f"{FILES}::test_analyze_and_compare_replace_planted_links",)),
    Bug('compare-follows-link', 'loom analyze --compare writes compare.html through a planted link',
        'loom/observe/compare.py',
        '    atomic_write(page, render_compare_html(result).encode("utf-8"))',
        '    page.write_text(render_compare_html(result), encoding="utf-8")',
        (f"{FILES}::test_analyze_and_compare_replace_planted_links",)),
    Bug('stop-record-any-launch', 'a stopped.json of any launch (a planted one) makes a finished run '
        'interrupted',
        'loom/cli.py',
        '    if not isinstance(launches, list) or launch not in launches:\n        return None\n',
        '    pass  # planted\n',
        (f"{FILES}::test_a_stop_record_counts_only_for_the_launch_that_wrote_it",
         f"{FUZZ}::test_stop_record",)),
    Bug('metrics-not-utf8', 'a resumed run reads a non-UTF-8 metrics.jsonl unchecked (a traceback)',
        'loom/train/meters.py',
        '        lines = read_text(path).splitlines()\n',
        "        lines = path.read_text(errors='strict').splitlines()\n",
        (f"{CASES}[resume-metrics-not-utf8]",)),
    Bug('emit-over-file', 'loom plan --emit replaces an existing file', 'loom/plan/command.py',
        '    if existing and not overwrite:\n',
        '    if False:\n',
        (f"{CASES}[emit-exists]",)),
    Bug('emit-stale-alternatives', "--emit --overwrite leaves an older plan's alternatives among the new "
        'ones',
        'loom/plan/command.py',
        '            if old.name[len(target.stem) + 1:-len(suffix)].isdigit() and _emitte'
        'd_by_loom(old):\n',
        '            if False:\n',
        (f"{FILES}::test_emit_overwrite_removes_the_older_plans_alternatives_only",)),
    Bug('marker-on-users-folder', 'a folder holding the user\'s files gets the run marker', 'loom/files.py',
        '    if not is_loom_run(run_dir) and not any(run_dir.iterdir()):\n',
        '    if not is_loom_run(run_dir):\n',
        (f"{FILES}::test_a_folder_of_the_users_is_never_marked",)),
    Bug('resume-reads-planted-config-link', 'a resume takes a config.toml planted as a link as the run\'s '
        'config (a user\'s file parsed, the run refused)',
        'loom/cli.py',
        '    if path is not None and path.is_symlink() and ckpt is not None:',
        '    if False:',
        ("tests/unit/test_user_files.py::test_a_resumed_run_replaces_planted_links_and_leaves_their_targets",)),
    Bug('analyze-out-empty-as-cwd', 'loom analyze --out "" (an unset variable) writes into the working '
        'directory',
        'loom/cli.py',
        '        if not args.out.strip():',
        '        if False:',
        (f"{CASES}[analyze-out-empty]",)),
]
