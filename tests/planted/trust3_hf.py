"""Planted bugs in "pretrained weights are taken as the files hold them" (issue 38, third pass):
a head the files hold apart from a tied embedding (loom/models/pretrained.py, the note in
loom/cli.py) and weights holding NaN or Inf (loom/models/pretrained.py)."""

from __future__ import annotations

from planted import Bug

CASES = "tests/unit/test_bad_input.py::test_bad_input"
UNIT = "tests/unit/test_trust3_hf.py"
PRETRAINED = "loom/models/pretrained.py"

BUGS = [
    Bug('hf-tie-drops-distinct-head', 'config.json\'s tie_word_embeddings is obeyed over the files: a '
        'distinct lm_head.weight is dropped and the head reads the embedding',
        PRETRAINED,
        '    config, note = _untie_if_stored_apart(path, config, tensors)\n',
        '    note = None\n',
        (f"{UNIT}::test_a_distinct_head_under_tie_loads_untied_as_transformers_does",
         f"{UNIT}::test_a_distinct_head_under_tie_loads_untied_through_transformers_modules")),
    Bug('hf-tie-untied-always', 'a head equal to the embedding (a tied model saved with its head) is '
        'untied too',
        PRETRAINED,
        '    if _same_values(tensors, _HF_HEAD, _HF_EMBEDDING):\n        return config, None\n',
        '    if False:\n        return config, None\n',
        (f"{UNIT}::test_a_head_equal_to_the_embedding_or_none_stays_tied_silently",)),
    Bug('hf-untie-note-unsaid', 'the model is untied without saying so',
        'loom/cli.py',
        '        print(f"loom: note: {pretrained.note}", flush=True)\n',
        '        pass\n',
        (f"{UNIT}::test_the_untie_note_is_said_once_before_launch",)),
    Bug('hf-nan-weights-loaded', 'weights holding NaN or Inf are loaded (every step skipped, exit 0)',
        PRETRAINED,
        '        if non_finite(part).any():',
        '        if False:',
        (f"{CASES}[model-weight-nan]", f"{CASES}[model-export-weight-inf]",
         f"{UNIT}::test_a_nan_weight_is_refused_naming_file_tensor_and_count")),
    Bug('hf-nan-count-of-block', 'the non-finite count is of the block this rank read, not the tensor\'s',
        PRETRAINED,
        'count = int(non_finite(self._open[file].get_tensor(stored)).sum())',
        'count = int(non_finite(part).sum())',
        (f"{UNIT}::test_a_nan_weight_is_refused_naming_file_tensor_and_count",)),
    Bug('hf-nan-f8-isfinite', 'float8 e4m3 weights are checked with isfinite, which torch lacks for it '
        '(a traceback)',
        PRETRAINED,
        '    return t.isnan() if t.dtype == torch.float8_e4m3fn else ~t.isfinite()',
        '    return ~t.isfinite()',
        (f"{UNIT}::test_a_non_finite_weight_is_refused_in_every_stored_dtype",)),
]
