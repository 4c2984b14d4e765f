"""A tiny causal language model trained with lstrain's ops and with plain PyTorch:
the two loss curves must agree step by step."""

import torch

import lstrain
from lstrain.ops import attention_softmax, linear_cross_entropy
from tests.conftest import DEVICE


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int, dim: int, layer_norm: type[torch.nn.Module]) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.norm1 = layer_norm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)
        self.norm2 = layer_norm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def hidden(self, tokens: torch.Tensor, softmax) -> torch.Tensor:
        x = self.embed(tokens)
        q, k, v = self.qkv(self.norm1(x)).unsqueeze(1).chunk(3, dim=-1)  # one head
        probs = softmax(q @ k.transpose(-1, -2))
        x = x + self.out((probs @ v).squeeze(1))
        return self.norm2(x)


def _torch_softmax(scores: torch.Tensor) -> torch.Tensor:
    causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
    return torch.softmax((scores * scores.shape[-1] ** -0.5).masked_fill(causal, float("-inf")), dim=-1)


def _train(model: TinyLM, batches, ours: bool) -> list[float]:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for tokens in batches:
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        if ours:
            hidden = model.hidden(inputs, lambda s: attention_softmax(s, scale=s.shape[-1] ** -0.5, causal=True))
            loss = linear_cross_entropy(
                hidden.reshape(-1, hidden.shape[-1]), model.head.weight, labels.reshape(-1), label_smoothing=0.1
            )
        else:
            hidden = model.hidden(inputs, _torch_softmax)
            logits = model.head(hidden)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.reshape(-1), label_smoothing=0.1)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_loss_curves_match():
    torch.manual_seed(0)
    vocab, dim, seq = 40, 32, 17
    reference = TinyLM(vocab, dim, torch.nn.LayerNorm).to(DEVICE)
    model = TinyLM(vocab, dim, lstrain.nn.LayerNorm).to(DEVICE)
    model.load_state_dict(reference.state_dict())
    # A learnable pattern: each sequence counts up from a random start.
    starts = torch.randint(0, vocab, (12, 4, 1))
    batches = [((s + torch.arange(seq)) % vocab).to(DEVICE) for s in starts]
    ours = _train(model, batches, ours=True)
    theirs = _train(reference, batches, ours=False)
    assert theirs[-1] < 0.6 * theirs[0]  # it learns
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: lstrain {a:.6f} vs torch {b:.6f}"
