#!/usr/bin/env python
"""Write a trained checkpoint as a Hugging Face transformers model folder.

    python tools/export_hf.py --load runs/tiny_cpu/checkpoints --output runs/tiny_hf

GPT2LMHeadModel or LlamaForCausalLM, loadable offline with AutoModelForCausalLM; see
docs/after-training.md. The code is megagpt/hf/export_hf.py.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megagpt.project_env import use_project_environment  # noqa: E402

use_project_environment(__file__)  # .venv's Python where this one lacks megatron

from megagpt.hf.export_hf import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
