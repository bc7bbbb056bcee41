#!/usr/bin/env python
"""Merge Megatron indexed datasets into one (upstream-compatible: --input, --output-prefix).

    python tools/merge_datasets.py --input data/a_text_document data/b_text_document \
        --output-prefix data/ab_text_document

--input also takes folders (every .bin/.idx pair inside, sorted). Code: megagpt/data/merge.py.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megagpt.project_env import use_project_environment  # noqa: E402

use_project_environment(__file__)  # .venv's Python where this one lacks megatron

from megagpt.data.merge import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
