"""Planted bugs in the readers of the planner and the analysis: `loom plan`'s numbers, device
profiles, profiler traces and a run's records (each check of docs/bad-input.md's "Planner and
analysis inputs" undone)."""

from __future__ import annotations

from planted import Bug

INPUTS = "tests/unit/test_plan_inputs.py"
FUZZ = "tests/unit/test_fuzz_plan.py"
CASES = "tests/unit/test_bad_input.py::test_bad_input"

BUGS = [
    Bug("profile-unchecked", "a device profile is taken as it parses (DeviceProfile(**json))",
        "loom/plan/device.py",
        '        return checked_profile(read_json(path, f"device profile {path}", '
        'max_bytes=MAX_PROFILE_BYTES),\n                               f"device profile {path}")',
        '        return DeviceProfile(**read_json(path, f"device profile {path}"))',
        (f"{INPUTS}::test_device_profile_refusals", f"{FUZZ}::test_perturbed_device_profile")),
    Bug("profile-empty-by-ranks", "a device profile without any rank count's measurements is accepted",
        "loom/plan/device.py", "    if not by_ranks.raw:\n", "    if False:\n",
        (f"{FUZZ}::test_perturbed_device_profile", f"{CASES}[plan-device-profile-empty]")),
    Bug("profile-save-unchecked", "`loom plan --calibrate` writes a NaN measurement over the good profile",
        "loom/plan/device.py", '    checked_profile(asdict(profile), "the measured profile")\n', "",
        (f"{INPUTS}::test_save_refuses_a_bad_measurement_and_keeps_the_profile_there",)),
    Bug("hw-not-finite", "--hw values not checked for NaN/inf (only the range, which NaN slips past)",
        "loom/plan/hardware.py",
        '            value = finite(float(raw), f"--hw {key}", '
        'fix=f"e.g. --hw {key}={_example(cluster, key)}")',
        "            value = float(raw)",
        (f"{CASES}[plan-hw-nan]", f"{INPUTS}::test_hw_values_and_their_bounds")),
    Bug("hw-no-lower-bound", "--hw accepts denormal values (a FLOP rate of 1e-320 divides by zero)",
        "loom/plan/hardware.py", "OVERRIDE_RANGE = (1e-9, 1e15)", "OVERRIDE_RANGE = (0.0, 1e15)",
        (f"{INPUTS}::test_hw_values_and_their_bounds",)),
    Bug("params-not-finite", "--params nan reaches the range check (its message names no NaN)",
        "loom/plan/shapes.py",
        '    count = finite(count, "--params", fix="give a parameter count such as 70e9")\n', "",
        (f"{CASES}[plan-params-nan]", f"{INPUTS}::test_plan_numbers_refused")),
    Bug("plan-config-unvalidated", "loom plan takes --set values without loom train's checks",
        "loom/plan/command.py",
        "    return validate(dividing, cluster.world_size, cuda_available=cuda, this_machine=False)",
        "    from loom.config import resolve_dims\n    return resolve_dims(cfg.parallel, cluster.world_size)",
        (f"{INPUTS}::test_plan_refuses_what_train_refuses",)),
    Bug("trace-events-unchecked", "malformed trace events are silently skipped instead of refused",
        "loom/observe/ledger.py", "            raise _malformed(ev)\n", "            return\n",
        (f"{CASES}[analyze-trace-pid-list]", f"{INPUTS}::test_damaged_trace_is_refused_beside_good_ones")),
    Bug("trace-comm-args-unchecked", "a collective's args (sizes, Seq) used without their types",
        "loom/observe/ledger.py", "    for key, value in kept.items():\n", "    for key, value in ():\n",
        (f"{FUZZ}::test_perturbed_trace_events",)),
    Bug("trace-utf8-replaced", "a trace read with undecodable bytes replaced, not refused",
        "loom/observe/trace_events.py", '        self._text = codecs.getincrementaldecoder("utf-8")()',
        '        self._text = codecs.getincrementaldecoder("utf-8")(errors="replace")',
        (f"{INPUTS}::test_bad_utf8_in_a_gzip_trace_names_the_byte", f"{CASES}[analyze-trace-not-utf8]")),
    Bug("trace-damage-as-cut", "an event damaged mid-file is taken for the file's end (the rest dropped)",
        "loom/observe/trace_events.py", "                    if len(buf) - e.pos > DAMAGE_CHARS:",
        "                    if False:",
        (f"{INPUTS}::test_damage_far_from_the_end_is_not_a_cut",)),
    Bug("trace-empty-read-hides-cut", "a gzip stream cut before any text reads as an empty file",
        "loom/observe/trace_events.py", "                if size:\n                    break",
        "                if out:\n                    break",
        (f"{CASES}[analyze-trace-truncated]",)),
    Bug("trace-damaged-skipped", "a damaged trace is skipped beside good ones (ranks silently missing)",
        "loom/observe/ledger.py",
        "refused, not analyzed around\n            raise r\n",
        "refused, not analyzed around\n            continue\n",
        (f"{INPUTS}::test_damaged_trace_is_refused_beside_good_ones",)),
    Bug("trace-header-unchecked", "baseTimeNanoseconds read with int() (a string is a traceback)",
        "loom/observe/trace_events.py",
        '            return Fields(self.header, self.path).int("baseTimeNanoseconds", default=0, min=0, '
        'max=MAX_NS)',
        '            return int(self.header.get("baseTimeNanoseconds") or 0)',
        (f"{FUZZ}::test_perturbed_trace_events", f"{CASES}[analyze-trace-header]")),
    Bug("summary-pairs-unchecked", "summary.json's measured-vs-planned pairs taken untyped",
        "loom/observe/analyze.py", "                _pair(row, key)\n", "                pass\n",
        (f"{FUZZ}::test_perturbed_run_records", f"{CASES}[analyze-summary-pair-nan]")),
    Bug("run-config-untyped", "config.toml's ddp_bucket_mb handed to the diagnosis untyped",
        "loom/observe/analyze.py",
        '                out[key] = fields.float(key, min=low, min_open=key == "ddp_bucket_mb", max=high)',
        '                out[key] = fields.raw[key]',
        (f"{INPUTS}::test_run_config_wrong_types",)),
    Bug("train-profile-read-in-ranks", "loom train leaves a damaged device profile to its ranks' plan.json",
        "loom/cli.py", "    device.load(required=False)  # plan.json", "    pass  # plan.json",
        (f"{CASES}[train-device-profile-empty]",)),
]
