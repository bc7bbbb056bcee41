"""The fast spec: GPT layers without Transformer Engine (see bench/notes/fast-path.md).

- ``spec``: the layer spec (``get_fast_gpt_layer_spec``) and what it does not cover
  (``fast_spec_unsupported_reason``);
- ``layer``: ``FastTransformerLayer``, a dense pre-norm layer as one fused function;
- ``attention`` and ``sdpa_kernels``: torch's scaled_dot_product_attention in megatron's place;
- ``norm``: torch's norms, usable under sequence parallelism;
- ``lm_loss``: the chunked LM-head cross entropy (GPTModel's output processor);
- ``hash_dropout``: residual dropout masks hashed from each element's index;
- ``fp8``, ``fp8_cast``: the FP8 linears and their casts (where they run is the launch's:
  ``megagpt.launch.fp8``); ``fp8_weights``: the weights' FP8 copies the optimizer writes for
  them.

The model is built from what a launch decided (``megagpt.launch``); nothing here decides a
launch's choices.
"""
