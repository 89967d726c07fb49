"""Planted bugs in the readers of model folders: a Hugging Face config.json (loom/hf_config.py), the
weight map and the safetensors headers (loom/models/hf/weight_files.py), the checks of
model.init_from before a model is built (loom/models/pretrained.py), and the config.json that
`loom export --layout hf` writes or takes from a run's record (docs/bad-input.md, "Model folders")."""

from __future__ import annotations

from planted import Bug

FUZZ = "tests/unit/test_fuzz_model_folder.py"
CASES = "tests/unit/test_bad_input.py::test_bad_input"
READER = f"{FUZZ}::test_config_reader_types_every_field_or_refuses_in_one_line"
HUGE = f"{FUZZ}::test_a_huge_layer_count_is_refused_in_milliseconds"
MAP = f"{FUZZ}::test_perturbed_weight_map_through_the_folder_check"
ROUND_TRIP = (f"{FUZZ}::test_the_exported_config_reads_back_as_the_same_model",
              f"{FUZZ}::test_every_preset_round_trips_through_config_json")

BUGS = [
    Bug("hf-eps-not-finite", "config.json's rms_norm_eps taken as a float without the finite check",
        "loom/hf_config.py",
        'rms_norm_eps=doc.float("rms_norm_eps", min=0, min_open=True, max=1, fix=_FIX)',
        'rms_norm_eps=float(doc.raw["rms_norm_eps"])',
        (f"{CASES}[model-config-eps-nan]", READER)),
    Bug("hf-tie-truthy", 'tie_word_embeddings read by truthiness ("false" counts as true)',
        "loom/hf_config.py",
        'tie_word_embeddings=doc.bool("tie_word_embeddings", default=False, fix=_BOOL),',
        'tie_word_embeddings=bool(doc.raw.get("tie_word_embeddings", False)),',
        (f"{CASES}[model-config-tie-string]", READER)),
    Bug("hf-kv-heads-untyped", "num_key_value_heads taken as it is (a string reaches the arithmetic)",
        "loom/hf_config.py", 'kv = size("num_key_value_heads", heads, heads)',
        'kv = doc.raw.get("num_key_value_heads") or heads',
        (f"{CASES}[model-config-kv-heads-string]", f"{CASES}[model-plan-config]", READER)),
    Bug("hf-no-layer-bound", "num_hidden_layers without its upper bound", "loom/hf_config.py",
        'layers = need("num_hidden_layers", MAX_LAYERS)', 'layers = need("num_hidden_layers", 10**9)',
        (f"{CASES}[model-config-layers-huge]", HUGE)),
    Bug("hf-rope-untyped", "rope_scaling / rope_parameters numbers taken as they are", "loom/hf_config.py",
        "                value = rope.float(field, min=0, min_open=True, fix=_FIX)",
        "                value = rope.raw[field]", (f"{CASES}[model-config-rope-type]",)),
    Bug("hf-hub-root-untrusted", "a Hub cache snapshot's links into ../../blobs refused (root: the snapshot)",
        "loom/hf_config.py", "        return real.parent.parent\n", "        return real\n",
        (f"{FUZZ}::test_a_hub_cache_snapshot_loads_and_trains",)),
    Bug("init-no-layer-precheck", "the config's layers not checked against the files before building",
        "loom/models/pretrained.py", "    if lacking:\n", "    if False:\n",
        (f"{CASES}[model-layers-over-weights]", HUGE)),
    Bug("init-no-dtype-check", "integer tensors accepted for floating-point weights",
        "loom/models/pretrained.py",
        "if stored.dtype not in FLOAT_DTYPES and not name.endswith(_NOT_PARAMETERS):", "if False:",
        (f"{CASES}[model-safetensors-dtype]",)),
    Bug("init-links-anywhere", "a model folder's links followed wherever they lead",
        "loom/models/pretrained.py",
        "    root = folder_root(path)  #", '    root = Path("/")  #',
        (f"{CASES}[model-weight-link-escapes]", f"{CASES}[model-hub-link-escapes]")),
    Bug("init-config-link-unchecked", "config.json read without the check that it stays inside the folder",
        "loom/models/pretrained.py",
        'config = read_hf_config(inside(path, "config.json", source=path, field="a file", root=root))',
        'config = read_hf_config(path / "config.json")', (f"{CASES}[model-hub-link-escapes]",)),
    Bug("init-transformers-leaks", "transformers' refusal of a config escapes as a traceback",
        "loom/models/pretrained.py",
        "        except Exception as e:  # noqa: BLE001 - any fault of the config is the same advice",
        "        except ZeroDivisionError as e:  # noqa: BLE001 - any fault of the config is the same advice",
        (f"{CASES}[model-config-transformers-refuses]",)),
    Bug("export-metadata-untyped", "a loom export's loom_model norm_eps taken as it is (NaN passes > 0)",
        "loom/models/pretrained.py",
        'norm_eps=doc.float("norm_eps", default.norm_eps, min=0, min_open=True, max=1),',
        'norm_eps=doc.raw.get("norm_eps", default.norm_eps),', (f"{CASES}[model-export-metadata]",)),
    Bug("map-any-file", "a tensor read from whichever file holds its name, not the one the map names",
        "loom/models/hf/weight_files.py",
        "    out = {}\n    for name, file in files.items():",
        "    out = {}\n    for header in headers.values():\n"
        "        out.update({n: s for n, s in header.items() if n in files})\n"
        "    return out\n    for name, file in files.items():",
        (f"{CASES}[model-weight-map-wrong-file]", MAP)),
    Bug("map-untyped", "the weight map taken as whatever mapping-like value it is (a list of pairs, …)",
        "loom/models/hf/weight_files.py", '    weight_map = doc.section("weight_map")\n',
        '    weight_map = Fields(dict(doc.raw["weight_map"]), index)\n',
        (f"{CASES}[model-weight-map-list]", MAP)),
    Bug("folder-duplicate-name", "without an index, a stray file's tensor silently replaces the real one",
        "loom/models/hf/weight_files.py", "            if name in out:\n", "            if False:\n",
        (f"{CASES}[model-weights-duplicate-name]",)),
    Bug("header-length-unchecked", "a safetensors header length past the file's end left to the library",
        "loom/models/hf/weight_files.py", "    if length > min(size - 8, MAX_HEADER_BYTES):", "    if False:",
        (f"{CASES}[model-safetensors-header]",)),
    Bug("header-parsed-by-hand", "the header parsed from the first bytes alone (a truncated file passes)",
        "loom/models/hf/weight_files.py", "    try:  # safetensors' parse",
        "    if True:\n        import json as _json\n"
        "        head = _json.loads(open(file, 'rb').read()[8:8 + length])\n"
        "        meta = head.pop('__metadata__', {})\n"
        "        return {n: Stored(file, v['dtype'], tuple(v['shape'])) for n, v in head.items()}, meta\n"
        "    try:  # safetensors' parse",
        (f"{CASES}[model-safetensors-truncated]", f"{FUZZ}::test_a_truncated_safetensors_file_is_one_line")),
    Bug("export-eps-constant", "export --layout hf writes a fixed rms_norm_eps, not the model's",
        "loom/models/gpt/llama_layout.py", '"rms_norm_eps": float(gpt.norm_eps),', '"rms_norm_eps": 1e-5,',
        ROUND_TRIP),
    Bug("export-tie-string", 'export --layout hf writes tie_word_embeddings as "true"/"false"',
        "loom/models/gpt/llama_layout.py", '"tie_word_embeddings": gpt.tie_embeddings,',
        '"tie_word_embeddings": str(gpt.tie_embeddings).lower(),', ROUND_TRIP),
    Bug("export-recorded-config-trusted", "export writes the HF config that meta.json records, unchecked",
        "loom/train/export.py",
        "return hf_config_from(config, f\"{path / 'meta.json'} model_config.hf_config\").raw",
        "return config",
        (f"{CASES}[model-export-recorded-config]",)),
]
