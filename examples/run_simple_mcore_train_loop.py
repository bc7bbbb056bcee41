"""The smallest visible Megatron-Core training loop, one step at a time.

    torchrun --nproc-per-node 1 examples/run_simple_mcore_train_loop.py        # one GPU (< 1 GB)
    torchrun --nproc-per-node 2 examples/run_simple_mcore_train_loop.py --tp 2 # two GPUs, TP 2
    python examples/run_simple_mcore_train_loop.py --cpu                       # no GPU: gloo, fp32

What pretrain_gpt.py hides inside megatron.training.pretrain, written out:
  1. distributed init: a process group, then megatron's model-parallel groups (TP/PP/DP)
  2. a small GPTModel from a TransformerConfig, wrapped in megatron's DDP
  3. mock data: MockGPTDataset through BlendedMegatronDatasetBuilder
  4. each step: get_forward_backward_func() runs forward and backward over the micro-batches,
     finalize_model_grads() all-reduces the gradients, the optimizer steps
  5. a distributed checkpoint (torch_dist) saved, loaded back into a fresh model and compared
"""

import argparse
import contextlib
import logging
import os
import sys
import tempfile
from functools import partial

import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed import finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer
from megatron.core.transformer import TransformerConfig

logging.getLogger("megatron.core.datasets").setLevel(logging.ERROR)  # index-building chatter

VOCAB_SIZE = 1024
SEQ_LENGTH = 64


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="run on the CPU (gloo, fp32)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=2, help="per step, per DP rank")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ckpt-dir", default=None, help="a new or empty folder (default: temporary)")
    return p.parse_args(argv)


def initialize_distributed(args) -> torch.device:
    """One process per GPU (torchrun sets RANK/WORLD_SIZE); one process without it."""
    # Alone, the process is a world of one: an in-memory store, no port to pick or collide on.
    alone = {} if "WORLD_SIZE" in os.environ else dict(store=dist.HashStore(), rank=0,
                                                       world_size=1)
    if args.cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo", **alone)
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, **alone)
    # Groups: every GPU is in one TP group, one PP group and one DP group (DP = world / TP / PP).
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp,
                                             pipeline_model_parallel_size=args.pp)
    # Seeds per TP rank (dropout differs across TP ranks, matches across DP ranks).
    model_parallel_cuda_manual_seed(123)
    return device


def build_model(args, device) -> GPTModel:
    """A 2-layer GPT: one stage of it when PP > 1."""
    config = TransformerConfig(
        num_layers=2, hidden_size=128, num_attention_heads=4,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        use_cpu_initialization=True, params_dtype=torch.float32,
        gradient_accumulation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, persist_layer_norm=False)
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB_SIZE, max_sequence_length=SEQ_LENGTH,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage())
    return model.to(device)


def train_data_iterator(args, samples: int):
    """Random tokens (MockGPTDataset), built the way pretrain_gpt.py builds real data."""
    config = GPTDatasetConfig(
        random_seed=0, sequence_length=SEQ_LENGTH, reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, tokenizer=NullTokenizer(VOCAB_SIZE),
        mid_level_dataset_surplus=0.005)
    train, _, _ = BlendedMegatronDatasetBuilder(
        MockGPTDataset, [samples, None, None], lambda: True, config).build()
    loader = torch.utils.data.DataLoader(train, batch_size=args.micro_batch_size, shuffle=False)
    return iter(loader)


def loss_func(loss_mask, output_tensor):
    """Mean next-token loss of the micro-batch; the schedule divides by the micro-batch count."""
    losses = output_tensor.float().view(-1)
    loss = torch.sum(losses * loss_mask.view(-1)) / loss_mask.sum()
    return loss, {"lm loss": loss.detach()}


def forward_step(device, data_iterator, model):
    """Called by the schedule once per micro-batch: the output and how to reduce it to a loss."""
    batch = {k: v.to(device) for k, v in next(data_iterator).items() if torch.is_tensor(v)}
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def save_and_load(model: GPTModel, args, device, ckpt_dir: str) -> int:
    """Save a distributed checkpoint, load it into a fresh model, return tensors compared."""
    if dist.get_rank() == 0:
        os.makedirs(ckpt_dir, exist_ok=True)  # megatron saves only into an empty folder
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(prefix=""), ckpt_dir)
    fresh = build_model(args, device)
    state = dist_checkpointing.load(fresh.sharded_state_dict(prefix=""), ckpt_dir)
    fresh.load_state_dict(state)
    compared = 0
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        if torch.is_tensor(a):
            assert torch.equal(a, b), f"{name} differs after the checkpoint round trip"
            compared += 1
    return compared


def train(args, device) -> list[float]:
    model = build_model(args, device)
    # Megatron's DDP: gradients accumulate into one contiguous buffer (param.main_grad).
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=0.01, clip_grad=1.0), [ddp])
    dp = parallel_state.get_data_parallel_world_size()
    data = train_data_iterator(args, args.steps * args.micro_batches * args.micro_batch_size * dp)
    forward_backward = get_forward_backward_func()  # no pipelining, or 1F1B when PP > 1

    losses = []
    for step in range(1, args.steps + 1):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        reports = forward_backward(
            forward_step_func=partial(forward_step, device), data_iterator=data, model=[ddp],
            num_microbatches=args.micro_batches, seq_length=SEQ_LENGTH,
            micro_batch_size=args.micro_batch_size, forward_only=False)
        finalize_model_grads([ddp])  # all-reduce gradients over DP (and embeddings over PP)
        update_ok, grad_norm, _ = optimizer.step()
        if parallel_state.is_pipeline_last_stage():
            loss = torch.stack([r["lm loss"] for r in reports]).mean()
            dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
            losses.append(loss.item() / dp)
            if dist.get_rank() == parallel_state.get_pipeline_model_parallel_last_rank():
                print(f"step {step:3d} | lm loss {losses[-1]:.4f} | grad norm {grad_norm:.3f} "
                      f"| update {'ok' if update_ok else 'skipped'}", flush=True)

    with contextlib.ExitStack() as stack:
        ckpt_dir = args.ckpt_dir or stack.enter_context(tempfile.TemporaryDirectory())
        if args.ckpt_dir is None and dist.get_world_size() > 1:
            ckpt_dir = _shared_path(ckpt_dir)
        compared = save_and_load(model, args, device, ckpt_dir)
        if dist.get_rank() == 0:
            print(f"checkpoint: saved to {ckpt_dir} and loaded back; {compared} tensors equal")
    return losses


def _shared_path(path: str) -> str:
    """All ranks must write to one folder: rank 0's."""
    holder = [path]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("no CUDA GPU here: run with --cpu")
    mode = contextlib.nullcontext()
    if args.cpu:
        # Megatron-Core creates tensors on "cuda" in a few places; CPU mode redirects them.
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from megagpt import cpu_mode
        mode = cpu_mode.active()
    with mode:
        device = initialize_distributed(args)
        try:
            losses = train(args, device)
            if losses and dist.get_rank() == parallel_state.get_pipeline_model_parallel_last_rank():
                print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")
            if not args.cpu and dist.get_rank() == 0:
                peak = torch.cuda.max_memory_allocated() / 2**20
                print(f"max GPU memory allocated: {peak:.0f} MiB")
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
