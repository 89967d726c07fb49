"""Planted bugs in what a run reads and writes of its data (docs/bad-input.md, "Data", "Data files",
"Pretrained models"; tests/unit/bad_input_cases_data4.py): `loom data prepare` into its own source
(loom/data/prepare.py, sources.py), the BPE token cache made again when damaged, .bin ids of another
width, pipes and devices, folders os.walk would skip and files loom may not read (corpus.py, sources.py),
cache folders and OUTs it may not write (cache_files.py, records.py, prepare.py), and a model
folder's tokenizer.json that is a folder (hf_tokenizer.py)."""

from __future__ import annotations

from planted import Bug

CASE = "tests/unit/test_bad_input.py::test_bad_input"
CORPUS = "loom/data/corpus.py"

BUGS = [
    Bug('data4-prepare-into-source', "`loom data prepare SRC SRC/prep` is accepted (the folder is no longer "
        "a source afterwards)", 'loom/data/prepare.py',
        '    if holder is not None:  # its shards would join the source',
        '    if False:  # its shards would join the source',
        (f"{CASE}[data-prepare-out-inside-source]",)),
    Bug('data4-holding-any-folder', "a folder is taken to hold a place only when it is the place itself",
        'loom/data/sources.py',
        '    inside = Path(os.path.realpath(place)).is_relative_to(os.path.realpath(folder))\n',
        '    inside = Path(os.path.realpath(place)) == Path(os.path.realpath(folder))\n',
        (f"{CASE}[data-prepare-out-inside-source]",)),
    Bug('data4-bpe-cache-trusted', "the BPE token cache is loaded without checking its ids against the "
        "vocabulary", CORPUS,
        '            check_ids(tokens, tokenizer.vocab_size, str(path), again)\n', '',
        (f"{CASE}[data-bpe-cache-id-over-vocab]",)),
    Bug('data4-bpe-cache-raw-load', "the BPE token cache is np.load-ed raw (a cut file is a traceback)",
        CORPUS,
        '            tokens = open_npy(path, again)\n',
        '            tokens = np.load(path, mmap_mode="r", allow_pickle=False)\n',
        (f"{CASE}[data-bpe-cache-truncated]",)),
    Bug('data4-bin-past-max-vocab', "a .bin id past any vocabulary is told to raise model.vocab_size to it",
        CORPUS,
        '    if top >= MAX_VOCAB:  # no model has such a vocabulary',
        '    if False:  # no model has such a vocabulary',
        (f"{CASE}[data-bin-id-past-max-vocab]", f"{CASE}[data-bin-wrong-dtype]")),
    Bug('data4-fifo-missing', "a pipe or device as data.source is said not to exist", CORPUS,
        '    elif path.exists():  # a FIFO would block the read forever',
        '    elif False:  # a FIFO would block the read forever',
        (f"{CASE}[data-source-fifo]", f"{CASE}[data-source-device]")),
    Bug('data4-walk-skips-unreadable', "os.walk skips a folder it cannot list (half the data, exit 0)",
        CORPUS,
        '        for folder, dirs, names in os.walk(root, onerror=_raise):\n',
        '        for folder, dirs, names in os.walk(root):\n',
        (f"{CASE}[data-subfolder-unreadable]",)),
    Bug('data4-text-unreadable-traceback', "an unreadable text file is a PermissionError traceback", CORPUS,
        '        raise unreadable(path, e) from None\n    sample = data[:_SAMPLE]',
        '        raise\n    sample = data[:_SAMPLE]',
        (f"{CASE}[data-text-unreadable]", f"{CASE}[data-prepare-source-unreadable]")),
    Bug('data4-folder-unreadable-traceback', "a data folder loom may not read is a traceback",
        'loom/data/sources.py',
        '        raise unreadable(Path(e.filename if isinstance(e.filename, str) else spec), e) from None\n',
        '        raise\n',
        (f"{CASE}[data-folder-unreadable]",)),
    Bug('data4-cache-write-traceback', "a read-only data.cache_dir is an OSError traceback",
        'loom/data/cache_files.py',
        '        raise cache_unwritable(path.parent, e) from None\n', '        raise\n',
        (f"{CASE}[data-cache-dir-read-only-bpe]",)),
    Bug('data4-records-cache-blamed-on-files', "a read-only data.cache_dir tells the user to check their "
        "JSON",
        'loom/data/records.py',
        '    raise cache_error(failed, cache_dir) or _unreadable(source, failed) from None\n',
        '    raise _unreadable(source, failed) from None\n',
        (f"{CASE}[data-cache-dir-read-only-records]",)),
    Bug('data4-prepare-out-late', "a read-only OUT fails only after the source is read, as a traceback",
        'loom/data/prepare.py',
        '            raise LoomError(f"cannot make OUT {out} ',
        '            raise\n            raise LoomError(f"cannot make OUT {out} ',
        (f"{CASE}[data-prepare-out-read-only]",)),
    Bug('data4-tokenizer-folder-ignored', "a model folder's tokenizer.json that is a folder is ignored (byte "
        "tokenizer)", 'loom/data/hf_tokenizer.py',
        '        if not found.is_file():  # a folder, or a link to nothing',
        '        if False:  # a folder, or a link to nothing',
        (f"{CASE}[model-tokenizer-json-folder]",)),
]
