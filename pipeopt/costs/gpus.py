"""GPU catalog: dense peak matrix throughput (FLOP/s) and memory capacity (bytes).

All figures are the *dense* tensor-core peaks. Vendor spec sheets often print the 2:4
structured-sparsity figure (twice the dense one, footnoted "with sparsity"); those are not used
here. Sources (checked December 2026):

- A100: NVIDIA A100 datasheet — BF16/FP16 tensor 312 TFLOP/s dense (624 sparse), TF32 156
  dense; 40 GB or 80 GB HBM (nvidia-smi reports 40960 / 81920 MiB).
- H100 SXM5: NVIDIA H100 datasheet / Hopper whitepaper — BF16 989.4 TFLOP/s dense (1978.9
  with sparsity), TF32 494.7 dense; 80 GB HBM3 (e.g. glennklockwood.com/garden/processors/h100;
  hpctech's datasheet copy: "shown with sparsity, specifications 1/2 lower without").
- H200: the H100 compute die with 141 GB of usable HBM3e (144 GB physical); same peaks.
- B200: HGX B200 — 36 PFLOP/s BF16 with sparsity for 8 GPUs, i.e. 2.25 PFLOP/s dense per GPU;
  180 GB HBM3e usable per GPU in DGX/HGX B200 (192 GB physical).
- L4: 121 TFLOP/s BF16 dense (242 with sparsity), 24 GB GDDR6; no NVLink, PCIe Gen4 x16.
- L40S: 362 TFLOP/s BF16 dense (733 with sparsity), 48 GB GDDR6; no NVLink, PCIe Gen4 x16.
- MI300X: AMD datasheet — 1307.4 TFLOP/s BF16 dense (2614.9 with sparsity), TF32 653.7;
  192 GB HBM3.

Memory is the total the driver reports, so that every entry has the same unit: nvidia-smi's
"Memory-Usage" total in MiB (A100 40960 / 81920, H100 SXM 81559, H200 143771, B200 183359,
L4 23034, L40S 46068; as printed on those GPUs) and rocm-smi's VRAM total for MI300X
(206141652992 bytes = 192 GiB). The marketed "GB" figures mix decimal and binary units.

PCIe per direction: Gen4 x16 32 GB/s (A100, L4, L40S), Gen5 x16 64 GB/s (H100, H200, B200,
MI300X).

FP32 training runs on the TF32 tensor-core path, so ``dtype: fp32`` uses the TF32 figure.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

TERA = 1e12
MIB = 2**20


@dataclass(frozen=True)
class GPU:
    """One accelerator model: dense peaks in FLOP/s and memory capacity in bytes."""

    name: str
    bf16_flops: float
    tf32_flops: float
    memory_bytes: float
    #: Default per-direction bandwidth of the intra-node fabric (bytes/s).
    nvlink_bandwidth: float = 450e9
    #: False for GPUs without a GPU-to-GPU fabric (L4, L40S): they talk over PCIe.
    nvlink: bool = True
    #: Default per-direction PCIe bandwidth (bytes/s): Gen4 x16 32e9, Gen5 x16 64e9.
    pcie_bandwidth: float = 64e9

    def peak_flops(self, dtype: str) -> float:
        """Dense peak matrix throughput for ``dtype`` (bf16/fp16 -> tensor 16-bit; fp32 -> TF32)."""
        return self.tf32_flops if dtype == "fp32" else self.bf16_flops


CATALOG: dict[str, GPU] = {g.name: g for g in (
    GPU("A100-40GB", 312 * TERA, 156 * TERA, 40_960 * MIB, nvlink_bandwidth=300e9,
        pcie_bandwidth=32e9),
    GPU("A100-80GB", 312 * TERA, 156 * TERA, 81_920 * MIB, nvlink_bandwidth=300e9,
        pcie_bandwidth=32e9),
    GPU("H100-SXM", 989.4 * TERA, 494.7 * TERA, 81_559 * MIB, nvlink_bandwidth=450e9),
    GPU("H200", 989.4 * TERA, 494.7 * TERA, 143_771 * MIB, nvlink_bandwidth=450e9),
    GPU("B200", 2250 * TERA, 1125 * TERA, 183_359 * MIB, nvlink_bandwidth=900e9),
    GPU("L4", 121 * TERA, 60 * TERA, 23_034 * MIB, nvlink_bandwidth=32e9, nvlink=False,
        pcie_bandwidth=32e9),
    GPU("L40S", 362 * TERA, 183 * TERA, 46_068 * MIB, nvlink_bandwidth=32e9, nvlink=False,
        pcie_bandwidth=32e9),
    GPU("MI300X", 1307.4 * TERA, 653.7 * TERA, 196_592 * MIB,
        nvlink_bandwidth=64e9),  # Infinity Fabric links between the GPUs of a node
)}

_ALIASES = {"H100": "H100-SXM", "A100": "A100-80GB", "H100SXM": "H100-SXM",
            "A100-40G": "A100-40GB", "A100-80G": "A100-80GB"}


def lookup(name: str) -> GPU:
    """The catalog entry for ``name`` (case-insensitive; a few aliases).

    Raises KeyError with a "did you mean" hint.
    """
    by_upper = {k.upper(): v for k, v in CATALOG.items()}
    key = _ALIASES.get(name.upper(), name).upper()
    if key in by_upper:
        return by_upper[key]
    close = difflib.get_close_matches(name.upper(), list(by_upper), n=1, cutoff=0.5)
    hint = (f"; did you mean {by_upper[close[0]].name!r}?" if close
            else f"; known: {', '.join(CATALOG)}")
    raise KeyError(f"unknown GPU {name!r}{hint}")
