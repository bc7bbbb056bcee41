"""The training step without Transformer Engine: what the fast path changes in megatron's
optimizer, training loop and gradient buffer (bench/notes/fast-path.md has what each measured).

- ``optimizer``: torch's fused AdamW as megatron's Adam, ``torch._foreach_*`` gradient-norm,
  scale and copy kernels in place of megatron's per-tensor fallbacks;
- ``flat_adam``: megatron's bf16 AdamW step as one pass over flat buffers;
  ``flat_adam_fp8``: that pass writing the FP8 linears' weights too;
- ``async_step``: no host waits inside the step where megatron's are identities;
- ``grad_write``: gradients written into megatron's buffer, not zeroed and added;
- ``capture_watchdog``: a deadline on the full-iteration CUDA graph's capture.

Each changes megatron through ``megagpt.megatron_wrappers`` while the launch's context is
entered; what is on for a launch is decided by its resolution (``megagpt.launch``).
"""
