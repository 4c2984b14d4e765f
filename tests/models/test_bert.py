"""lstrain.models.bert: the fused model against its plain-torch twin, bad input, convergence."""

import pytest
import torch

from lstrain._backend import record_backends
from lstrain.models import BertConfig, BertForMaskedLM
from lstrain.testing import assert_all_passed, check_module
from tests.conftest import DEVICE, EXPECTED_BACKEND

TINY = {
    "vocab_size": 37,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 48,
    "max_position_embeddings": 16,
    "type_vocab_size": 3,
}
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


class _Loss(torch.nn.Module):
    """The model's loss as a function of input_ids alone, for check_module."""

    def __init__(self, model, labels, attention_mask, token_type_ids):
        super().__init__()
        self.model, self.labels = model, labels
        self.attention_mask, self.token_type_ids = attention_mask, token_type_ids

    def forward(self, input_ids):
        return self.model(input_ids, self.attention_mask, self.token_type_ids, labels=self.labels).loss


def twins(device=DEVICE, dtype=None, **overrides):
    """A fused BertForMaskedLM and its unfused twin with the same weights."""
    config = BertConfig(**{**TINY, **NO_DROPOUT, **overrides})
    torch.manual_seed(0)
    fused = BertForMaskedLM(config, device=device, dtype=dtype)
    plain = BertForMaskedLM(BertConfig(**{**vars(config), "fused": False}), device=device, dtype=dtype)
    plain.load_state_dict(fused.state_dict())
    return fused, plain


def batch(vocab, size=(2, 12), device=DEVICE, padding=True, types=2, masked=0.25):
    """ids, MLM labels (a ``masked`` share kept, the rest -100), a padding mask, token types.

    With padding the last sequence ends in pad tokens (id 0), which must not be labelled.
    """
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(1, vocab, size, generator=generator)
    labels = torch.where(torch.rand(size, generator=generator) < masked, ids, -100)
    labels[0, 1] = ids[0, 1]  # at least one kept label
    mask = None
    if padding:
        mask = torch.ones(size, dtype=torch.long)
        mask[-1, -4:] = 0
        ids[-1, -4:] = 0
        labels[-1, -4:] = -100
    token_types = torch.randint(0, types, size, generator=generator)
    return tuple(None if t is None else t.to(device) for t in (ids, labels, mask, token_types))


@pytest.mark.parametrize("attn_implementation", ["sdpa", "lstrain"])
def test_loss_and_every_gradient_match_the_unfused_twin(attn_implementation):
    # sdpa: padding and three token types in one case (the interpreter's time is the budget);
    # lstrain: no padding, its kernels' case
    fused, plain = twins(attn_implementation=attn_implementation)
    padding = attn_implementation == "sdpa"
    ids, labels, mask, types = batch(TINY["vocab_size"], padding=padding, types=TINY["type_vocab_size"])
    with record_backends() as ran:
        comparisons = check_module(
            _Loss(fused, labels, mask, types),
            _Loss(plain, labels, mask, types),
            ids,
            generator=torch.Generator().manual_seed(0),
        )
    # post-LN: each residual add and its LayerNorm in one kernel (layer_norm: the embeddings' and the head's)
    fused_ops = {"embedding", "layer_norm", "bias_act_dropout", "dropout_add_layer_norm", "linear_cross_entropy"}
    assert {op for op, _ in ran} >= fused_ops
    assert "bias_dropout_residual" not in {op for op, _ in ran}
    assert ("qkv_attention" in {op for op, _ in ran}) == (not padding)
    assert {backend for _, backend in ran} == {EXPECTED_BACKEND}
    assert len(comparisons) == 1 + len(list(fused.parameters()))  # the loss and every parameter
    assert_all_passed(comparisons)


def test_the_pad_row_gets_gradient_only_from_the_tied_decoder():
    # HF's nn.Embedding(padding_idx=0): the lookup of pad tokens trains nothing, the decoder
    # still trains row 0; the fused kernel must do the same
    fused, plain = twins()
    ids, labels, mask, types = batch(TINY["vocab_size"])
    for model in (fused, plain):
        model(ids, mask, types, labels=labels).loss.backward()
    grads = [m.bert["embeddings"]["word_embeddings"].weight.grad[0] for m in (fused, plain)]
    assert grads[1].abs().max() > 0
    torch.testing.assert_close(grads[0], grads[1])
    fused.zero_grad()
    logits = fused(ids, mask, types).logits
    logits[..., 1:].sum().backward()  # row 0 reaches only the pad tokens' lookup now
    assert fused.bert["embeddings"]["word_embeddings"].weight.grad[0].abs().max() == 0


def test_logits_match_the_unfused_twin_with_padding_and_token_types():
    fused, plain = twins()
    ids, _, mask, types = batch(TINY["vocab_size"], types=TINY["type_vocab_size"])
    with torch.no_grad():
        ours, theirs = fused(ids, mask, types), plain(ids, mask, types)
        default_types = fused(ids, mask).logits
    assert ours.loss is None and theirs.loss is None
    torch.testing.assert_close(ours.logits, theirs.logits)
    torch.testing.assert_close(default_types, plain(ids, mask, torch.zeros_like(ids)).logits)
    assert not torch.allclose(default_types, ours.logits)  # the token types count
    # padded keys are not attended: changing the padded tokens changes no other position
    changed = ids.clone()
    changed[-1, -4:] = 5
    with torch.no_grad():
        again = fused(changed, mask, types).logits
    torch.testing.assert_close(again[:, :-4], ours.logits[:, :-4])
    assert fused(ids, labels=ids).logits is None  # the fused loss never builds the logits


def test_loss_is_the_mean_over_the_labelled_positions():
    fused, plain = twins()
    ids, labels, mask, types = batch(TINY["vocab_size"])
    with torch.no_grad():
        logits = plain(ids, mask, types).logits
        keep = labels != -100
        expected = torch.nn.functional.cross_entropy(logits[keep], labels[keep])
        torch.testing.assert_close(fused(ids, mask, types, labels=labels).loss, expected)
        torch.testing.assert_close(plain(ids, mask, types, labels=labels).loss, expected)
        nothing = torch.full_like(ids, -100)  # HF's mean over no positions: NaN
        assert fused(ids, labels=nothing).loss.isnan() and plain(ids, labels=nothing).loss.isnan()


@pytest.mark.parametrize("attn_implementation", ["sdpa", "lstrain"])
def test_dropout_gives_a_finite_loss_that_follows_the_seed(attn_implementation):
    fused, _ = twins(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, attn_implementation=attn_implementation)
    fused.train()
    ids, labels, mask, types = batch(TINY["vocab_size"])
    losses = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        losses.append(fused(ids, mask, types, labels=labels).loss)
    assert all(torch.isfinite(loss) for loss in losses)
    assert losses[0].item() == losses[1].item() and losses[0].item() != losses[2].item()
    losses[2].backward()
    assert all(torch.isfinite(p.grad).all() for p in fused.parameters())


def test_state_dict_names_and_the_tied_decoder():
    fused, plain = twins()
    keys = list(fused.state_dict())
    assert keys == list(plain.state_dict())
    assert keys[:4] == [
        "bert.embeddings.word_embeddings.weight",
        "bert.embeddings.position_embeddings.weight",
        "bert.embeddings.token_type_embeddings.weight",
        "bert.embeddings.LayerNorm.weight",
    ]
    assert "bert.encoder.layer.1.attn.c_attn.weight" in keys and "cls.predictions.transform.LayerNorm.bias" in keys
    assert "cls.predictions.bias" in keys and not any("decoder" in k for k in keys)  # tied: the word table
    assert fused.state_dict()["bert.encoder.layer.0.attn.c_attn.weight"].shape == (96, 32)  # packed q, k, v
    assert fused.bert["embeddings"]["word_embeddings"].weight[0].abs().max() == 0  # HF's init: pad row zero


def test_presets_and_overrides():
    base, large = BertConfig.base(), BertConfig.large()
    assert (base.num_hidden_layers, base.hidden_size, base.intermediate_size) == (12, 768, 3072)
    assert (large.num_hidden_layers, large.hidden_size, large.num_attention_heads, large.intermediate_size) == (
        24,
        1024,
        16,
        4096,
    )
    config = BertConfig.large(fused=False, hidden_dropout_prob=0.0)
    assert (config.num_hidden_layers, config.fused, config.hidden_dropout_prob) == (24, False, 0.0)
    assert (config.attention_probs_dropout_prob, config.vocab_size, config.layer_norm_eps) == (0.1, 30522, 1e-12)
    model = BertForMaskedLM(BertConfig(**{**TINY, "num_hidden_layers": 1}))
    dim, ffn, vocab = 32, 48, 37
    embeddings = (vocab + 16 + 3) * dim + 2 * dim
    layer = 4 * dim * dim + 4 * dim + 2 * dim * ffn + ffn + dim + 4 * dim
    head = dim * dim + dim + 2 * dim + vocab
    assert sum(p.numel() for p in model.parameters()) == embeddings + layer + head


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"hidden_size": 31}, "hidden_size"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"vocab_size": 1.5}, "vocab_size"),
        ({"intermediate_size": -1}, "intermediate_size"),
        ({"type_vocab_size": 0}, "type_vocab_size"),
        ({"max_position_embeddings": True}, "max_position_embeddings"),
        ({"attention_probs_dropout_prob": 1.0}, "attention_probs_dropout_prob"),
        ({"hidden_dropout_prob": -0.1}, "hidden_dropout_prob"),
        ({"layer_norm_eps": 0.0}, "layer_norm_eps"),
        ({"initializer_range": float("inf")}, "initializer_range"),
        ({"pad_token_id": 37}, "pad_token_id"),
        ({"hidden_act": "tanh"}, "hidden_act"),
        ({"fused": 1}, "fused"),
    ],
)
def test_bad_config_fields_are_named(overrides, field):
    with pytest.raises(ValueError, match=f"BertConfig: {field}"):
        BertConfig(**{**TINY, **overrides})


def _with(ids, index, value):
    out = ids.clone()
    out[index] = value
    return out


def test_bad_input_is_named():
    model, _ = twins()
    ids = torch.randint(0, 37, (2, 8), device=DEVICE)
    ones = torch.ones(2, 8, dtype=torch.long, device=DEVICE)
    cases = [
        (ids.float(), {}, "input_ids must be"),
        (ids[0], {}, "input_ids must be"),
        (
            torch.zeros(1, 17, dtype=torch.long, device=DEVICE),
            {},
            "input_ids has 17 positions; max_position_embeddings",
        ),
        (_with(ids, (1, 3), 37), {}, r"input_ids 37 at \(1, 3\) is outside \[0, 37\)"),
        (_with(ids, (0, 0), -1), {}, "input_ids -1 at"),
        (ids, {"attention_mask": torch.ones(2, 9, device=DEVICE)}, "attention_mask must be shaped like"),
        (ids, {"attention_mask": torch.ones(2, 8, 8, device=DEVICE)}, "attention_mask must be shaped like"),
        (ids, {"token_type_ids": ones[:, :4]}, "token_type_ids must be shaped like"),
        (ids, {"token_type_ids": ones.float()}, "token_type_ids must be int64"),
        (ids, {"token_type_ids": _with(ones, (1, 2), 3)}, r"token_type_ids 3 at \(1, 2\) is outside \[0, 3\)"),
        (ids, {"labels": ids[:, :4]}, "labels must be shaped like"),
        (ids, {"labels": torch.full_like(ids, 200)}, "labels 200 at"),
        (ids, {"labels": ids.float()}, "labels must be int64"),
    ]
    for input_ids, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            model(input_ids, **kwargs, check_ids=True)  # the default on CPU tensors only
    assert torch.isfinite(model(ids, labels=_with(torch.full_like(ids, -100), (0, 3), 5)).loss)  # -100 is fine


def test_unchecked_bad_token_types_give_nan_not_a_neighbours_row():
    model, _ = twins()
    ids = torch.randint(0, 37, (2, 8), device=DEVICE)
    types = torch.zeros_like(ids)
    types[1, 2] = 3  # type_vocab_size is 3: row (2, 3) would be position 3's type 0
    with torch.no_grad():
        logits = model(ids, token_type_ids=types, check_ids=False).logits
    assert logits[1].isnan().all()  # attention spreads the NaN over its sequence
    assert torch.isfinite(logits[0]).all()


def test_ids_are_checked_only_on_the_cpu_by_default():
    model = BertForMaskedLM(BertConfig(**TINY), device="meta")  # tensors off the CPU: no host read by default
    ids = torch.randint(0, 37, (2, 8)).to("meta")
    model._check_inputs(ids, None, ids, ids, check_ids=None)  # reading meta ids would raise


def test_torch_compile_fullgraph_of_forward_and_loss():
    # compiled, the fused loss scores every row (no data-dependent gather): the same loss
    # and gradients as the eager model's gathered rows
    fused, _ = twins()
    ids, labels, mask, types = batch(TINY["vocab_size"], types=TINY["type_vocab_size"])

    def step(input_ids):
        return fused(input_ids, mask, types, labels=labels).loss

    compiled = torch.compile(step, fullgraph=True, backend="inductor" if DEVICE == "cuda" else "aot_eager")
    loss = compiled(ids)
    grads = torch.autograd.grad(loss, list(fused.parameters()))
    ref_loss = step(ids)
    ref_grads = torch.autograd.grad(ref_loss, list(fused.parameters()))
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grads, ref_grads)


def _train(model, batches, device, lr=1e-2):
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    losses = []
    for ids, labels in batches:
        loss = model(ids.to(device), labels=labels.to(device)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _masked_counting_batches(steps, batch_size, seq, vocab, labelled=0.5):
    """A learnable MLM task: each sequence counts up from a random start (ids 1..vocab-1);
    a ``labelled`` share of the positions is labelled, a quarter of those hidden behind the
    pad id 0 (to be told from the neighbours), the rest left as they are (to be copied, as
    BERT leaves some chosen tokens unchanged: it makes 20 steps enough to learn)."""
    starts = torch.randint(0, vocab - 1, (steps, batch_size, 1))
    batches = []
    for s in starts:
        ids = 1 + (s + torch.arange(seq)) % (vocab - 1)
        chosen = torch.rand(ids.shape) < labelled
        chosen[:, 0] = True  # at least one label per batch
        hidden = chosen & (torch.rand(ids.shape) < 0.25)
        batches.append((ids.masked_fill(hidden, 0), torch.where(chosen, ids, -100)))
    return batches


def test_loss_curves_match_the_unfused_twin():
    # small tables and few tokens: the interpreter runs a program per token and table row
    fused, plain = twins(num_hidden_layers=1, vocab_size=17, max_position_embeddings=8, type_vocab_size=2)
    torch.manual_seed(1)
    batches = _masked_counting_batches(20, 2, 8, 17)
    ours, theirs = _train(fused, batches, DEVICE, lr=2e-2), _train(plain, batches, DEVICE, lr=2e-2)
    assert sum(theirs[-5:]) < 0.7 * sum(theirs[:5])  # it learns (2.78 -> 1.32 in the mean of five steps)
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: fused {a:.6f} vs unfused {b:.6f}"


LARGE_ISH = {
    "vocab_size": 30522,
    "hidden_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "intermediate_size": 2048,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
}


@pytest.mark.gpu
@pytest.mark.parametrize(("padding", "attn_implementation"), [(False, "sdpa"), (True, "sdpa"), (False, "lstrain")])
def test_loss_and_gradients_match_the_unfused_twin_bf16_on_the_gpu(padding, attn_implementation):
    fused, plain = twins(device="cuda", dtype=torch.bfloat16, attn_implementation=attn_implementation, **LARGE_ISH)
    ids, labels, mask, types = batch(
        LARGE_ISH["vocab_size"], size=(4, 512), device="cuda", padding=padding, masked=0.15
    )
    comparisons = check_module(
        _Loss(fused, labels, mask, types),
        _Loss(plain, labels, mask, types),
        ids,
        generator=torch.Generator().manual_seed(0),
    )
    assert_all_passed(comparisons)


@pytest.mark.gpu
@pytest.mark.parametrize("attn_implementation", ["sdpa", "lstrain"])
def test_loss_curves_match_the_unfused_twin_bf16_on_the_gpu(attn_implementation):
    fused, plain = twins(device="cuda", dtype=torch.bfloat16, attn_implementation=attn_implementation, **LARGE_ISH)
    torch.manual_seed(1)
    batches = _masked_counting_batches(200, 8, 256, LARGE_ISH["vocab_size"], labelled=0.15)
    ours, theirs = _train(fused, batches, "cuda", lr=1e-3), _train(plain, batches, "cuda", lr=1e-3)
    assert sum(theirs[-10:]) / 10 < sum(theirs[:10]) / 10 - 1.0  # it learns (from ln(30522) = 10.3)
    # bf16 weights: two equally valid roundings start the same and then drift apart over
    # 200 Adam steps; the first steps must agree closely, every 20-step mean within a few
    # percent (a wrong gradient departs by far more)
    for step, (a, b) in enumerate(zip(ours[:10], theirs[:10], strict=True)):
        assert abs(a - b) <= 2e-2 * abs(b), f"step {step}: fused {a:.4f} vs unfused {b:.4f}"
    for start in range(0, 200, 20):
        a, b = (sum(curve[start : start + 20]) / 20 for curve in (ours, theirs))
        assert abs(a - b) <= 0.05 * b + 0.05, f"steps {start}-{start + 19}: fused {a:.4f} vs unfused {b:.4f}"


def _fixed_positions(labels, predictions=6):
    """``labels``' labelled positions as original BERT's fixed-size masked_positions and
    their labels, padded with position 0 and label -100."""
    positions = torch.zeros(labels.shape[0], predictions, dtype=torch.long, device=labels.device)
    masked = torch.full_like(positions, -100)
    for row in range(labels.shape[0]):
        where = (labels[row] != -100).nonzero().squeeze(1)[:predictions]
        positions[row, : len(where)], masked[row, : len(where)] = where, labels[row, where]
    return positions, masked


def test_masked_positions_give_the_labels_loss_and_gradients():
    # the static-shape gather (capturable) against the labels path, in both twins
    fused, plain = twins()
    ids, labels, mask, types = batch(TINY["vocab_size"], types=TINY["type_vocab_size"])
    positions, masked = _fixed_positions(labels)
    assert (masked == -100).any()  # padding slots take part
    results = []
    for model, kwargs in (
        (plain, {"labels": labels}),
        (fused, {"labels": masked, "masked_positions": positions}),
        (plain, {"labels": masked, "masked_positions": positions}),
    ):
        model.zero_grad()
        loss = model(ids, mask, types, **kwargs).loss
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (expected, expected_grads), *others = results
    for loss, grads in others:
        torch.testing.assert_close(loss, expected)
        torch.testing.assert_close(grads, expected_grads)
    logits = plain(ids, mask, types, labels=masked, masked_positions=positions).logits
    assert logits.shape == (*positions.shape, TINY["vocab_size"])  # the gathered rows' logits only
    assert fused(ids, labels=masked, masked_positions=positions).logits is None


def test_bad_masked_positions_are_named():
    model, _ = twins()
    ids = torch.randint(1, 37, (2, 8), device=DEVICE)
    positions = torch.tensor([[1, 2, 0], [3, 4, 0]], device=DEVICE)
    labels = torch.tensor([[5, 6, -100], [7, 8, -100]], device=DEVICE)
    cases = [
        ({"masked_positions": positions[0], "labels": labels}, r"masked_positions must be \[batch, predictions\]"),
        ({"masked_positions": positions.float(), "labels": labels}, "masked_positions must be"),
        ({"masked_positions": positions[:1], "labels": labels[:1]}, "masked_positions has batch 1, input_ids 2"),
        ({"masked_positions": positions}, "masked_positions needs labels"),
        ({"masked_positions": positions, "labels": labels[:, :2]}, "labels must be shaped like masked_positions"),
        ({"masked_positions": positions + 6, "labels": labels}, r"masked_positions 8 at \(0, 1\) is outside \[0, 8\)"),
        ({"masked_positions": positions, "labels": labels + 40}, r"labels 45 at \(0, 0\) is outside \[0, 37\)"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            model(ids, **kwargs, check_ids=True)


@pytest.mark.gpu
def test_masked_positions_capture_in_a_cuda_graph_and_labels_alone_do_not():
    """The fixed-size path is one captured training step, replayed with the eager step's
    losses; the labels-only path's nonzero is refused as a host sync."""
    from lstrain.optim import FusedAdamW
    from lstrain.train import CapturedStep, CaptureError

    config = {**LARGE_ISH, "num_hidden_layers": 2, "max_position_embeddings": 128}
    generator = torch.Generator("cuda").manual_seed(3)
    steps = []
    for _ in range(4):
        ids = torch.randint(3, config["vocab_size"], (4, 128), device="cuda", generator=generator)
        positions = torch.sort(torch.randperm(128, device="cuda", generator=generator)[:20]).values.repeat(4, 1)
        masked = ids.gather(1, positions)
        masked[:, -2:] = -100  # padding slots
        steps.append((ids, positions, masked))

    def setup(fixed):
        fused, _ = twins(device="cuda", dtype=torch.bfloat16, **config)
        opt = FusedAdamW(fused.parameters(), lr=1e-3, max_grad_norm=1.0)

        def step(ids, positions, masked):
            opt.zero_grad()
            if fixed:
                loss = fused(ids, labels=masked, masked_positions=positions).loss
            else:
                labels = torch.full_like(ids, -100).scatter(1, positions, masked)
                loss = fused(ids, labels=labels).loss
            loss.backward()
            opt.step()
            return loss.detach()

        return fused, opt, step

    model, opt, eager = setup(True)
    expected = torch.stack([eager(*s) for s in steps])
    model, opt, step = setup(True)
    captured = CapturedStep(step, restore=(model, opt))
    got = torch.stack([captured(*s) for s in steps])
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
    model, opt, step = setup(False)
    with pytest.raises(CaptureError, match="synchronises with the host"):
        CapturedStep(step, restore=(model, opt))(*steps[0])


def test_int32_labels_give_the_int64_loss_in_both_twins():
    fused, plain = twins()
    ids, labels, mask, types = batch(TINY["vocab_size"], types=TINY["type_vocab_size"])
    positions, masked = _fixed_positions(labels)
    for model in (fused, plain):
        for kwargs in ({"labels": labels}, {"labels": masked, "masked_positions": positions}):
            expected = model(ids, mask, types, **kwargs).loss
            int32 = {**kwargs, "labels": kwargs["labels"].int()}
            torch.testing.assert_close(model(ids, mask, types, **int32).loss, expected)
