"""lstrain.train.CapturedStep: whole training steps replayed from one CUDA graph.

The GPU tests compare captured steps with the same steps taken eagerly, at several model
sizes and tensor counts (GPT-2 small's shapes among them), with the lr changing every
step, dropout, and an fp16 loss scaler that skips steps; and check the errors for what a
graph cannot hold.
"""

import math

import pytest
import torch

from lstrain.models import GPT2, GPT2Config
from lstrain.optim import FusedAdamW, LossScaler
from lstrain.train import CapturedStep, CaptureError

gpu = pytest.mark.gpu


class _Stateless:
    pass


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="warmup must be an int >= 1"):
        CapturedStep(lambda: None, restore=(), warmup=0)
    with pytest.raises(ValueError, match="check_sync must be a bool, got 'no'"):
        CapturedStep(lambda: None, restore=(), check_sync="no")
    with pytest.raises(ValueError, match="restore holds a _Stateless"):
        CapturedStep(lambda: None, restore=(_Stateless(),))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_without_cuda_the_first_call_says_so():
    step = CapturedStep(lambda x: x, restore=())
    with pytest.raises(RuntimeError, match="need a CUDA device"):
        step(torch.zeros(2))


def _setup(config: GPT2Config, dtype: torch.dtype, seed: int = 0, lr: float = 1e-3, **optimizer_options):
    torch.manual_seed(seed)
    model = GPT2(config).to("cuda", dtype).train()
    opt = FusedAdamW(model.parameters(), lr=lr, weight_decay=0.1, max_grad_norm=1.0, **optimizer_options)

    def step(input_ids, labels):
        opt.zero_grad()
        loss = model(input_ids, labels=labels).loss
        loss.backward()
        opt.step()
        return loss.detach()

    return model, opt, step


def _batches(config: GPT2Config, count: int, batch: int, seq: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator("cuda").manual_seed(1)
    out = []
    for _ in range(count):
        ids = torch.randint(0, config.vocab_size, (batch, seq), device="cuda", generator=generator)
        out.append((ids, ids.clone()))
    return out


def _lr(step: int) -> float:
    return 1e-3 * (0.5 + 0.5 * math.cos(step / 3))  # a schedule that moves every step


SIZES = {
    "2x64": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128),
    "2x64 qkv_attention": dict(
        n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128, attn_implementation="lstrain"
    ),
    "24x64 (292 tensors)": dict(n_layer=24, n_embd=64, n_head=2, vocab_size=777, n_positions=128),
    "gpt2-small shapes": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024),
}


PRECISIONS = {  # parameter dtype, optimizer options
    "fp32": (torch.float32, {}),
    "bf16": (torch.bfloat16, {}),
    "bf16 rounded, no masters": (torch.bfloat16, {"master_weights": False, "state_dtype": torch.bfloat16}),
}


@gpu
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("size", list(SIZES))
def test_captured_steps_are_the_eager_steps(size, precision):
    """Six steps captured and six taken eagerly from the same start give the same losses
    and weights: the warm-up is undone, each replay sees its batch and its new lr (and,
    rounding stochastically, the random numbers of its step count)."""
    dtype, options = PRECISIONS[precision]
    config = GPT2Config(**SIZES[size], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    batches = _batches(config, 6, 2, 128)
    model, opt, eager_step = _setup(config, dtype, **options)
    twin, twin_opt, twin_step = _setup(config, dtype, **options)
    captured = CapturedStep(twin_step, restore=(twin, twin_opt))
    expected, got = [], []
    for number, batch in enumerate(batches):
        for optimizer in (opt, twin_opt):
            optimizer.param_groups[0]["lr"] = _lr(number)
        expected.append(eager_step(*batch))
        got.append(captured(*batch))
    assert captured.captured
    got, expected = torch.stack(got), torch.stack(expected)
    assert torch.isfinite(got).all(), got
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, expected, **tolerance)
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, **tolerance, msg=lambda m, name=name: f"{name}: {m}")
    steps = {float(s["step"]) for s in twin_opt.state_dict()["state"].values()}
    assert steps == {6.0}, "the warm-up steps were not undone"


@gpu
@pytest.mark.parametrize("size", ["2x64", "2x64 qkv_attention"])
def test_dropout_draws_fresh_masks_per_replay_and_is_seeded(size):
    config = GPT2Config(**SIZES[size])
    (batch,) = _batches(config, 1, 2, 64)

    def losses(seed):
        model, opt, step = _setup(config, torch.float32, seed=seed, lr=0.0)  # lr 0: only the masks move
        captured = CapturedStep(step, restore=(model, opt))
        torch.manual_seed(seed)
        return torch.stack([captured(*batch) for _ in range(4)])

    first, again = losses(0), losses(0)
    assert torch.isfinite(first).all()
    assert len(set(first.tolist())) == 4, f"the same dropout mask replayed: {first}"
    torch.testing.assert_close(first, again, rtol=0, atol=0)


@gpu
def test_a_loss_scaler_skips_overflowing_steps_inside_the_graph():
    """fp16 with a scale that overflows at first: the captured steps skip and back off
    exactly as the eager ones."""
    config = GPT2Config(**SIZES["2x64"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    batches = _batches(config, 5, 2, 64)

    def run(capture):
        model, opt, _ = _setup(config, torch.float16)
        scaler = LossScaler(init_scale=2.0**30, growth_interval=2)

        def step(input_ids, labels):
            opt.zero_grad()
            loss = model(input_ids, labels=labels).loss
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return loss.detach(), scaler.get_scale().clone()

        if capture:
            step = CapturedStep(step, restore=(model, opt, scaler))
        out = [step(*batch) for batch in batches]
        return torch.stack([loss for loss, _ in out]), [float(scale) for _, scale in out], model

    eager_losses, eager_scales, eager_model = run(False)
    losses, scales, model = run(True)
    assert eager_scales[0] < 2.0**30, "the test's scale did not overflow"
    assert scales == eager_scales
    torch.testing.assert_close(losses, eager_losses, rtol=1e-3, atol=1e-3)
    for a, b in zip(eager_model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-3)


@gpu
def test_a_host_sync_in_the_step_is_a_capture_error():
    config = GPT2Config(**SIZES["2x64"])
    model, opt, step = _setup(config, torch.float32)

    def syncing(input_ids, labels):
        loss = step(input_ids, labels)
        if loss.item() > 1e9:  # a host read
            raise AssertionError
        return loss

    (batch,) = _batches(config, 1, 2, 64)
    with pytest.raises(CaptureError, match="synchronises with the host"):
        CapturedStep(syncing, restore=(model, opt))(*batch)


@gpu
def test_a_host_check_skipped_under_capture_captures():
    """Code that reads the device only outside a capture (Hugging Face's mask builders ask
    ``is_current_stream_capturing``) is refused by the sync check, and with
    ``check_sync=False`` captured, replaying as eager steps run."""
    config = GPT2Config(**SIZES["2x64"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    batches = _batches(config, 3, 2, 64)
    losses = []
    for captured in (False, True):
        model, opt, step = _setup(config, torch.float32)

        def checking(input_ids, labels, step=step):
            if not torch.cuda.is_current_stream_capturing() and bool((input_ids < 0).any()):
                raise AssertionError("negative token ids")
            return step(input_ids, labels)

        if captured:
            with pytest.raises(CaptureError, match="pass check_sync=False"):
                CapturedStep(checking, restore=(model, opt))(*batches[0])
        run = CapturedStep(checking, restore=(model, opt), check_sync=False) if captured else checking
        losses.append(torch.stack([run(*batch) for batch in batches]))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)


@gpu
def test_a_new_shape_or_structure_is_a_capture_error():
    config = GPT2Config(**SIZES["2x64"])
    model, opt, step = _setup(config, torch.float32)
    captured = CapturedStep(step, restore=(model, opt))
    (batch,) = _batches(config, 1, 2, 64)
    captured(*batch)
    short = batch[0][:, :32]
    with pytest.raises(CaptureError, match=r"batch\[0\] has shape \(2, 32\).*\(2, 64\)"):
        captured(short, short)
    with pytest.raises(CaptureError, match="structure changed"):
        captured(batch[0])
    captured(*batch)  # still replays after refusing


@gpu
def test_rebuilt_optimizer_buffers_are_a_capture_error():
    config = GPT2Config(**SIZES["2x64"])
    model, opt, step = _setup(config, torch.float32)
    captured = CapturedStep(step, restore=(model, opt))
    (batch,) = _batches(config, 1, 2, 64)
    captured(*batch)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(8, device="cuda"))]})
    with pytest.raises(CaptureError, match="flat buffers were rebuilt"):
        captured(*batch)


@gpu
def test_a_torch_optimizer_float_lr_change_is_a_capture_error():
    model = torch.nn.Linear(8, 8, device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)

    def step(x):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    captured = CapturedStep(step, restore=(model, opt))
    x = torch.randn(4, 8, device="cuda")
    captured(x)
    captured(x)
    opt.param_groups[0]["lr"] = 5e-4
    with pytest.raises(CaptureError, match="lr changed from 0.001 to 0.0005"):
        captured(x)
