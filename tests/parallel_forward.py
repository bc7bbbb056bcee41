"""Under torchrun: one batch's logits from checkpoints loaded in TP x PP layouts.

    torchrun --nproc-per-node 2 tests/parallel_forward.py JOBS.json

``JOBS.json``: a list of ``{"load": CKPT, "tokens": IN.pt, "out": OUT.pt, "layout": [flags]}``
(``--tensor-model-parallel-size 2``, ``--pipeline-model-parallel-size 2``), run one after the
other in the same processes. Each checkpoint loads through ``megagpt.inference.loading``
(every rank its shard); the forward pass is megatron's: the model itself under TP (logits
gathered across the TP ranks), the forward-only pipeline schedule under PP (logits on the
last stage). Rank 0 of the last stage saves them, [batch, seq, padded vocabulary].
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def forward(load: str, tokens_file: str, out: str, layout: list[str]) -> None:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megagpt.inference import loading

    prepared = loading.prepare(load, layout, cpu=True)
    tokens = torch.load(tokens_file)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with loading.loaded(prepared) as (model, _), torch.no_grad():
        def forward_step(_data_iterator, stage):
            return stage(tokens, positions, None, runtime_gather_output=True), None

        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            logits = model(tokens, positions, None, runtime_gather_output=True)
        else:
            outputs = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=None, model=[model],
                num_microbatches=1, seq_length=tokens.shape[1],
                micro_batch_size=tokens.shape[0], forward_only=True)
            logits = outputs[0] if outputs else None
        if parallel_state.is_pipeline_last_stage() and \
                parallel_state.get_tensor_model_parallel_rank() == 0:
            torch.save(logits, out)


def main() -> int:
    import torch.distributed as dist

    from megagpt.inference.world import quiet_megatron

    quiet_megatron()
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    dist.init_process_group("gloo")  # one group for every job: each sets its own layout in it
    try:
        for job in jobs:
            forward(job["load"], job["tokens"], job["out"], job["layout"])
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
