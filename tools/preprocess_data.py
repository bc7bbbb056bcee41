#!/usr/bin/env python
"""Tokenize jsonl / text files into Megatron indexed datasets (upstream-compatible flags).

    python tools/preprocess_data.py --input data.jsonl --output-prefix data/my \
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt \
        --append-eod --workers 2

Writes data/my_text_document.bin/.idx. See docs/data.md; the code is megagpt/data/preprocess.py.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megagpt.project_env import use_project_environment  # noqa: E402

use_project_environment(__file__)  # .venv's Python where this one lacks megatron

from megagpt.data.preprocess import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
