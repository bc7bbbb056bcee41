"""After training: load a checkpoint on one device, generate text, measure perplexity.

    checkpoint     which folder a --load names, and the configuration saved beside it
    model_flags    megatron flags that rebuild the saved model (the saved command line
                   without its launch flags, then the caller's overrides), parsed and checked
    world          this process as a megatron world (process group, parallel state, CPU
                   mode); megatron's console notices kept quiet
    prompts        prompts from --prompt or a jsonl file
    loading        the GPT model stage for the current parallel state, weights loaded
    architecture   what a built GPT computes, in the terms the KV decoder and the
                   Hugging Face export need
    sampling       greedy / temperature / top-k / top-p over the real vocabulary rows
    megatron_engine  generation through megatron.core.inference (static KV cache)
    kv_decoder     our own static-KV-cache decoder over the same weights, one CUDA graph
                   per decode step on a GPU
    generation     one call that runs either engine and times it
    generate, perplexity   the command lines behind tools/generate.py, tools/perplexity.py
"""
