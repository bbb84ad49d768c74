"""What each GPU reaches of its data-sheet figures (trainer/contract/devices.py) in published kernel and
collective benchmarks: the level the performance model prices a device at before anything was
measured on it (tuner.perfconstants.default_constants). Nothing here is fitted to a training run;
docs/perfmodel.md ("Levels per device") has the table with every source and assumption.

Sources (repository@commit:path, read 2026-12-03):
- [MAMF] stas00/ml-engineering@b9e29720:compute/accelerator/README.md, "Maximum Achievable Matmul
  FLOPS comparison table": the best bf16 torch.matmul over a sweep of shapes / the dense peak.
- [AZ-A100] Azure/AI-benchmarking-guide@3bb66cac:Azure_Results/ND_A100_v4_results.md and
  [AZ-H100] ...@f350e7e6:"Azure Results/ND_H100_v5_results.md", [AZ-H200]
  ...@7f20e5fa:Azure_Results/ND_H200_v5_results.md: STREAM-like HBM bandwidth, flash-attn 2's
  benchmark (forward + backward, batch 2, sequence 8192), nccl-tests all-reduce bus bandwidth.
- [H200-AR] stas00/ml-engineering@c53741b8:network/benchmarks/results/all-reduce-8xH200.md: the
  ring all-reduce with NVSwitch SHARP off, 367.61 GB/s of 450.
- [GPUI-V100] pc2/GPUInspector.jl@83ce4ac3:docs/src/devices/v100_sxm2.md: saxpy 810 GB/s of 900.
- [LUMI-RCCL] Lumi-supercomputer/lumi-reframe-tests@071c2a34:checks/microbenchmarks/gpu/
  rccl_test.py: all-reduce over 2 nodes x 8 MI250X GCDs (Frontier's node design), fp16, reference
  bus bandwidth 85 GB/s at 128 MiB against the node's 4 x 25 GB/s NICs.
- [ROCM-FA] ROCm/flash-attention issue #44 (2024-02, MI250X, third party): the CK flash attention
  forward at 25-29 % of a GCD's peak (sequences 256-576); its backward "substantially slower".
- [MAMF-2026] stas00/ml-engineering@744d01e1:compute/accelerator/README.md (read 2026-12-07), the
  same table's newer rows: B200 1745.0 / 2250 bf16 (fp8 3432.5 / 4500), B300 1769.0 / 2250 (fp8
  3353.3 / 4500), GB200 1822.0 / 2500 (fp8 3615.6 / 5000), MI325X 784.9 / 1300, MI355X 1565.0 (the
  table divides by MI350X's 2300; AMD's MI355X peak is 2500).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceLevel:
    """Fractions of a device's data-sheet figures that published benchmarks reach."""

    gemm: float  # best bf16 matmul / dense bf16 peak [MAMF]: the GEMMs' ceiling
    memory: float  # STREAM triad / data-sheet memory bandwidth: memory-bound work's
    flash_attention: float  # flash attention forward + backward TFLOP/s (flash-attn's count) / peak
    comm: float  # all-reduce bus bandwidth / link bandwidth, large messages (nccl-tests, ring)


# A100 SXM4 80GB, the reference: GEMM 271.2 / 312 [MAMF]; HBM triad 1.70 / 2.039 TB/s, FA2 179.5 /
# 312 TFLOP/s (head dim 64; causal or not, the page does not say), all-reduce 231.58 / 300 GB/s at
# 8 GB [AZ-A100].
A100 = DeviceLevel(gemm=0.869, memory=0.834, flash_attention=0.575, comm=0.772)
# H100 SXM: GEMM 794.5 / 989 [MAMF]; HBM triad 2.97 / 3.35 TB/s, FA2 327.9 / 989.4 (head dim 128)
# [AZ-H100]; all-reduce as a ring 367.61 / 450 GB/s [H200-AR] (NVSwitch SHARP reaches 478.87 [AZ-H100],
# but only for all-reduce inside a node: the ring's figure prices reduce-scatter and all-gather too).
H100 = DeviceLevel(gemm=0.803, memory=0.887, flash_attention=0.331, comm=0.817)

# Devices with no published figure for a field take the nearest device's, named per row.
LEVELS: dict[str, DeviceLevel] = {
    "A100": A100,
    "A100-SXM4-40GB": A100,  # same die and kernels; its own 1555 GB/s HBM2 in trainer/contract/devices.py
    "A100-PCIE-40GB": DeviceLevel(0.811, A100.memory, A100.flash_attention, A100.comm),  # GEMM 252.9 [MAMF]
    "H100": H100,
    "H100 PCIe": H100,  # not measured: the SXM part's fractions
    # H200: the H100 die (GEMM and comm as H100); HBM triad 4.15 / 4.8 TB/s, FA2 329.3 [AZ-H200].
    "H200": DeviceLevel(H100.gemm, 0.865, 0.333, H100.comm),
    # Blackwell: GEMM from [MAMF-2026] (bf16; their fp8 GEMMs reach about the same fraction:
    # 0.763, 0.745, 0.723); HBM, flash attention and NCCL not measured: H100's fractions.
    "B200": DeviceLevel(0.776, H100.memory, H100.flash_attention, H100.comm),
    "B300": DeviceLevel(0.786, H100.memory, H100.flash_attention, H100.comm),
    "GB200": DeviceLevel(0.729, H100.memory, H100.flash_attention, H100.comm),
    "GB300": DeviceLevel(0.729, H100.memory, H100.flash_attention, H100.comm),  # no GEMM figure: GB200's
    # MI250X, per GCD: GEMM 147.0 / 191.5 [MAMF, ROCm 6.2, the older table that did not flush caches
    # between runs]; HBM not measured: A100's fraction; flash attention: [ROCM-FA]'s forward 0.25
    # taken for forward + backward (an assumption: no full measurement); RCCL 85 / 100 GB/s across
    # 2 nodes [LUMI-RCCL], taken for links inside a node too (none measured).
    "MI250X": DeviceLevel(gemm=0.767, memory=A100.memory, flash_attention=0.25, comm=0.85),
    # MI300X: GEMM 668.4 / 1300 [MAMF, ROCm 6.3, tunable ops]; the rest not verified here: A100's.
    "MI300X": DeviceLevel(0.514, A100.memory, A100.flash_attention, A100.comm),
    # MI325X: GEMM 784.9 / 1307.4 [MAMF-2026]; MI355X 1565.0 / 2500 (AMD's peak, not the table's
    # 2300); the rest not verified: A100's, as MI300X.
    "MI325X": DeviceLevel(0.600, A100.memory, A100.flash_attention, A100.comm),
    "MI355X": DeviceLevel(0.626, A100.memory, A100.flash_attention, A100.comm),
    # V100 SXM2: HBM saxpy 810 / 900 GB/s [GPUI-V100]; no GEMM, attention or NCCL figure: A100's
    # (its tensor cores issue 116.4 of 125.3 TFLOP/s in GPUInspector's peak test, above that).
    "V100": DeviceLevel(A100.gemm, 0.90, A100.flash_attention, A100.comm),
    # T4, L4, L40S, A10G: nothing measured found; A100's fractions (T4 is power-capped at 70 W, so
    # this is optimistic for it: docs/benchmarks.md shows the AMP table on T4 too fast).
    "T4": A100,
    "L4": A100,
    "L40S": A100,
    "A10G": A100,
}

# Bytes moved per byte of the activations a layer stores (Korthikanti table 2's units, in which
# tuner/cost/compute.py counts memory-bound work): 500 peak-FLOPs per byte on the A100, the value
# chosen on the vTrain h1024 tables with Korthikanti table 5's MFU trend, at the A100's achievable
# bandwidth: 500 x 2.039e12 x 0.834 / 312e12 = 2.73 bytes. Every device pays these bytes at its
# own achievable bandwidth, so the A100's price is the chosen one and the others follow from their
# FLOP-per-byte ratios.
MEMORY_TRAFFIC = 500.0 * 2039e9 * A100.memory / 312e12


def device_level(name: str | None) -> DeviceLevel | None:
    """The level of a trainer/contract/devices.py row by its name; None for no or an unknown device."""
    return LEVELS.get(name) if name else None
