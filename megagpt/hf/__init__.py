"""Hugging Face transformers folders to and from megatron checkpoints.

    architectures   which transformers class a megatron GPT is (GPT2LMHeadModel,
                    LlamaForCausalLM), and which megatron flags a transformers config is
    weights         tensor names and layouts between the two, both ways
    folder          output folders written whole or not at all
    export_hf       the command line behind tools/export_hf.py
    import_hf       the command line behind tools/import_hf.py
"""
