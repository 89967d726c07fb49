"""Planted bugs in resuming and exporting a LoRA run and in `--set` text (issue 38): the pre-launch
check expecting a LoRA checkpoint's frozen base (loom/cli.py, loom/train/safe_load.py), a MoE run's
expert_bias counted as a weight trained whole (loom/train/export_lora.py), and a str-typed key's
`--set 2024` read as a number (loom/config.py)."""

from __future__ import annotations

from planted import Bug

UNIT = "tests/unit/test_trust3_resume.py"

BUGS = [
    Bug('lora-resume-expects-the-base', "the pre-launch check of a LoRA resume expects the whole model "
        "(no adapters added, nothing frozen): every LoRA resume refused",
        'loom/cli.py',
        '        expected = safe_load.trained_entries(_as_trained(cfg, model.build("meta")), '
        'cfg.train.optimizer)\n',
        '        expected = safe_load.trained_entries(model.build("meta"), cfg.train.optimizer)\n',
        (f"{UNIT}::test_the_pre_launch_check_accepts_a_lora_checkpoint",)),
    Bug('lora-resume-expects-frozen-params', "the checkpoint's expected entries keep the frozen base's "
        "parameters, which a LoRA checkpoint leaves out",
        'loom/train/safe_load.py',
        '        if not p.requires_grad:\n            out.pop(f"model.{name}", None)\n',
        '        if False:\n            out.pop(f"model.{name}", None)\n',
        (f"{UNIT}::test_the_pre_launch_check_accepts_a_lora_checkpoint",)),
    Bug('lora-adapter-export-counts-expert-bias', "export --lora adapter of a MoE run counts the routing "
        "buffer expert_bias as a weight trained whole and refuses",
        'loom/train/export_lora.py',
        'tensors.items() if not n.endswith("expert_bias")}',
        'tensors.items() if True}',
        (f"{UNIT}::test_a_moe_lora_adapter_leaves_out_the_routing_bias",)),
    Bug('set-str-key-parsed-as-number', "--set data.source=2024 is the int 2024: 'must be str, got int'",
        'loom/config.py',
        '        value = raw  # a str-typed key takes the text as written\n',
        '        pass\n',
        (f"{UNIT}::test_a_str_keys_set_value_is_its_text",)),
]

# A checkpoint's step, read against its own counters and values (loom/train/checkpoint.py).
CASE = "tests/unit/test_bad_input.py::test_bad_input"
BUGS += [
    Bug('meta-step-unchecked', "meta.json's step is taken alone: edited from 2 to 1 it resumes the LR "
        "schedule and the data at step 2 and calls it 1; a step of 1e30 asks to raise train.steps to 1e30",
        'loom/train/checkpoint.py',
        '        _step_agrees(doc.raw, schedule, source)\n',
        '',
        (f"{CASE}[ckpt-meta-step-edited]", f"{CASE}[ckpt-meta-step-huge]")),
    Bug('adam-step-ahead-of-meta', "AdamW's step counts may exceed the checkpoint's step (every counter "
        "of meta.json edited back alike)",
        'loom/train/checkpoint.py',
        '            if count > step:\n',
        '            if False:\n',
        (f"{CASE}[ckpt-adam-step-ahead]",)),
    Bug('loaded-weights-not-checked-finite', "a NaN in a checkpoint's weight is loaded: every update "
        "skipped, then exit 0",
        'loom/train/checkpoint.py',
        '    if bad:\n        more = ',
        '    if False:\n        more = ',
        (f"{CASE}[ckpt-weight-nan]", f"{CASE}[ckpt-init-from-weight-nan]")),
]

# The data a resume continues on, by what it is (loom/data/source_identity.py, loom/train/checkpoint.py).
IDENTITY = "tests/unit/test_resume_data_identity.py"
BUGS += [
    Bug('resume-data-by-name', "a resume compares data.source as written: the same file by its absolute "
        "path is refused",
        'loom/train/checkpoint.py',
        'RESUME_FIXED = ("data.tokenizer",',
        'RESUME_FIXED = ("data.source", "data.tokenizer",',
        (f"{IDENTITY}::test_the_same_file_by_its_absolute_path_resumes",)),
    Bug('resume-data-content-unchecked', "the recorded fingerprint is not compared: a relative data.source "
        "read from another folder trains on other content",
        'loom/data/source_identity.py',
        '        if before["fingerprint"] != after["fingerprint"]:\n',
        '        if False:\n',
        (f"{IDENTITY}::test_a_relative_source_naming_other_content_from_another_folder_is_refused",
         f"{CASE}[ckpt-data-other-content]")),
    Bug('data-fingerprint-head-only', "the fingerprint reads only the first bytes: a corpus edited at its "
        "end keeps it",
        'loom/data/source_identity.py',
        '            fh.seek(max(size - SAMPLE, 0))\n            digest.update(fh.read(SAMPLE))\n',
        '',
        (f"{IDENTITY}::test_the_fingerprint_reads_both_ends_and_the_size",)),
]
