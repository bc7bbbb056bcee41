"""megatron GPTs as transformers models and back, in-process: transformers' logits equal
megatron's for every exportable architecture, the conversion inverts bit for bit, and what
has no transformers equivalent is refused naming the feature."""

import pytest
import torch

from megatron_parts import cpu_megatron, tiny_gpt
from megagpt.hf import architectures, weights
from megagpt.hf.architectures import GPT2, LLAMA, ConversionError
from megagpt.hf.export_hf import write_folder
from megagpt.inference.architecture import Architecture

ROWS, VOCAB = 96, 90  # megatron's embedding rows; the tokens among them (6 padding rows)
EXPORTED = {"gpt2": GPT2, "gpt2_exact_untied": GPT2, "llama_gqa": LLAMA,
            "llama_scaled_tied": LLAMA}


def exported(model, folder):
    """``model`` written as a transformers folder, loaded back with AutoModelForCausalLM."""
    from transformers import AutoModelForCausalLM

    arch = Architecture.of(model)
    target = architectures.transformers_class(arch)
    tensors = weights.to_transformers(model.state_dict(), arch, target, VOCAB, torch.float32)
    config = architectures.transformers_config(arch, target, VOCAB, 0, VOCAB - 1, "float32")
    write_folder(str(folder), tensors, config, 0, VOCAB - 1)
    return target, AutoModelForCausalLM.from_pretrained(str(folder)).eval()


@pytest.mark.parametrize("variant", list(EXPORTED))
def test_transformers_logits_equal_megatrons(variant, tmp_path):
    tokens = torch.tensor([[3, 14, 15, 92 % VOCAB, 65, 35, 89, 79, 32, 38, 46, 26],
                           [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])
    with cpu_megatron():
        model = tiny_gpt(variant, vocab_size=ROWS)
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        theirs = model(tokens, positions, None)[..., :VOCAB]
        target, hf = exported(model, tmp_path)
    assert target == EXPORTED[variant] and type(hf).__name__ == target
    assert hf.config.vocab_size == VOCAB  # the padding rows are gone
    with torch.no_grad():
        ours = hf(tokens).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", list(EXPORTED))
def test_conversion_back_is_bit_exact_and_pads_with_the_mean_row(variant):
    with cpu_megatron():
        model = tiny_gpt(variant, vocab_size=ROWS)
    arch = Architecture.of(model)
    target = architectures.transformers_class(arch)
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    hf = weights.to_transformers(state, arch, target, VOCAB, torch.float32)
    back = weights.from_transformers(hf, arch, target, ROWS, VOCAB, "test")
    assert sorted(back) == sorted(state)
    for name, tensor in state.items():
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert torch.equal(back[name][:VOCAB], tensor[:VOCAB])
            assert torch.equal(back[name][VOCAB:],
                               tensor[:VOCAB].mean(0, keepdim=True).expand(ROWS - VOCAB, -1))
        else:
            assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize("variant, features, message", [
    ("partial_rope_relu2", {}, "no transformers equivalent: with RoPE the export is "
                               "LlamaForCausalLM, which needs a gated MLP (--swiglu)"),
    ("nope_quick_geglu", {}, "no transformers equivalent for --position-embedding-type none"),
    ("gpt2", dict(qk_layernorm=True), "no transformers equivalent for q/k layer norms "
                                      "(--qk-layernorm)"),
    ("llama_gqa", dict(num_experts=2), "no transformers equivalent for mixture of experts "
                                       "(--num-experts)"),
])
def test_what_transformers_cannot_express_is_named(variant, features, message):
    with cpu_megatron():
        model = tiny_gpt(variant, vocab_size=ROWS, **features)
    with pytest.raises(ConversionError) as caught:
        architectures.transformers_class(Architecture.of(model))
    assert str(caught.value) == message


def test_transformers_configs_become_megatron_flags():
    from transformers import GPT2Config, LlamaConfig

    gpt2 = GPT2Config(n_layer=3, n_embd=48, n_head=4, n_positions=128).to_dict()
    target, flags = architectures.megatron_flags(gpt2, "gpt2-dir")
    assert target == GPT2
    assert flags == {"num-layers": 3, "hidden-size": 48, "num-attention-heads": 4,
                     "ffn-hidden-size": 192, "max-position-embeddings": 128, "seq-length": 128,
                     "position-embedding-type": "learned_absolute", "normalization": "LayerNorm",
                     "norm-epsilon": 1e-5, "hidden-dropout": 0.1, "attention-dropout": 0.1}
    llama = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=96,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                        max_position_embeddings=256, rms_norm_eps=1e-6,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                         "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192},
                        tie_word_embeddings=True).to_dict()
    target, flags = architectures.megatron_flags(llama, "llama-dir")
    assert target == LLAMA
    assert flags["group-query-attention"] and flags["num-query-groups"] == 2
    assert flags["kv-channels"] == 16 and flags["rotary-base"] == 500000
    assert flags["use-rope-scaling"] and flags["swiglu"] and flags["disable-bias-linear"]
    assert "untie-embeddings-and-output-weights" not in flags


@pytest.mark.parametrize("config, message", [
    ({"model_type": "mistral"}, "d: model_type 'mistral' is not supported (gpt2 and llama are)"),
    ({"model_type": "gpt2", "n_layer": 2, "n_embd": 8, "n_head": 2, "n_positions": 8,
      "activation_function": "relu"}, "GPT-2 activation_function 'relu'"),
    ({"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 8, "intermediate_size": 8,
      "num_attention_heads": 2, "max_position_embeddings": 8,
      "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0}},
     "Llama rope_type 'yarn': not supported"),
    ({"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 8, "intermediate_size": 8,
      "num_attention_heads": 2, "max_position_embeddings": 8,
      "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 32.0,
                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192}},
     "Llama llama3 RoPE scaling factor 32: megatron-core 0.19 builds every scaled RoPE with "
     "factor 8"),
    ({"model_type": "gpt2", "n_embd": 8}, "d: config.json has no 'n_layer'"),
])
def test_transformers_configs_megatron_cannot_build_are_refused(config, message):
    with pytest.raises(ConversionError) as caught:
        architectures.megatron_flags(config, "d")
    assert str(caught.value).startswith(message), str(caught.value)
