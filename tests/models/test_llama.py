"""lstrain.models.llama and its layers: the fused model against its plain-torch twin, RoPE's
contract, state_dict keys, bad input, compile."""

import pytest
import torch

from lstrain._backend import record_backends
from lstrain.layers import RotaryAttention, SwiGLU, rope_qkv_torch, rope_torch, rotary_cos_sin
from lstrain.models import Llama, LlamaConfig
from lstrain.testing import assert_all_passed, check_module
from tests.conftest import DEVICE, EXPECTED_BACKEND

# GQA (2 kv heads for 4 query heads); F = 48 < 128: the SwiGLU pair layout's partial block
TINY = {
    "vocab_size": 37,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 16,
}


class _Loss(torch.nn.Module):
    """The model's loss as a function of input_ids alone, for check_module."""

    def __init__(self, model, labels, attention_mask):
        super().__init__()
        self.model, self.labels, self.attention_mask = model, labels, attention_mask

    def forward(self, input_ids):
        return self.model(input_ids, labels=self.labels, attention_mask=self.attention_mask).loss


def twins(device=DEVICE, dtype=None, **overrides):
    """A fused LLaMA and its unfused twin with the same weights."""
    config = LlamaConfig(**{**TINY, **overrides})
    torch.manual_seed(0)
    fused = Llama(config, device=device, dtype=dtype)
    plain = Llama(LlamaConfig(**{**vars(config), "fused": False}), device=device, dtype=dtype)
    plain.load_state_dict(fused.state_dict())
    return fused, plain


def batch(vocab, size=(2, 12), device=DEVICE, padding=True):
    ids = torch.randint(0, vocab, size, device=device)
    labels = ids.clone()
    labels[0, :3] = -100
    mask = None
    if padding:
        mask = torch.ones(size, dtype=torch.long, device=device)
        mask[-1, -4:] = 0
        labels[-1, -4:] = -100
    return ids, labels, mask


@pytest.mark.parametrize(
    ("padding", "overrides"),
    [
        (False, {}),
        (True, {}),
        (True, {"num_key_value_heads": 4, "tie_word_embeddings": True}),
        (False, {"num_key_value_heads": 1, "attention_bias": True, "head_dim": 16}),
    ],
    ids=["gqa", "gqa-padding", "mha-tied-padding", "mqa-bias-head_dim16"],
)
def test_loss_and_every_gradient_match_the_unfused_twin(padding, overrides):
    fused, plain = twins(**overrides)
    ids, labels, mask = batch(TINY["vocab_size"], padding=padding)
    with record_backends() as ran:
        comparisons = check_module(
            _Loss(fused, labels, mask), _Loss(plain, labels, mask), ids, generator=torch.Generator().manual_seed(0)
        )
    assert {op for op, _ in ran} >= {
        "embedding",
        "rms_norm",
        "add_rms_norm",
        "rope_qkv",
        "swiglu_mlp",
        "linear_cross_entropy",
    }
    assert {backend for _, backend in ran} == {EXPECTED_BACKEND}
    assert len(comparisons) == 1 + len(list(fused.parameters()))  # the loss and every parameter
    assert_all_passed(comparisons)


def _norm_in_epilogue(model, on=True):
    for layer in model.model.layers:
        layer.norm_in_epilogue = on
    return model


@pytest.mark.parametrize("padding", [False, True])
def test_norm_in_epilogue_matches_the_unfused_twin(padding):
    """Every layer's attention output projection, residual add, norm and MLP as
    ``linear_add_rms_norm_swiglu`` (the o_proj bias too): the loss and every gradient."""
    fused, plain = twins(attention_bias=True)
    _norm_in_epilogue(fused)
    ids, labels, mask = batch(TINY["vocab_size"], padding=padding)
    with record_backends() as ran:
        comparisons = check_module(
            _Loss(fused, labels, mask), _Loss(plain, labels, mask), ids, generator=torch.Generator().manual_seed(0)
        )
    ops = [op for op, _ in ran]
    assert "swiglu_mlp" not in ops and ops.count("linear_add_rms_norm_swiglu") >= TINY["num_hidden_layers"]
    assert {backend for _, backend in ran} == {EXPECTED_BACKEND}
    assert_all_passed(comparisons)


def test_norm_in_epilogue_stays_off_under_autocast():
    """Autocast would cast an fp32 residual stream down: the layer keeps the unfused path."""
    fused, _ = twins()
    _norm_in_epilogue(fused)
    ids, labels, _ = batch(TINY["vocab_size"], padding=False)
    device_type = torch.device(DEVICE).type
    with record_backends() as ran, torch.autocast(device_type, dtype=torch.bfloat16):
        fused(ids, labels=labels)
    assert "linear_add_rms_norm_swiglu" not in {op for op, _ in ran}


def test_norm_in_epilogue_takes_the_unfused_path_where_the_op_does_not_fit():
    """fp16 (the op would overflow), a stream in another dtype than the weights, hooks or
    options on the MLP module that the op would skip: the layer takes the unfused path."""
    fused, _ = twins()
    layer = _norm_in_epilogue(fused).model.layers[0]
    stream = torch.zeros(2, 3, TINY["hidden_size"], device=DEVICE)
    assert layer._epilogue_norm(stream)
    assert not layer._epilogue_norm(stream.double())
    handle = layer.mlp.register_forward_hook(lambda module, args, output: None)
    assert not layer._epilogue_norm(stream)
    handle.remove()
    layer.mlp.keep_activation = True
    assert not layer._epilogue_norm(stream)
    half = _norm_in_epilogue(twins(dtype=torch.float16)[0]).model.layers[0]
    assert not half._epilogue_norm(stream.half())


def test_logits_match_the_unfused_twin():
    fused, plain = twins()
    ids, _, mask = batch(TINY["vocab_size"])
    with torch.no_grad():
        ours, theirs = fused(ids, attention_mask=mask), plain(ids, attention_mask=mask)
    assert ours.loss is None and theirs.loss is None
    torch.testing.assert_close(ours.logits, theirs.logits)
    assert fused(ids, labels=ids).logits is None  # the fused loss never builds the logits


def test_labels_follow_hugging_face_semantics():
    _, plain = twins()
    ids, labels, _ = batch(TINY["vocab_size"], padding=False)
    with torch.no_grad():
        out = plain(ids, labels=labels)
    logits, target = out.logits[:, :-1].reshape(-1, TINY["vocab_size"]), labels[:, 1:].reshape(-1)
    kept = target != -100
    expected = torch.nn.functional.cross_entropy(logits[kept], target[kept])  # the mean over kept tokens
    torch.testing.assert_close(out.loss, expected)


def test_state_dict_has_hugging_face_keys_in_either_twin():
    fused, plain = twins()
    keys = list(fused.state_dict())
    assert keys == list(plain.state_dict())
    layer = [k.removeprefix("model.layers.0.") for k in keys if k.startswith("model.layers.0.")]
    assert layer == [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    ]
    assert keys[0] == "model.embed_tokens.weight" and keys[-2:] == ["model.norm.weight", "lm_head.weight"]
    shapes = {k: tuple(v.shape) for k, v in fused.state_dict().items()}
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == (32, 32)
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (16, 32)  # 2 kv heads x 8
    assert shapes["model.layers.1.mlp.gate_proj.weight"] == (48, 32)
    # packed inside: one q/k/v projection and one gate/up matrix
    assert dict(fused.named_parameters())["model.layers.0.self_attn.qkv_proj.weight"].shape == (64, 32)
    assert fused.lm_head.weight is not fused.model["embed_tokens"].weight  # untied by default (HF's)
    tied, _ = twins(tie_word_embeddings=True)
    assert tied.lm_head.weight is tied.model["embed_tokens"].weight


def test_load_state_dict_packs_and_splits_exactly():
    fused, _ = twins()
    state = fused.state_dict()
    state = {k: torch.randn_like(v).cpu() for k, v in state.items()}
    again = Llama(LlamaConfig(**TINY, fused=False))
    again.load_state_dict(state)
    for key, value in again.state_dict().items():
        assert torch.equal(value, state[key]), key
    broken = {k: v for k, v in state.items() if k != "model.layers.1.self_attn.v_proj.weight"}
    with pytest.raises(RuntimeError, match="model.layers.1.self_attn.qkv_proj.weight"):
        again.load_state_dict(broken)


def test_presets_and_overrides():
    small = LlamaConfig.llama_0_75b()
    assert (small.num_hidden_layers, small.hidden_size, small.num_attention_heads, small.num_key_value_heads) == (
        12,
        2048,
        16,
        16,
    )
    assert (small.intermediate_size, small.vocab_size, small.tie_word_embeddings, small.head_dim) == (
        5632,
        32000,
        False,
        128,
    )
    tiny_llama = LlamaConfig.llama_1b(fused=False)
    assert (tiny_llama.num_hidden_layers, tiny_llama.num_key_value_heads, tiny_llama.fused) == (22, 4, False)
    count = {
        name: sum(p.numel() for p in Llama(c, device="meta").parameters())
        for name, c in [("s", small), ("l", tiny_llama)]
    }
    assert count["l"] == 1_100_048_384  # TinyLlama-1.1B's published parameter count
    assert count["s"] == 12 * (4 * 2048**2 + 3 * 2048 * 5632 + 2 * 2048) + 2 * 32000 * 2048 + 2048  # 0.75B
    assert (
        LlamaConfig(**TINY).head_dim == 8
        and LlamaConfig(**{**TINY, "num_key_value_heads": None}).num_key_value_heads == 4
    )


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"vocab_size": 1.5}, "vocab_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"head_dim": 7}, "head_dim"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
        ({"rope_theta": -1.0}, "rope_theta"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_dropout": 1.0}, "attention_dropout"),
        ({"tie_word_embeddings": 1}, "tie_word_embeddings"),
        ({"fused": 1}, "fused"),
    ],
)
def test_bad_config_fields_are_named(overrides, field):
    with pytest.raises(ValueError, match=f"LlamaConfig: {field}"):
        LlamaConfig(**{**TINY, **overrides})


def _with(ids, index, value):
    out = ids.clone()
    out[index] = value
    return out


def test_bad_input_is_named():
    model, _ = twins()
    ids = torch.randint(0, 37, (2, 8), device=DEVICE)
    cases = [
        (ids.float(), {}, "input_ids must be"),
        (ids[0], {}, "input_ids must be"),
        (
            torch.zeros(1, 17, dtype=torch.long, device=DEVICE),
            {},
            "input_ids has 17 positions; max_position_embeddings",
        ),
        (_with(ids, (1, 3), 37), {}, r"input_ids 37 at \(1, 3\) is outside the vocabulary \[0, 37\)"),
        (_with(ids, (0, 0), -1), {}, "input_ids -1 at"),
        (ids, {"labels": ids[:, :4]}, "labels must be shaped like"),
        (ids, {"labels": torch.full_like(ids, 200)}, "labels 200 at"),
        (ids, {"labels": ids.float()}, "labels must be int64"),
        (ids, {"attention_mask": torch.ones(2, 9, device=DEVICE)}, "attention_mask must be shaped like"),
        (ids, {"position_ids": torch.arange(9, device=DEVICE)[None]}, "position_ids must be"),
        (ids, {"position_ids": torch.arange(8.0, device=DEVICE)[None]}, "position_ids must be"),
        (ids, {"position_ids": torch.arange(8, device=DEVICE)[None] + 9}, r"position_ids 16 at \(0, 7\) is outside"),
    ]
    for input_ids, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            model(input_ids, **kwargs, check_ids=True)
    assert torch.isfinite(model(ids, labels=_with(torch.full_like(ids, -100), (0, 3), 5)).loss)  # -100 is fine


def test_ids_are_checked_only_on_the_cpu_by_default():
    model = Llama(LlamaConfig(**TINY), device="meta")
    ids = torch.randint(0, 37, (2, 8)).to("meta")
    model._check_inputs(ids, None, None, check_ids=None)  # reading meta ids would raise


@pytest.mark.parametrize("norm_in_epilogue", [False, True])
@pytest.mark.parametrize("padding", [True, False])  # GQA: k/v repeated for the mask, or enable_gqa
def test_torch_compile_fullgraph_of_forward_and_loss(padding, norm_in_epilogue):
    fused, _ = twins()
    _norm_in_epilogue(fused, norm_in_epilogue)
    ids, labels, mask = batch(TINY["vocab_size"], padding=padding)

    def step(input_ids):
        return fused(input_ids, labels=labels, attention_mask=mask).loss

    compiled = torch.compile(step, fullgraph=True, backend="inductor" if DEVICE == "cuda" else "aot_eager")
    loss = compiled(ids)
    grads = torch.autograd.grad(loss, list(fused.parameters()))
    ref_loss = step(ids)
    ref_grads = torch.autograd.grad(ref_loss, list(fused.parameters()))
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grads, ref_grads)


# --- the layers -------------------------------------------------------------------------


def _hf_rotary():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    return llama


def test_rotary_cos_sin_and_rope_match_hugging_face():
    llama = _hf_rotary()
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    rotary = llama.LlamaRotaryEmbedding(config)
    positions = torch.tensor([[0, 1, 2, 3, 4, 1000], [5, 6, 7, 8, 9, 10]])
    x = torch.randn(2, 3, 6, 16)
    hf_cos, hf_sin = rotary(x, positions)
    cos, sin = rotary_cos_sin(positions, 16, 500000.0, x.dtype)
    torch.testing.assert_close(cos, hf_cos)
    torch.testing.assert_close(sin, hf_sin)
    q, k = llama.apply_rotary_pos_emb(x, x * 2, hf_cos, hf_sin)
    torch.testing.assert_close(rope_torch(x, cos, sin), q)
    one_cos, one_sin = rotary_cos_sin(positions[0], 16, 500000.0, x.dtype)  # [seq, head_dim] broadcasts
    torch.testing.assert_close(rope_torch(x, one_cos, one_sin)[0], q[0])


def test_interleaved_rope_is_the_complex_rotation_of_pairs():
    """GPT-J / Meta's LLaMA reference: (x[2i] + i x[2i+1]) * exp(i * angle_i)."""
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    angles = torch.arange(5, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, 8, 2) / 8)
    cos, sin = (f(angles).repeat_interleave(2, dim=-1) for f in (torch.cos, torch.sin))  # GPT-J's layout
    expected = torch.view_as_real(
        torch.view_as_complex(x.unflatten(-1, (4, 2)).contiguous()) * torch.polar(torch.ones_like(angles), angles)
    ).flatten(-2)
    torch.testing.assert_close(rope_torch(x, cos, sin, interleaved=True), expected)


def test_rope_qkv_contract():
    batch_size, seq, heads, kv_heads, head_dim = 2, 5, 4, 2, 8
    qkv = torch.randn(batch_size, seq, (heads + 2 * kv_heads) * head_dim)
    cos, sin = rotary_cos_sin(torch.arange(seq), head_dim, 10000.0, qkv.dtype)
    q, k, v = rope_qkv_torch(qkv, cos, sin, heads, kv_heads)
    assert q.shape == (batch_size, heads, seq, head_dim) and q.transpose(1, 2).is_contiguous()
    assert k.shape == v.shape == (batch_size, kv_heads, seq, head_dim) and k.transpose(1, 2).is_contiguous()
    assert v.data_ptr() == qkv.data_ptr() + (heads + kv_heads) * head_dim * qkv.element_size()  # a view
    split = qkv.view(batch_size, seq, heads + 2 * kv_heads, head_dim).transpose(1, 2)
    torch.testing.assert_close(q, rope_torch(split[:, :heads], cos, sin))
    torch.testing.assert_close(k, rope_torch(split[:, heads : heads + kv_heads], cos, sin))
    torch.testing.assert_close(v, split[:, heads + kv_heads :])
    for args, message in [
        ((qkv, cos, sin, 3, 2), "num_heads=3 must be a positive multiple of num_kv_heads=2"),
        ((qkv[..., :-1], cos, sin, heads, kv_heads), "qkv must be"),
        ((qkv, cos[:4], sin, heads, kv_heads), "cos must be"),
    ]:
        with pytest.raises(ValueError, match=message):
            rope_qkv_torch(*args)


def test_grouped_attention_with_and_without_a_mask_agree(monkeypatch):
    """The masked path repeats k/v for SDPA (as torch < 2.5 does unmasked too), the unmasked
    one uses enable_gqa: the same result."""
    from lstrain.layers import rotary

    torch.manual_seed(0)
    attn = RotaryAttention(32, 4, 2, 8, fused=False)
    x = torch.randn(2, 6, 32)
    cos, sin = rotary_cos_sin(torch.arange(6), 8, 10000.0, x.dtype)
    no_padding = torch.zeros(2, 6, dtype=torch.bool)
    expected = attn(x, cos, sin)
    torch.testing.assert_close(attn(x, cos, sin, no_padding), expected)
    monkeypatch.setattr(rotary, "_SDPA_HAS_GQA", False)
    torch.testing.assert_close(attn(x, cos, sin), expected)


@pytest.mark.parametrize("features", [48, 160])  # a partial pair block only; a whole one and a partial one
def test_swiglu_twin_matches_the_fused_mlp(features):
    torch.manual_seed(0)
    fused = SwiGLU(16, features, fused=True, device=DEVICE)
    plain = SwiGLU(16, features, fused=False, device=DEVICE)
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(2, 3, 16, device=DEVICE)
    assert_all_passed(check_module(fused, plain, x, generator=torch.Generator().manual_seed(0)))
    assert list(plain.state_dict()) == ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]


# --- training ---------------------------------------------------------------------------


def _train(model, batches, steps_device, lr=1e-2):
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for ids in batches:
        loss = model(ids.to(steps_device), labels=ids.to(steps_device)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _counting_batches(steps, batch_size, seq, vocab):
    """A learnable pattern: each sequence counts up from a random start."""
    starts = torch.randint(0, vocab, (steps, batch_size, 1))
    return [(s + torch.arange(seq)) % vocab for s in starts]


def test_loss_curves_match_the_unfused_twin():
    fused, plain = twins(num_hidden_layers=1, vocab_size=17, max_position_embeddings=8)
    torch.manual_seed(1)
    batches = _counting_batches(10, 2, 6, 17)
    ours, theirs = _train(fused, batches, DEVICE, lr=5e-2), _train(plain, batches, DEVICE, lr=5e-2)
    assert theirs[-1] < theirs[0] - 0.5  # it learns (2.80 -> 2.13 on an H200)
    # fp32 either way; on a GPU the kernels' and cuBLAS's dot products round differently
    tolerance = 1e-4 if DEVICE == "cpu" else 2e-3
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert abs(a - b) <= tolerance * abs(b), f"step {step}: fused {a:.6f} vs unfused {b:.6f}"


# --- GPU: bf16 at a small but real shape ------------------------------------------------

MEDIUM = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
}


@pytest.mark.gpu
@pytest.mark.parametrize("padding", [False, True])
def test_loss_and_gradients_match_the_unfused_twin_bf16_on_the_gpu(padding):
    fused, plain = twins(device="cuda", dtype=torch.bfloat16, **MEDIUM)
    ids, labels, mask = batch(MEDIUM["vocab_size"], size=(4, 512), device="cuda", padding=padding)
    comparisons = check_module(
        _Loss(fused, labels, mask), _Loss(plain, labels, mask), ids, generator=torch.Generator().manual_seed(0)
    )
    assert_all_passed(comparisons)


@pytest.mark.gpu
def test_norm_in_epilogue_matches_the_unfused_twin_bf16_on_the_gpu():
    fused, plain = twins(device="cuda", dtype=torch.bfloat16, **MEDIUM)
    _norm_in_epilogue(fused)
    ids, labels, mask = batch(MEDIUM["vocab_size"], size=(4, 512), device="cuda", padding=False)
    comparisons = check_module(
        _Loss(fused, labels, mask), _Loss(plain, labels, mask), ids, generator=torch.Generator().manual_seed(0)
    )
    assert_all_passed(comparisons)


@pytest.mark.gpu
def test_loss_curves_match_the_unfused_twin_bf16_on_the_gpu():
    fused, plain = twins(device="cuda", dtype=torch.bfloat16, **MEDIUM)
    torch.manual_seed(1)
    batches = _counting_batches(200, 8, 256, MEDIUM["vocab_size"])
    ours, theirs = _train(fused, batches, "cuda", lr=1e-3), _train(plain, batches, "cuda", lr=1e-3)
    assert theirs[-1] < theirs[0] - 1.0  # it learns
    # bf16 weights: two equally valid roundings start the same and drift apart over 200 Adam
    # steps; the first steps must agree closely, every 20-step mean within a few percent
    for step, (a, b) in enumerate(zip(ours[:10], theirs[:10], strict=True)):
        assert abs(a - b) <= 2e-2 * abs(b), f"step {step}: fused {a:.4f} vs unfused {b:.4f}"
    for start in range(0, 200, 20):
        a, b = (sum(curve[start : start + 20]) / 20 for curve in (ours, theirs))
        assert abs(a - b) <= 0.05 * b + 0.02, f"steps {start}-{start + 19}: fused {a:.4f} vs unfused {b:.4f}"


@pytest.mark.gpu
def test_torch_compile_fullgraph_on_the_gpu_matches_eager():
    fused, _ = twins(device="cuda", dtype=torch.bfloat16, **MEDIUM)
    ids, labels, mask = batch(MEDIUM["vocab_size"], size=(2, 256), device="cuda")

    def loss_and_grads(forward, i, m):
        fused.zero_grad(set_to_none=True)
        loss = forward(i, labels=labels, attention_mask=m).loss
        loss.backward()
        return loss.detach(), [p.grad.float() for p in fused.parameters()]

    compiled = torch.compile(fused, fullgraph=True)
    for step, m in enumerate((mask, None)):
        i = ids if step == 0 else torch.randint_like(ids, MEDIUM["vocab_size"])
        got, got_grads = loss_and_grads(compiled, i, m)
        expected, grads = loss_and_grads(fused, i, m)
        torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
        for (name, _), a, b in zip(fused.named_parameters(), got_grads, grads, strict=True):
            scale = b.abs().max().item() + 1e-6
            assert (a - b).abs().max().item() <= 2e-2 * scale, name


def test_int32_labels_give_the_int64_loss_in_both_twins():
    fused, plain = twins()
    ids, labels, mask = batch(TINY["vocab_size"])
    for model in (fused, plain):
        expected = model(ids, labels=labels, attention_mask=mask).loss
        torch.testing.assert_close(model(ids, labels=labels.int(), attention_mask=mask).loss, expected)
