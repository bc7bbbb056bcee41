"""The compiled fused layer's residual dropout (megagpt.fast_spec.hash_dropout): masks at the
asked rate that look independent across elements and seeds, the same masks eagerly and
compiled by inductor, applied where the layer is compiled and nowhere else (the layer's own test of that is in
test_fast_spec.py)."""

import pytest
import torch
import torch._dynamo

from megagpt.fast_spec import hash_dropout
from megagpt.fast_spec.hash_dropout import draw_seeds, keep_mask

KEPT = 1 - round(0.1 * 65536) / 65536  # p = 0.1 to 1/65536


def _seed(value: int) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.int32)


def test_masks_keep_the_rate_and_look_independent():
    shape = (256, 8, 512)  # [s, b, h], 1 M elements
    a = keep_mask(shape, 0.1, _seed(12345)).flatten().double()
    b = keep_mask(shape, 0.1, _seed(12346)).flatten().double()
    assert abs(a.mean().item() - KEPT) < 0.0015
    assert abs(b.mean().item() - KEPT) < 0.0015
    # neighbours along the hidden dimension, the batch and the sequence; and two seeds
    for lag in (1, 512, 512 * 8):
        both = (a[lag:] * a[:-lag]).mean().item()
        assert abs(both - KEPT ** 2) < 0.002, lag
        dropped = ((1 - a[lag:]) * (1 - a[:-lag])).mean().item()
        assert abs(dropped - (1 - KEPT) ** 2) < 0.001, lag
    assert abs((a * b).mean().item() - KEPT ** 2) < 0.002
    assert torch.equal(keep_mask(shape, 0.1, _seed(12345)).flatten().double(), a)
    # the mask's bits: each of 16 positions of the hash's low half is even
    bits = hash_dropout._mix(hash_dropout._mix(torch.arange(1 << 16, dtype=torch.int32)
                                                ^ _seed(7)) + _seed(7))
    ones = torch.stack([(bits >> i) & 1 for i in range(16)]).double().mean(dim=1)
    assert (ones - 0.5).abs().max().item() < 0.01


def test_dropout_scales_what_it_keeps_and_zeroes_the_rest():
    x = torch.randn(64, 4, 32, requires_grad=True)
    seed = _seed(99)
    y = hash_dropout.dropout(x, 0.1, seed)
    keep = keep_mask(x.shape, 0.1, seed)
    torch.testing.assert_close(y[keep], x[keep] / 0.9)
    assert torch.count_nonzero(y[~keep]) == 0 and (~keep).any()
    y.sum().backward()
    torch.testing.assert_close(x.grad, keep.float() / 0.9)
    assert hash_dropout.dropout(x, 0.0, seed) is x


def test_seeds_come_from_torchs_generator():
    torch.manual_seed(5)
    first = draw_seeds(2, torch.device("cpu"))
    torch.manual_seed(5)
    assert torch.equal(draw_seeds(2, torch.device("cpu")), first)
    assert first.dtype == torch.int32 and first[0] != first[1]
    assert hash_dropout.usable((2048, 8, 12288)) and not hash_dropout.usable((1 << 16, 1 << 15))
    with pytest.raises(ValueError, match="int32"):
        keep_mask((1 << 16, 1 << 15), 0.1, first[0])


def test_inductor_compiles_the_same_masks_as_eager():
    """Inductor's generated code (C++ on a CPU) wraps the hash's int32 products as eager
    torch does: the same mask bit for bit."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda s: keep_mask((128, 4, 96), 0.1, s), fullgraph=True)
    for value in (0, 1, -(1 << 31), 123456789):
        assert torch.equal(compiled(_seed(value)), keep_mask((128, 4, 96), 0.1, _seed(value)))


def _layer_inputs(hidden=64, heads=4, seq=32, batch=2):
    torch.manual_seed(0)

    def p(*shape, scale=0.02):
        return (torch.randn(*shape) * scale).requires_grad_()

    x = torch.randn(seq, batch, hidden, requires_grad=True)
    tensors = [torch.ones(hidden, requires_grad=True), p(hidden), p(3 * hidden, hidden),
               p(3 * hidden), p(hidden, hidden), p(hidden), torch.ones(hidden, requires_grad=True),
               p(hidden), p(4 * hidden, hidden), p(4 * hidden), p(hidden, 4 * hidden), p(hidden),
               None]
    consts = dict(eps=1e-5, rms=False, groups=heads, q_per_group=1, head_dim=hidden // heads,
                  scale=(hidden // heads) ** -0.5, attn_p=0.0, hidden_p=0.5, act="gelu_tanh",
                  rotary_interleaved=False, rope_mscale=1.0, training=True)
    return x, tensors, consts


def test_fused_layer_takes_its_residual_masks_from_the_seeds():
    """Same seeds, same output; other seeds, another; out of training no dropout at all; and
    the layer compiled by inductor gives the eager layer's output and gradients."""
    from megagpt.fast_spec.layer import fused_layer_forward

    x, tensors, consts = _layer_inputs()
    seeds = torch.tensor([11, 22], dtype=torch.int32)
    one = fused_layer_forward(x, *tensors, **consts, dropout_seeds=seeds)
    torch.testing.assert_close(fused_layer_forward(x, *tensors, **consts, dropout_seeds=seeds),
                               one, rtol=0, atol=0)
    other = fused_layer_forward(x, *tensors, **consts,
                                dropout_seeds=torch.tensor([11, 23], dtype=torch.int32))
    assert not torch.allclose(one, other)
    evaluated = fused_layer_forward(x, *tensors, **dict(consts, training=False),
                                    dropout_seeds=seeds)
    torch.testing.assert_close(evaluated, fused_layer_forward(
        x, *tensors, **dict(consts, hidden_p=0.0)))

    torch._dynamo.reset()
    compiled = torch.compile(fused_layer_forward, fullgraph=True, dynamic=False)
    grads = []
    for fn in (fused_layer_forward, compiled):
        for t in (x, tensors[2], tensors[10]):
            t.grad = None
        y = fn(x, *tensors, **consts, dropout_seeds=seeds)
        y.square().mean().backward()
        grads.append((y.detach(), x.grad.clone(), tensors[2].grad.clone(),
                      tensors[10].grad.clone()))
    for eager, inductor in zip(*grads):
        torch.testing.assert_close(inductor, eager, rtol=1e-4, atol=1e-5)


def test_the_switch_reaches_the_layers():
    from megagpt.compat import Installed
    from megagpt.gpt_model import fused_layer_options
    from megagpt.launch.fast_path import plan_fast_path

    from megatron_parts import fast_path_namespace

    no_te = Installed(transformer_engine=False, apex=False, fused_layer_norm=False,
                      masked_softmax_kernels=False, gradient_accumulation_kernels=False)

    def options(argv):
        return fused_layer_options(plan_fast_path(fast_path_namespace(argv), no_te, {}))

    assert options([]).hash_dropout and not options(["--fast-disable", "hash-dropout"]).hash_dropout
    assert options([]).compile  # one GPU: the layer is compiled inside the CUDA graph
    assert options(["--fast-disable", "fused-layer"]) is None  # megatron's TransformerLayer


@pytest.mark.gpu
def test_gpu_compiled_masks_equal_eager_and_keep_the_rate():
    """On a GPU, Triton's int32 products wrap like eager CUDA's: the same masks."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch._dynamo.reset()
    shape = (1024, 8, 1024)
    compiled = torch.compile(lambda s: keep_mask(shape, 0.1, s), fullgraph=True)
    for seed in draw_seeds(3, torch.device("cuda")):
        mask = compiled(seed)
        assert torch.equal(mask, keep_mask(shape, 0.1, seed))
        assert abs(mask.double().mean().item() - KEPT) < 0.0005
