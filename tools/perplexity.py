#!/usr/bin/env python
"""Loss and perplexity of a checkpoint on held-out text (.txt / .jsonl) or a preprocessed prefix.

    python tools/perplexity.py --load runs/tiny_cpu/checkpoints --cpu --input held_out.txt

See docs/after-training.md; the code is megagpt/inference/perplexity.py.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megagpt.project_env import use_project_environment  # noqa: E402

use_project_environment(__file__)  # .venv's Python where this one lacks megatron

from megagpt.inference.perplexity import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
