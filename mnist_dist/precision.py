"""Mixed precision for one device: autocast around forward and loss, and a GradScaler for fp16."""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

DTYPES = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """``amp=off|bf16|fp16`` on ``device``. bf16 keeps fp32's exponent range, so it needs no loss
    scaling; fp16 does, or small gradients underflow to zero."""

    def __init__(self, amp: str, device: torch.device) -> None:
        self.device_type = device.type
        self.dtype = DTYPES[amp]
        self.scaler = torch.amp.GradScaler(device.type, enabled=amp == "fp16")

    def autocast(self) -> AbstractContextManager:
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype is not None)
