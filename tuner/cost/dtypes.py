"""Bytes per value of the dtype a trial computes in, in one place. Every part of the cost model that
turns the precision string ("bf16", "fp16", "fp32": StudySpec.trial_dtype) into bytes asks here, so
"2 or 4 bytes" and "1 or 2 of Korthikanti's 16-bit units" cannot be mixed up again.
"""

from __future__ import annotations

from trainer.contract.devices import Dtype


def value_bytes(precision: str) -> int:
    """Bytes of one value in the compute dtype: 2 in bf16 or fp16, 4 in fp32. What activations,
    the messages of every collective and FSDP2's gathered weights take."""
    return 4 if precision == "fp32" else 2


def units_16bit(precision: str) -> int:
    """One value in Korthikanti et al. 2022's units (table 2 counts activations in 16-bit values,
    2 bytes each): 1 in bf16 or fp16, 2 in fp32. The memory-bound work is priced in these
    (ModelConstants.elementwise_flops_per_byte)."""
    return value_bytes(precision) // 2


def peak_dtype(precision: str) -> Dtype:
    """The device peak the GEMMs run at: the fp32 one for fp32, the 16-bit tensor cores' otherwise
    (ClusterSpec.peak_tflops_for)."""
    return "fp32" if precision == "fp32" else "bf16"


def adam_state_bytes(precision: str) -> int:
    """AdamW's state per parameter as ZeRO counts it (Rajbhandari et al. 2020 sec. 3.1): m and v
    in fp32 (8), plus the fp32 master copy when the weights themselves are 16-bit (12)."""
    return 8 + (4 if value_bytes(precision) < 4 else 0)
