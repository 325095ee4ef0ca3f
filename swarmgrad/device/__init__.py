"""Where a peer computes: which device and precision it trains with (placement.py), how its batches
are cut to fit (microbatch.py), and the one place swarm data crosses between that device and the
host (boundary.py). Only torch and the package's base are imported here."""

from typing import Literal

# what --device and --precision accept (here, not in placement.py: the CLI's help must not import torch)
DEVICE_PATTERN = r"auto|cpu|mps|cuda(:[0-9]+)?"
PrecisionName = Literal["auto", "fp32", "bf16", "fp16"]
