"""Device facts, defined once and torch-free: the peak FLOP/s the trainer's MFU divides by and the
performance model prices compute against, and the memory bandwidth the model prices memory-bound
work against. The tuner imports this module (it is part of the trainer's contract, like
trainer/contract/model.py); the trainer looks a GPU up by the name torch reports.

Every row is a vendor data sheet's dense (no sparsity) figure per device as torch sees it (an
MI250X is two GCDs, each its own device):
- NVIDIA: A100 (2020), H100/H200 (2023-24), B200 (2024), L40S, L4, A10G, V100, T4 data sheets;
  V100 and T4 have fp16 tensor cores and no bf16: their "low precision" peak is fp16's.
- AMD: Instinct MI250X (per GCD: 383 TFLOP/s bf16 and 3.2768 TB/s per MI250X, halved) and MI300X
  data sheets.
- The devices of 2026 (issue 38): B200, GB200 (NVL72), B300, GB300 (NVL72), MI325X, MI355X, with
  their dense FP8 and FP4 peaks; every figure and its source (vendor pages, reference
  architectures, ROCm's documentation; secondary sources named where the vendor's page was not
  readable) in docs/perfmodel.md, "Devices of 2026".
CPU ranks have no data sheet we can trust across machines: a nominal 0.05 TFLOP/s fp32 per rank
(a core's AVX2 FMA at ~3 GHz sustains 0.05-0.1) and ~10 GB/s. The performance model's CPU
constants (tuner/perfconstants.py) are fitted relative to these nominal figures, so CPU MFU
compares CPU trials with each other, not with GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DeviceKind = Literal["cpu", "gpu"]
Dtype = Literal["bf16", "fp32"]


@dataclass(frozen=True)
class Device:
    name: str  # matched as a substring of torch.cuda.get_device_name(); the table's order decides
    peak_tflops_bf16: float  # dense tensor-core bf16 (fp16 on V100 and T4)
    peak_tflops_fp32: float  # plain fp32 (torch does not use TF32 for matmuls by default)
    memory_gbps: float  # HBM/GDDR bandwidth, GB/s
    # The link to host memory, GB/s each way, nominal (the data sheet's bidirectional PCIe figure
    # halved: Gen5 x16 64, Gen4 32, Gen3 16; MI250X: a GCD's Infinity Fabric link to the CPU on
    # Frontier, 36): what offloaded activations cross (trainer/offload.py). Not measured here.
    host_gbps: float = 32.0
    # Dense FP8 (e4m3) and FP4 (NVFP4 / MXFP4) tensor-core peaks; None: the device has none or no
    # figure was found (docs/perfmodel.md).
    peak_tflops_fp8: float | None = None
    peak_tflops_fp4: float | None = None

    def peak_tflops(self, dtype: Dtype) -> float:
        return self.peak_tflops_fp32 if dtype == "fp32" else self.peak_tflops_bf16


# More specific names first: "H100 PCIe" before "H100", "A100-SXM4-40GB" before "A100", "GB200"
# before "B200" (a substring of it).
DEVICES: tuple[Device, ...] = (
    # Blackwell's fp32 peak: B200's 80 for each (no other figure found); host link PCIe Gen5 (the Grace
    # superchips' NVLink-C2C to host memory is not priced).
    Device("GB300", 2500.0, 80.0, 8000.0, 64.0, peak_tflops_fp8=5000.0, peak_tflops_fp4=15000.0),
    Device("GB200", 2500.0, 80.0, 8000.0, 64.0, peak_tflops_fp8=5000.0, peak_tflops_fp4=10000.0),
    Device("B300", 2250.0, 80.0, 8000.0, 64.0, peak_tflops_fp8=4500.0, peak_tflops_fp4=13125.0),
    Device("B200", 2250.0, 80.0, 8000.0, 64.0, peak_tflops_fp8=4500.0, peak_tflops_fp4=9000.0),
    Device("H200", 989.4, 66.9, 4800.0, 64.0, peak_tflops_fp8=1978.9),
    Device("H100 PCIe", 756.0, 51.2, 2000.0, 64.0, peak_tflops_fp8=1513.0),
    Device("H100", 989.4, 66.9, 3350.0, 64.0, peak_tflops_fp8=1978.9),  # SXM5
    Device("A100-SXM4-40GB", 312.0, 19.5, 1555.0),
    Device("A100-PCIE-40GB", 312.0, 19.5, 1555.0),
    Device("A100", 312.0, 19.5, 2039.0),  # 80 GB SXM4
    Device("L40S", 362.0, 91.6, 864.0),
    Device("L4", 121.0, 30.3, 300.0),
    Device("A10G", 70.0, 31.2, 600.0),  # AWS A10G data sheet: 70 TFLOP/s tensor, dense
    Device("V100", 125.0, 15.7, 900.0, 16.0),  # SXM2; fp16 tensor cores
    Device("T4", 65.0, 8.1, 320.0, 16.0),  # fp16 tensor cores
    # MI355X and MI325X fp32: MI300X's 163.4 (no figure checked here).
    Device("MI355X", 2500.0, 163.4, 8000.0, 64.0, peak_tflops_fp8=5000.0, peak_tflops_fp4=10000.0),
    Device("MI325X", 1307.4, 163.4, 6000.0, 64.0, peak_tflops_fp8=2614.9),
    Device("MI300X", 1307.4, 163.4, 5300.0, 64.0, peak_tflops_fp8=2614.9),
    Device("MI250X", 191.5, 47.9, 1638.4, 36.0),  # per GCD
)
CPU = Device("cpu", 0.05, 0.05, 10.0, 10.0)  # nominal, per rank (see the module docstring); host = device


def find_device(name: str) -> Device | None:
    """The table's row for a device name ('NVIDIA A100-SXM4-80GB', 'A100', 'cpu'); None if unknown."""
    if name.lower() == "cpu":
        return CPU
    return next((d for d in DEVICES if d.name in name), None)


def peak_tflops(name: str, dtype: Dtype) -> float:
    """The dense peak of a device in `dtype`; 0.0 for a GPU not in the table (MFU is then 0)."""
    device = find_device(name)
    return device.peak_tflops(dtype) if device else 0.0


def device_kind(cores_per_node: float | None) -> DeviceKind:
    """The one rule: ranks that share CPU cores (a cluster that says how many cores its nodes have,
    as cpu-local and our emulated CPU clusters do) are 'cpu'; everything else is a GPU."""
    return "cpu" if cores_per_node is not None else "gpu"
