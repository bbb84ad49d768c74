"""Hardware facts in one place: the cluster presets, the probe of this machine (cpu-local) and the
device kind. Each preset names its device, a row of trainer/contract/devices.py's table, whose peak
FLOP/s the performance model prices against and the trainer's MFU divides by (one table for
both); the links are the presets' own data-sheet figures. tuner/spec.py's ClusterSpec is the
validated form of a preset."""

from __future__ import annotations

import os
from typing import Any

from trainer.contract.devices import CPU, find_device


def _cpu_local() -> dict[str, Any]:
    """This machine, each core a 'device' (a CPU rank). The peak is trainer/contract/devices.py's nominal
    CPU figure (0.05 TFLOP/s fp32 per rank), the one the CPU constants are fitted against and the
    trainer's CPU MFU divides by; the memory is the machine's, shared by its cores."""
    cores = os.cpu_count() or 1
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        mem_gb = 8.0
    return {
        "name": "cpu-local", "device": CPU.name, "gpus_per_node": cores, "num_nodes": 1,
        "device_memory_gb": round(mem_gb / cores, 1), "peak_tflops": CPU.peak_tflops_fp32,
        # gloo over loopback: a few GB/s and tens of microseconds per message.
        "intra_node_gbps": 2.0, "inter_node_gbps": 2.0,
        "intra_node_latency_us": 50.0, "inter_node_latency_us": 50.0, "cores_per_node": cores,
    }  # fmt: skip


def _gpus(device: str, **fields: Any) -> dict[str, Any]:
    """A GPU preset: the device's dense bf16 peak from the device table, and the preset's links."""
    row = find_device(device)
    assert row is not None, f"{device!r} is not in trainer/contract/devices.py"
    return {"device": device, "peak_tflops": row.peak_tflops_bf16, **fields}


# Links: NVLink/Infinity Fabric per-GPU unidirectional bandwidth inside a node; the node's total
# network injection bandwidth between nodes (data sheets). Memory: the device's total as
# nvidia-smi reports it, where checked (issue 37: an "80 GB" A100 or H100 holds 80 GiB, nvidia-smi's
# 81920 and 81559 MiB, 85.9 and 85.5 GB; an "40 GB" A100 40960 MiB; until then 80 and 40 GB were
# priced, 7 % less); the CUDA context and communication buffers are the model's workspace_bytes.
# H200 (141) and MI250X (64 per GCD) are the data sheets' figures, not checked the same way.
CLUSTER_PRESETS: dict[str, dict[str, Any]] = {
    # DGX A100: NVLink3 600 GB/s bidirectional = 300 per direction; 8 x 200 Gb/s HDR = 200 GB/s.
    "a100-80gb": _gpus("A100", gpus_per_node=8, device_memory_gb=85.9, intra_node_gbps=300, inter_node_gbps=200,
                       intra_node_latency_us=5, inter_node_latency_us=10),
    # DGX H100: NVLink4 900 GB/s bidirectional = 450 per direction; 8 x 400 Gb/s NDR = 400 GB/s.
    "h100-80gb": _gpus("H100", gpus_per_node=8, device_memory_gb=85.52, intra_node_gbps=450, inter_node_gbps=400,
                       intra_node_latency_us=4, inter_node_latency_us=8),
    "h200-141gb": _gpus("H200", gpus_per_node=8, device_memory_gb=141, intra_node_gbps=450, inter_node_gbps=400,
                        intra_node_latency_us=4, inter_node_latency_us=8),
    # The devices of 2026 (issue 38; figures and sources: docs/perfmodel.md "Devices of 2026").
    # Latencies: H100's for NVLink 5 and InfiniBand / Ethernet (none measured). Memory: the data
    # sheets' (B300: 270 GB, the part's name in MLPerf's system descriptions, of its 288 label).
    # DGX / HGX B200: 8 GPUs on NVLink 5 (1.8 TB/s bidirectional = 900 per direction), one
    # ConnectX-7 at 400 Gb/s per GPU = 400 GB/s a node.
    "b200": _gpus("B200", gpus_per_node=8, device_memory_gb=180, intra_node_gbps=900, inter_node_gbps=400,
                  intra_node_latency_us=4, inter_node_latency_us=8),
    # DGX / HGX B300: as B200, one ConnectX-8 at 800 Gb/s per GPU = 800 GB/s a node.
    "b300": _gpus("B300", gpus_per_node=8, device_memory_gb=270, intra_node_gbps=900, inter_node_gbps=800,
                  intra_node_latency_us=4, inter_node_latency_us=8),
    # GB200 NVL72: trays of 4 GPUs (a Slurm node), 72 on one NVLink 5 domain (18 trays); one
    # ConnectX-7 at 400 Gb/s per GPU (DGX GB200; AWS's p6e has 800) = 200 GB/s a tray.
    "gb200-nvl72": _gpus("GB200", gpus_per_node=4, scaleup_domain=72, device_memory_gb=186, intra_node_gbps=900,
                         inter_node_gbps=200, intra_node_latency_us=4, inter_node_latency_us=8),
    # GB300 NVL72: as GB200 NVL72, one ConnectX-8 at 800 Gb/s per GPU = 400 GB/s a tray (secondary
    # sources only), 279 GB a GPU.
    "gb300-nvl72": _gpus("GB300", gpus_per_node=4, scaleup_domain=72, device_memory_gb=279, intra_node_gbps=900,
                         inter_node_gbps=400, intra_node_latency_us=4, inter_node_latency_us=8),
    # AMD's 8-GPU boards: a full Infinity Fabric mesh, 7 links a GPU, 64 GB/s each per direction
    # (MI355X 76.8): 448 (537.6) to all peers at once, a group of k its k - 1 links
    # (intra_node_peer_gbps). One 400 Gb/s NIC per GPU = 400 GB/s a node (Azure ND MI300X v5;
    # MI325X and MI355X platforms: assumed the same, no vendor figure found). Latencies: the
    # ClusterSpec defaults (none measured).
    "mi300x": _gpus("MI300X", gpus_per_node=8, device_memory_gb=192, intra_node_gbps=448, intra_node_peer_gbps=64,
                    inter_node_gbps=400),
    "mi325x": _gpus("MI325X", gpus_per_node=8, device_memory_gb=256, intra_node_gbps=448, intra_node_peer_gbps=64,
                    inter_node_gbps=400),
    "mi355x": _gpus("MI355X", gpus_per_node=8, device_memory_gb=288, intra_node_gbps=537.6,
                    intra_node_peer_gbps=76.8, inter_node_gbps=400),
    # Frontier (OLCF user guide): 4 MI250X = 8 GCDs per node, 64 GB HBM2e per GCD; Infinity Fabric
    # 50-100 GB/s between GCDs of different MI250X (50 taken: rings cross them); 4 x 25 GB/s
    # Slingshot-11 NICs per node.
    "frontier-mi250x": _gpus("MI250X", gpus_per_node=8, device_memory_gb=64, intra_node_gbps=50,
                             inter_node_gbps=100, intra_node_latency_us=8, inter_node_latency_us=15),
    # Perlmutter GPU nodes (NERSC docs): 4 A100-40GB, NVLink3 4 links per pair (100 GB/s per
    # direction to each peer), 4 x 25 GB/s Slingshot-11.
    "perlmutter-a100-40gb": _gpus("A100-SXM4-40GB", gpus_per_node=4, device_memory_gb=42.95, intra_node_gbps=100,
                                  inter_node_gbps=100, intra_node_latency_us=5, inter_node_latency_us=12),
}  # fmt: skip
CLUSTER_PRESET_NAMES = ("cpu-local", *CLUSTER_PRESETS)


def cluster_preset(name: str) -> dict[str, Any]:
    """A preset's fields (cpu-local probes this machine); ValueError names the valid presets."""
    if name == "cpu-local":
        return _cpu_local()
    if name not in CLUSTER_PRESETS:
        raise ValueError(f"unknown cluster preset {name!r}; valid: {list(CLUSTER_PRESET_NAMES)}")
    return {"name": name, "num_nodes": 1, **CLUSTER_PRESETS[name]}
