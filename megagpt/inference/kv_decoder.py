"""A static-KV-cache decoder over a megatron GPT's own weights, one CUDA graph per step.

Why not only megatron's engine: at batch 1 a decode step is a few hundred tiny kernels, and
megatron's static loop launches each from Python through ~25 module calls per layer, with
host synchronisations between steps; the GPU then waits for the host. Here the forward
pass is written out over the same parameter tensors (no copy) with every shape fixed by
the cache, so on a GPU one step is captured once as a CUDA graph and replayed: one launch
per token, no host wait until the end (or every ``EOD_CHECK_EVERY`` tokens when stopping at
the end-of-document token).

The cache holds keys and values for every position of every row (``[batch, max_length,
groups, 2, head_dim]`` per layer). A step writes its keys and values at each row's own
position and attends to the cache positions at or before it, so rows of different lengths
share a batch, and a prompt shorter than the batch's longest, right-padded, is exact: its
padding writes positions that a later step overwrites before any query can see them.
Attention is ``F.scaled_dot_product_attention`` over the cache with a mask of the visible
positions (one fused kernel at decode).

With ``compile_step`` the step goes through ``torch.compile`` before it is captured, and its
linear layers at batch <= ``GEMV_MAX_ROWS`` become reductions (``_linear``): at batch 1 the
step is bound by how many kernels it runs and how fast each small one reads its weights.

What it covers: dense pre-norm GPT layers (LayerNorm or RMSNorm), learned absolute
positions, RoPE (also partial, and llama3 scaling as megatron applies it) or none, grouped
query attention, GeLU (exact or tanh) / SiLU / ReLU / squared ReLU / quick GeLU, gated or
not, with or without biases, tied or untied output. ``unsupported_reason`` says what else
a model uses; ``generation`` then runs megatron's engine instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from megagpt import model_math
from megagpt.inference.architecture import Architecture
from megagpt.inference.sampling import Sampling, generator_for, next_tokens

# With stopping at the end-of-document token, the host looks whether every row has
# finished once per this many tokens: one synchronisation per 32 steps instead of each.
EOD_CHECK_EVERY = 32

# A compiled step computes its linear layers as reductions up to this many rows (batch x
# tokens); see ``_linear``. Above it each row reads the weights again and cuBLAS's products
# win (``bench_generate.py --gemv-max-rows N``; figures: bench/notes/generation.md).
GEMV_MAX_ROWS = 4


def unsupported_reason(model) -> str | None:
    """Why this decoder cannot run ``model`` (None when it can)."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP

    arch = Architecture.of(model)
    if arch.unsupported:
        return ", ".join(arch.unsupported)
    if not (model.pre_process and model.post_process):
        return "one pipeline stage of a larger model"
    for layer in model.decoder.layers:
        if not isinstance(layer.self_attention, SelfAttention) or type(layer.mlp) is not MLP:
            return "layers other than self-attention + dense MLP"
        if isinstance(layer.input_layernorm, IdentityOp) or \
                isinstance(layer.pre_mlp_layernorm, IdentityOp):
            return "norms fused into the linear layers (Transformer Engine's spec)"
    if getattr(model.decoder, "final_layernorm", None) is None:
        return "no final norm"
    return None


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear``; inside a compiled step with at most ``GEMV_MAX_ROWS`` rows, the same
    product as a multiply-and-sum in fp32, which inductor turns into one reduction kernel
    with the bias, the norm before it and the activation after it fused in.

    Why: at batch 1 cuBLAS runs each of a layer's four products as its own matrix-vector
    kernel that reads 2-8 MB of weights well below the memory bandwidth, plus the separate
    kernels around it; the reductions read them faster and need fewer kernels.
    With more rows each row reads the weights again, and cuBLAS wins (figures:
    bench/notes/generation.md). Eagerly the product would be materialised, so only when
    compiling."""
    rows = x.numel() // x.shape[-1]
    if rows > GEMV_MAX_ROWS or not torch.compiler.is_compiling():
        return F.linear(x, weight, bias)
    y = (x.unsqueeze(-2).float() * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class KVDecoder:
    """Prefill and decode for up to ``max_batch`` rows of up to ``max_length`` tokens."""

    def __init__(self, model, max_batch: int, max_length: int, use_graphs: bool | None = None,
                 compile_step: bool = False):
        """``compile_step``: the decode step's forward through ``torch.compile`` (inductor
        fuses each layer's norms, bias adds, activation and attention softmax; at batch 1 a
        step is bound by how many kernels it runs, not by their arithmetic). Its compile
        takes tens of seconds, once per batch size: worth it for long generations."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the KV decoder does not cover {reason}")
        self.model = model
        self.arch = Architecture.of(model)
        if max_length > self.arch.max_position_embeddings:
            raise ValueError(f"{max_length} positions > the model's "
                             f"{self.arch.max_position_embeddings}")
        embedding = model.embedding.word_embeddings.weight
        self.device, self.dtype = embedding.device, embedding.dtype
        self.max_batch, self.max_length = max_batch, max_length
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else use_graphs
        self.word_embeddings = embedding
        self.position_embeddings = (model.embedding.position_embeddings.weight
                                    if self.arch.position == "learned_absolute" else None)
        self.output_weight = (model.shared_embedding_or_output_weight() if self.arch.tied
                              else model.output_layer.weight)
        self.layers = list(model.decoder.layers)
        self.final_norm = model.decoder.final_layernorm
        a = self.arch
        # per layer [batch, position, group, key | value, head_dim]: a step's keys and values
        # sit side by side in its QKV output, so one scatter writes both
        shape = (max_batch, max_length, a.num_query_groups, 2, a.kv_channels)
        self.caches = [torch.zeros(shape, device=self.device, dtype=self.dtype)
                       for _ in self.layers]
        self.cache_positions = torch.arange(max_length, device=self.device)
        self.row_ids = torch.arange(max_batch, device=self.device)  # sliced per step: no kernel
        self.rope_cos = self.rope_sin = None
        if a.position == "rope":
            # megatron's table for these positions: [max_length, 1, 1, rotary dim]
            freqs = model.rotary_pos_emb(max_length).view(max_length, -1).to(self.device)
            self.rope_cos = torch.cos(freqs).to(self.dtype)
            self.rope_sin = torch.sin(freqs).to(self.dtype)
        self._graphs: dict[int, tuple] = {}
        self.compile_step = compile_step
        self._compiled_forward = None

    # ------------------------------------------------------------------ the forward pass

    def _rope(self, t: Tensor, positions: Tensor) -> Tensor:
        """megatron's non-interleaved rotation of the first rotary-dim channels of ``t``
        ([b, s, heads, d]) at each token's position ([b, s])."""
        cos = self.rope_cos[positions].unsqueeze(2)
        sin = self.rope_sin[positions].unsqueeze(2)
        return model_math.rotary(t, cos, sin)

    def _attention(self, i: int, layer, x: Tensor, positions: Tensor, visible: Tensor) -> Tensor:
        a = self.arch
        b, s, _ = x.shape
        groups, per_group, d = a.num_query_groups, a.num_heads // a.num_query_groups, \
            a.kv_channels
        qkv_linear = layer.self_attention.linear_qkv
        qkv = _linear(x, qkv_linear.weight, qkv_linear.bias)
        # megatron's layout: per query group, its query heads, then one key, one value
        qkv = qkv.view(b, s, groups, per_group + 2, d)
        q, k, v = qkv[:, :, :, :per_group], qkv[:, :, :, per_group], qkv[:, :, :, per_group + 1]
        if a.position == "rope":
            q = self._rope(q.reshape(b, s, groups * per_group, d), positions)
            q = q.view(b, s, groups, per_group, d)
            k = self._rope(k, positions)
        # one write of this step's keys and values: [b, s, groups, 2, d] at each row's positions
        kv = qkv[:, :, :, per_group:] if a.position != "rope" else torch.stack((k, v), dim=3)
        cache = self.caches[i][:b]
        cache[self.row_ids[:b, None], positions] = kv
        keys, values = cache[:, :, :, 0].transpose(1, 2), cache[:, :, :, 1].transpose(1, 2)
        # query head h reads key group h // per_group: megatron's order, and SDPA's for GQA
        queries = q.reshape(b, s, groups * per_group, d).transpose(1, 2)
        context = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=visible[:, None], scale=a.softmax_scale,
            enable_gqa=groups != a.num_heads)
        context = context.transpose(1, 2).reshape(b, s, a.num_heads * d)
        proj = layer.self_attention.linear_proj
        return _linear(context, proj.weight, proj.bias)

    def _mlp(self, layer, x: Tensor) -> Tensor:
        fc1, fc2 = layer.mlp.linear_fc1, layer.mlp.linear_fc2
        h = _linear(x, fc1.weight, fc1.bias)
        if self.arch.gated:
            h = model_math.gated(h, self.arch.activation)
        else:
            h = model_math.activation(h, self.arch.activation)
        return _linear(h, fc2.weight, fc2.bias)

    def forward(self, tokens: Tensor, positions: Tensor, last: Tensor) -> Tensor:
        """Logits [b, padded vocab] after token ``last[r]`` of each row ``r``, for ``tokens``
        ([b, s]) at ``positions`` ([b, s]); writes their keys and values into the cache."""
        x = F.embedding(tokens, self.word_embeddings)
        if self.position_embeddings is not None:
            x = x + F.embedding(positions, self.position_embeddings)
        visible = self.cache_positions.view(1, 1, -1) <= positions.unsqueeze(-1)
        for i, layer in enumerate(self.layers):
            x = x + self._attention(i, layer, layer.input_layernorm(x), positions, visible)
            x = x + self._mlp(layer, layer.pre_mlp_layernorm(x))
        h = self.final_norm(x[self.row_ids[:x.shape[0]], last])
        return _linear(h, self.output_weight)

    # ------------------------------------------------------------------ one decode step

    def _step_forward(self):
        """The decode step's forward: ``forward`` itself, or compiled (``compile_step``)."""
        if not self.compile_step:
            return self.forward
        if self._compiled_forward is None:
            # coordinate-descent tuning of inductor's reduction kernels (the GEMV reductions
            # above), for a few more seconds of compile
            self._compiled_forward = torch.compile(
                self.forward, fullgraph=True, dynamic=False,
                options={"coordinate_descent_tuning": True})
        return self._compiled_forward

    def _step(self, batch: int):
        """The decode step for ``batch`` rows: (tokens [b, 1], positions [b, 1], run), where
        ``run()`` returns the logits for the tokens and positions currently in the buffers."""
        if batch in self._graphs:
            return self._graphs[batch]
        tokens = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        positions = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        last = torch.zeros(batch, dtype=torch.long, device=self.device)
        forward = self._step_forward()
        if not self.use_graphs:
            return tokens, positions, lambda: forward(tokens, positions, last)
        state = {"graph": None, "logits": None}

        def run():
            if state["graph"] is None:
                # first use: the step runs eagerly on a side stream (its result is real), which
                # also warms up cuBLAS and the allocator; then it is captured, not run
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    logits = forward(tokens, positions, last)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    state["logits"] = forward(tokens, positions, last)
                state["graph"] = graph
                return logits
            state["graph"].replay()
            return state["logits"]

        self._graphs[batch] = (tokens, positions, run)
        return self._graphs[batch]

    # ------------------------------------------------------------------ generation

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling,
                 vocab_size: int, eod: int, stop_at_eod: bool) -> list[list[int]]:
        """New token ids per prompt (up to ``max_new_tokens``; a completion that ends at the
        end-of-document token includes it)."""
        batch = len(prompts)
        lengths = [len(p) for p in prompts]
        if batch > self.max_batch or max(lengths) + max_new_tokens > self.max_length:
            raise ValueError(f"{batch} prompts of up to {max(lengths)} tokens + "
                             f"{max_new_tokens} new: the decoder holds {self.max_batch} x "
                             f"{self.max_length}")
        device = self.device
        padded = torch.full((batch, max(lengths)), eod, dtype=torch.long)
        for r, p in enumerate(prompts):
            padded[r, :len(p)] = torch.tensor(p, dtype=torch.long)
        padded = padded.to(device)
        length = torch.tensor(lengths, dtype=torch.long, device=device)
        generator = generator_for(sampling, device)
        out = torch.empty(batch, max_new_tokens, dtype=torch.long, device=device)
        finished = torch.zeros(batch, dtype=torch.bool, device=device)

        def choose(logits: Tensor, step: int) -> Tensor:
            token = next_tokens(logits, sampling, vocab_size, generator)
            if stop_at_eod:
                token = torch.where(finished, torch.full_like(token, eod), token)
                finished.logical_or_(token == eod)
            out[:, step] = token
            return token

        prompt_positions = torch.arange(padded.shape[1], device=device).expand(batch, -1)
        token = choose(self.forward(padded, prompt_positions, length - 1), 0)
        tokens, positions, run = self._step(batch)
        positions.copy_(length.unsqueeze(1))
        made = 1
        while made < max_new_tokens:
            if stop_at_eod and made % EOD_CHECK_EVERY == 0 and bool(finished.all()):
                break
            tokens.copy_(token.unsqueeze(1))
            token = choose(run(), made)
            positions.add_(1)
            made += 1
        rows = out[:, :made].tolist()
        return [row[:row.index(eod) + 1] if stop_at_eod and eod in row else row for row in rows]
