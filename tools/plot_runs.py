#!/usr/bin/env python
"""Plot loss, learning rate and throughput of training runs: see megagpt.run_log.plots.

    python tools/plot_runs.py runs/a/train.log runs/b/tensorboard --labels a b --out runs.png
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megagpt.project_env import use_project_environment  # noqa: E402

use_project_environment(__file__)  # .venv's Python where this one lacks megatron

from megagpt.run_log.plots import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
