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
        '        expected = safe_load.adamw_entries(_as_trained(cfg, model.build("meta")))\n',
        '        expected = safe_load.adamw_entries(model.build("meta"))\n',
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
