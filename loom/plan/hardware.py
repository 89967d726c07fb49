"""The GPU and link catalog, and the cluster the planner prices a run on.

Figures are vendor datasheet peaks: bf16 dense tensor FLOPs (no sparsity), HBM capacity in GB
(1e9 bytes, as marketed), HBM bandwidth, and per-GPU one-direction bandwidth of the intra-node
link (NVLink / Infinity Fabric / PCIe) and of the inter-node network (one NIC per GPU).
Any field can be overridden (`--hw key=value`); an unknown GPU is an error, never a guess.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass

from loom.checked import finite
from loom.errors import ConfigError
from loom.plan.device import DeviceProfile


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_tflops: float  # dense peak
    memory_gb: float
    hbm_tbps: float
    intra_node_gbps: float  # GB/s per GPU, one direction
    inter_node_gbps: float  # GB/s per GPU (its NIC), one direction
    host_link_gbps: float  # GB/s GPU <-> host memory (PCIe), offload traffic
    # Fixed costs that bound small models: a kernel's launch, a collective's latency (NCCL's
    # small-message time within a node over NVLink, across nodes over the NIC).
    kernel_launch_s: float = 5e-6
    intra_node_latency_s: float = 10e-6
    inter_node_latency_s: float = 25e-6


CATALOG: dict[str, GPU] = {g.name: g for g in (
    GPU("A100-40GB", 312, 40, 1.555, 300, 25, 25),  # NVLink3 600 GB/s bidirectional, HDR 200 Gb/s
    GPU("A100-80GB", 312, 80, 2.039, 300, 25, 25),
    GPU("H100-SXM", 989, 80, 3.35, 450, 50, 50),  # NVLink4 900 GB/s bidirectional, NDR 400 Gb/s
    GPU("H100-PCIe", 756, 80, 2.0, 64, 50, 50),  # no NVSwitch: peers over PCIe Gen5
    GPU("H200", 989, 141, 4.8, 450, 50, 50),
    GPU("B200", 2250, 180, 8.0, 900, 100, 50),  # NVLink5 1.8 TB/s bidirectional, 800 Gb/s NIC
    GPU("MI300X", 1307, 192, 5.3, 448, 50, 50),  # Infinity Fabric 7 links
    GPU("L40S", 362, 48, 0.864, 32, 25, 32),  # PCIe Gen4, no NVLink
    GPU("RTX-4090", 165, 24, 1.008, 32, 12.5, 32),  # fp32-accumulate tensor peak; PCIe Gen4
)}

ALIASES = {"H100": "H100-SXM", "H100-80GB": "H100-SXM", "H100-SXM5": "H100-SXM", "A100": "A100-80GB",
           "H200-141GB": "H200", "B200-180GB": "B200", "RTX4090": "RTX-4090", "4090": "RTX-4090"}


@dataclass(frozen=True)
class Cluster:
    gpu: GPU | None  # None: a CPU run (loom train on gloo): bytes are predicted, times are not
    gpus_per_node: int = 8
    nodes: int = 1
    host_memory_gb: float = 2000.0  # per node (a DGX H100 has 2 TB)
    nvme_gb: float = 30000.0  # per node
    nvme_gbps: float = 25.0  # per node, read or write
    cpu_adam_params_per_s: float = 2e9  # per node, DeepSpeed-style CPU Adam
    # None: the GPU family's calibrated values (plan/efficiency.py); a number overrides them
    achievable_fraction: float | None = None  # of the bf16 peak that dense training reaches
    comm_efficiency: float | None = None  # of link bandwidth that ring collectives reach
    fragmentation: float = 0.10  # allocator margin on top of what is allocated
    profile: DeviceProfile | None = None  # a measured device (`--gpu local`): time from its rates

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def describe(self) -> str:
        if self.profile is not None:
            where = f"on this machine ({self.profile.device})"
            return f"{self.nodes} node(s) × {self.gpus_per_node} rank(s) {where}"
        gpu = self.gpu.name if self.gpu else "cpu"
        return f"{self.nodes} node(s) × {self.gpus_per_node} {gpu}"


def lookup(name: str) -> GPU:
    key = _alias_target(name) or name
    for known, gpu in CATALOG.items():
        if known.lower() == key.lower():
            return gpu
    close = difflib.get_close_matches(name, list(CATALOG) + list(ALIASES), n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise ConfigError(f"unknown GPU {name!r}; {hint}known: {', '.join(CATALOG)} "
                      f"(or override fields with --hw)")


def _alias_target(name: str) -> str | None:
    return next((entry for alias, entry in ALIASES.items() if alias.lower() == name.lower()), None)


def alias_note(name: str) -> str | None:
    """What an alias (--gpu H100) was taken as, to be said: the catalog entry it names, among others
    it might have meant (H100 could be the PCIe card); None for a catalog name."""
    target = _alias_target(name)
    if target is None:
        return None
    gpu = CATALOG[target]
    return (f"--gpu {name} is taken as {gpu.name} ({gpu.memory_gb:g} GB, {gpu.bf16_tflops:g} bf16 TFLOPS); "
            f"if yours is another, name it: {', '.join(CATALOG)}")


FRACTIONS = ("achievable_fraction", "comm_efficiency", "fragmentation")  # --hw values ≤ 1
# Every --hw value (but a zero fragmentation margin) lies in this range, so that products and
# quotients of a few of them stay finite and nonzero.
OVERRIDE_RANGE = (1e-9, 1e15)


def with_overrides(cluster: Cluster, overrides: list[str]) -> Cluster:
    """Apply `key=value` pairs to the GPU's fields or the cluster's: finite numbers in
    OVERRIDE_RANGE, the fractions at most 1 (the fragmentation margin may be 0)."""
    gpu_fields = {f.name for f in dataclasses.fields(GPU)} - {"name"}
    cluster_fields = {f.name for f in dataclasses.fields(Cluster)} - {"gpu", "gpus_per_node", "nodes",
                                                                      "profile"}
    gpu_changes, cluster_changes = {}, {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or key not in gpu_fields | cluster_fields:
            known = ", ".join(sorted(gpu_fields | cluster_fields))
            raise ConfigError(f"--hw {item!r} must be key=value with key one of: {known}")
        try:
            value = finite(float(raw), f"--hw {key}", fix=f"e.g. --hw {key}={_example(cluster, key)}")
        except ValueError:
            raise ConfigError(f"--hw {key}={raw!r}: the value must be a number") from None
        low, high = OVERRIDE_RANGE[0], 1.0 if key in FRACTIONS else OVERRIDE_RANGE[1]
        if not low <= value <= high and not (key == "fragmentation" and value == 0):
            raise ConfigError(f"--hw {key}={raw.strip()}: the value must be in [{low:g}, {high:g}], "
                              f"e.g. --hw {key}={_example(cluster, key)}")
        (gpu_changes if key in gpu_fields else cluster_changes)[key] = value
    if gpu_changes:
        if cluster.gpu is None:
            raise ConfigError(f"--hw {', '.join(gpu_changes)} changes a GPU, but no --gpu was given")
        cluster = dataclasses.replace(cluster, gpu=dataclasses.replace(cluster.gpu, **gpu_changes))
    return dataclasses.replace(cluster, **cluster_changes)


def _example(cluster: Cluster, key: str) -> str:
    """The field's current value, as an example the user can edit."""
    value = getattr(cluster.gpu, key, None) if cluster.gpu is not None else None
    value = getattr(cluster, key, value) if value is None else value
    return f"{value:g}" if isinstance(value, (int, float)) else "0.4"


def detect(device_name: str, memory_bytes: int) -> GPU | None:
    """The catalog entry for a CUDA device name (torch.cuda.get_device_name), or None."""
    name = device_name.upper().replace(" ", "")
    gb = memory_bytes / 1e9
    checks = [("B200", "B200"), ("H200", "H200"), ("MI300X", "MI300X"), ("L40S", "L40S"),
              ("4090", "RTX-4090"), ("H100PCIE", "H100-PCIe"), ("H100", "H100-SXM"),
              ("A100", "A100-80GB" if gb > 50 else "A100-40GB")]
    for needle, entry in checks:
        if needle in name:
            return CATALOG[entry]
    return None
