"""megatron's ``--attention-backend`` as the kernels torch's scaled_dot_product_attention may
pick from in the fast spec's attention (``attention.SDPADotProductAttention``):

  auto     torch picks (flash, cuDNN, memory-efficient, math)
  flash    torch's FlashAttention-2 kernel
  fused    cuDNN's fused attention (Transformer Engine's "fused" backend is cuDNN's too)
  unfused  torch's math kernel: matmul, softmax, matmul
  local    the math kernel as well (megatron's local attention is unfused)

Which backend a launch runs, and where it cannot, the launch's resolution decides
(``megagpt.launch.attention_backend``).
"""

from __future__ import annotations

from typing import Optional

from torch.nn.attention import SDPBackend

AUTO, FLASH, FUSED, UNFUSED, LOCAL = "auto", "flash", "fused", "unfused", "local"

# the kernels the fast spec's SDPA attention may use for each backend (None: all)
SDPA_KERNELS: dict[str, Optional[tuple[SDPBackend, ...]]] = {
    AUTO: None,
    FLASH: (SDPBackend.FLASH_ATTENTION,),
    FUSED: (SDPBackend.CUDNN_ATTENTION,),
    UNFUSED: (SDPBackend.MATH,),
    LOCAL: (SDPBackend.MATH,),  # megatron's local attention is unfused
}


def backend_name(value) -> str:
    """``AttnBackend.flash`` (megatron's parsed value) or ``"flash"`` -> ``"flash"``."""
    if value is None:
        return AUTO
    return str(getattr(value, "name", value))


def sdpa_kernels_for(attention_backend) -> Optional[tuple[SDPBackend, ...]]:
    """The SDPA kernels the fast spec's attention may run for ``attention_backend`` (a
    TransformerConfig's value; None: torch picks among all)."""
    return SDPA_KERNELS.get(backend_name(attention_backend))
