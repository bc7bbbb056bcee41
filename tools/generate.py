#!/usr/bin/env python
"""Complete prompts with a trained checkpoint (KV cache; one GPU in bf16, or --cpu).

    python tools/generate.py --load runs/tiny_cpu/checkpoints --cpu --prompt "ROMEO:" \
        --max-new-tokens 40 --temperature 0.8 --top-k 40

See docs/after-training.md; the code is megagpt/inference/generate.py.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megagpt.project_env import use_project_environment  # noqa: E402

use_project_environment(__file__)  # .venv's Python where this one lacks megatron

from megagpt.inference.generate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
