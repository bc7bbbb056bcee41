#!/usr/bin/env python
"""Turn a Hugging Face GPT-2 or Llama folder into a checkpoint pretrain_gpt.py continues from.

    python tools/import_hf.py --hf runs/tiny_hf --save runs/tiny_imported

A release checkpoint (fresh optimizer and schedule) plus a --config YAML; see
docs/after-training.md. The code is megagpt/hf/import_hf.py.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megagpt.project_env import use_project_environment  # noqa: E402

use_project_environment(__file__)  # .venv's Python where this one lacks megatron

from megagpt.hf.import_hf import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
