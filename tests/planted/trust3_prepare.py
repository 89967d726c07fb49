"""Planted bugs in `loom data prepare` skipping empty records as training does (issue 38, prepare):
loom/data/prepare.py, and documents.NonEmpty's per-shard mode."""

from __future__ import annotations

from planted import Bug

UNIT = "tests/unit/test_trust3_prepare.py"
CASE = "tests/unit/test_bad_input.py::test_bad_input"

BUGS = [
    Bug('prepare-empty-records-kept', "`loom data prepare` writes empty records as lone EOS tokens",
        'loom/data/prepare.py',
        'for ids, _ in NonEmpty(self._counted(docs), self.source.spec, self.fields.text, part=True):',
        'for ids, _ in self._counted(docs):',
        (f"{UNIT}::test_prepare_writes_only_the_nonempty_records_and_notes_the_skipped",
         f"{UNIT}::test_prepared_shards_equal_what_training_tokenizes",
         f"{CASE}[data-prepare-all-empty]")),
    Bug('prepare-index-counts-records', "index.json's num_docs counts the source's records, empty ones too",
        'loom/data/prepare.py',
        '**asdict(job), "num_docs": texts.kept,\n',
        '**asdict(job),\n',
        (f"{UNIT}::test_prepare_writes_only_the_nonempty_records_and_notes_the_skipped",)),
    Bug('prepare-all-empty-accepted', "a source of empty texts alone is prepared into shards of nothing",
        'loom/data/prepare.py',
        '    texts.check()  # before index.json',
        '    pass  # before index.json',
        (f"{CASE}[data-prepare-all-empty]",)),
    Bug('prepare-short-shards-remade', "a rerun remakes every shard that skipped an empty record",
        'loom/data/prepare.py',
        '    return len(starts) <= stop - start and',
        '    return len(starts) == stop - start and',
        (f"{UNIT}::test_a_rerun_keeps_shards_that_skipped_records",)),
    Bug('prepare-empty-shard-refused', "a shard of empty records alone is refused as if the source were",
        'loom/data/documents.py',
        '        if not self.part:\n            self.check()\n',
        '        self.check()\n',
        (f"{UNIT}::test_prepare_writes_only_the_nonempty_records_and_notes_the_skipped",
         f"{UNIT}::test_a_rerun_keeps_shards_that_skipped_records")),
]
