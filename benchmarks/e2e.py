"""Whole training steps side by side: what judges the toolkit.

    python -m benchmarks.e2e                                     # both GPT-2 workloads, every variant
    python -m benchmarks.e2e --workload gpt2-medium --out bench-out/e2e-medium
    python -m benchmarks.e2e --workload gpt2-small --variant lstrain-eager --variant torch-compile
    python -m benchmarks.e2e --workload llama-0.75b --workload bert-large   # the LLaMA and BERT workloads
    python -m benchmarks.e2e --workload llama-0.75b --rounds 3   # each variant 3 times, alternating order
    python -m benchmarks.e2e --workload gpt2-medium --profile lstrain-eager   # per-kernel table of one step
    python -m benchmarks.e2e --workload tiny                     # the CPU smoke run (Triton interpreter)
    python -m benchmarks.report bench-out/results.json --e2e bench-out/e2e.json

A step is forward, backward, the gradient clip at norm 1.0 and an AdamW update (lr 1e-4,
weight decay 0.1 on matrices, none on biases and norms), on random tokens from a fixed
seed (the same batches for every variant; labels are the inputs, shifted inside the model
as in Hugging Face, or for BERT the tokens at 15% of the positions). The workloads
(``WORKLOADS``) name a model family: GPT-2, LLaMA or BERT. The variants (``VARIANTS``):

  * ``torch-eager`` / ``torch-compile``: lstrain's ``fused=False`` model of the family
    (plain torch ops), as a careful PyTorch user runs it: fp32 parameters, bf16 autocast
    (bf16 parameters where the workload says ``torch_bf16_params``), ``torch.optim.AdamW(
    fused=True)``, ``clip_grad_norm_``; the second under ``torch.compile(model)``;
  * ``hf-eager`` / ``hf-compile``: transformers' model of the family (``attn_implementation=
    "sdpa"``, random init from a config), set up the same way; ``hf-liger`` the same with
    Liger-Kernel's patch for the family, where Liger has one (else a row says why it was
    skipped); ``lstrain-patch`` the same with ``lstrain.patch(model)``, and
    ``lstrain-patch-captured`` the patched model on lstrain's optimizer with the step in one
    CUDA graph, as ``lstrain-captured``; ``lstrain-patch-captured-sr`` the same without master
    weights;
  * ``lstrain-eager``: lstrain's model (``fused=True``) with bf16 parameters and
    ``lstrain.optim.FusedAdamW(max_grad_norm=1.0)`` (fp32 master weights; the gradients
    autograd's own tensors, ``flat_grads=False``, freed by ``zero_grad(set_to_none=True)``);
    ``lstrain-captured``: the same step replayed from one CUDA graph
    (``lstrain.train.CapturedStep``); ``lstrain-compile``: the same under
    ``torch.compile(model)``; ``lstrain-captured-sr``: captured, ``FusedAdamW(master_weights=
    False, state_dtype=torch.bfloat16)`` (bf16 weights and moments rounded stochastically: 8
    bytes of weight, gradient and state per parameter, HF + Liger's bf16 AdamW's budget).

Each variant runs in its own process (this module with ``--child``), so that one variant's
memory, compiled code and CUDA state cannot touch another's figures, and a crash or a hang
costs only its own row: the parent waits ``--timeout`` seconds per variant, then kills the
child's process group and records an error row naming the phase it was in. A child's
output goes to ``<out>/logs/<workload>.<variant>.log``; its last line is its row as JSON.
With ``--rounds N`` every variant runs N times, the order reversed every other round (so
that neither end of a round's thermal or clock drift falls on one variant), each run in
its own process (logs ``<workload>.<variant>.r<i>.log``); a variant's row is its run of
median tokens/s, with ``rounds_tokens_per_s`` listing every run's (None where one failed).

Per variant: ``ms_per_step``, the median over ``--steps`` timed steps after ``--warmup``
warm-up steps, from CUDA events recorded between steps (the launch queue is never drained,
so host time counts only where the GPU waits for it); tokens/s from that median; the mean
wall time over the timed steps beside it; ``peak_gib``, ``torch.cuda.max_memory_allocated``
from the end of model and optimizer construction (warm-up and capture included); MFU, the
model's FLOPs per token (``6 N + 12 L T D``, N the non-embedding parameters plus the LM head)
times tokens/s over the bf16 GEMM rate measured by the parent in the same run (an 8192^3
``torch.matmul``, ~790 TFLOP/s on an H200); ``compile_s``, the first step's wall time
(torch.compile, Triton's JIT, the CUDA-graph capture), apart from the step time; the first and
final losses (sane: finite and within 1 of ln V, uniform random tokens being unlearnable).

Wall time on one H200, as measured (the runs in ``benchmarks/results/e2e*.json``): 15-35 s per
eager or captured variant and 60-100 s per compiled one (its first step, torch.compile, 40-50
s), nearly all of it process start-up, model construction and compilation; the timed steps
take seconds. GPT-2 medium's five variants took 237 s in one command, LLaMA-0.75B's four
131 s. A workload per command fits 10 minutes even with one variant running into the timeout
(``--timeout``, 240 s).

``--profile VARIANT`` runs that variant alone and writes torch.profiler's tables of one more
step after the timed ones to ``<out>/profile-<workload>-<variant>.txt``: the top 40 kernels by
GPU time (with their share of the step), then torch's operator table; it writes no e2e.json.

Writes ``<out>/e2e.json`` after every variant: ``{"format": 1, "meta": {...}, "rows": [...]}``,
the fields in ``run_meta``, ``Workload.describe`` and ``child_row``/``run_variant``.

Without CUDA only ``torch-eager`` and ``lstrain-eager`` run (the others are rows "skipped:
needs CUDA"), in fp32 on the ``tiny`` workload, lstrain's kernels through the Triton
interpreter (the parent sets ``TRITON_INTERPRET=1`` for the children): a check that the
harness works end to end, not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from itertools import pairwise
from pathlib import Path

import torch

FORMAT = 1  # e2e.json's layout version
SEED = 1234
LR = 1e-4
WEIGHT_DECAY = 0.1
MAX_NORM = 1.0
CAPTURE_WARMUP = 3  # eager steps on a side stream before a capture, as torch's CUDA-graph docs do
LOSS_TOLERANCE = 1.0  # nats a sane loss may sit from ln(V) on uniform random tokens
DEFAULT_TIMEOUT_S = 240.0
ROW_PREFIX = "E2E_ROW "
PHASE_PREFIX = "E2E_PHASE "
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Workload:
    """One model and batch: a model family and shape, its batch, precision, step counts
    and targets.

    ``family`` picks the models (``gpt2``: lstrain's GPT2 / HF GPT2LMHeadModel; ``llama``:
    lstrain's Llama / HF LlamaForCausalLM, untied head; ``bert``: lstrain's / HF's
    BertForMaskedLM, ``masked`` of the tokens labelled). The shape is given in GPT-2's
    terms (``n_layer``, ``n_embd``, ``n_head``; ``n_kv_head`` and ``n_inner`` where the
    family has them); ``config_fields`` spells it in the family's HF config names, so that
    lstrain's and Hugging Face's models get the same one. ``torch_bf16_params``: the torch
    and HF variants hold bf16 parameters (no autocast, no master weights), as the issue's
    anchors measured them where fp32 parameters would not fit the memory target. Targets
    are None where the issue sets none: ``target_tokens_per_s`` (lstrain's best variant),
    ``target_speedup`` (lstrain's best over the best competitor's tokens/s) and
    ``target_peak_vs`` (a variant whose peak memory lstrain's best must not exceed);
    ``target_peak_gib`` bounds lstrain's best peak memory outright.
    """

    name: str
    title: str
    preset: str
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    seq: int
    batch: int
    dropout: float
    bf16: bool  # False: fp32 throughout, no autocast (the CPU smoke workload)
    warmup: int
    steps: int
    target_tokens_per_s: float | None = None
    target_speedup: float | None = None
    target_peak_vs: str | None = None
    family: str = "gpt2"
    n_kv_head: int | None = None
    n_inner: int | None = None
    masked: float = 0.0
    torch_bf16_params: bool = False
    target_peak_gib: float | None = None
    # what computes lstrain's GPT-2 and BERT attention (their configs' attn_implementation)
    attn_implementation: str = "sdpa"

    @property
    def tokens_per_step(self) -> int:
        """Tokens in one step's batch."""
        return self.batch * self.seq

    @property
    def flop_params(self) -> int:
        """N of ``6 N``: the non-embedding parameters plus the LM head's ``V x D`` (a GEMM,
        tied or not); BERT's MLM head runs on the masked rows only and is counted in
        ``flops_per_token`` instead. ``lstrain train``'s count (its family table)."""
        return self._family.flop_params(self.model_config())

    @property
    def ffn(self) -> int:
        """The MLP's inner width."""
        return self.n_inner or 4 * self.n_embd

    @property
    def predictions(self) -> int:
        """Masked positions per sequence of an MLM workload (BERT's ``max_predictions_per_seq``)."""
        return round(self.masked * self.seq)

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per token: ``6 N + 12 L T D``, plus BERT's MLM head on its masked
        rows (``lstrain.train.families.Family.flops_per_token``)."""
        return self._family.flops_per_token(self.model_config(), self.seq, self.predictions / self.seq)

    @property
    def _family(self):
        from lstrain.train.families import FAMILIES

        return FAMILIES[self.family]

    def model_config(self):
        """lstrain's config of the workload's model (its family's Config dataclass)."""
        return self._family.config_cls(**self.config_fields())

    def config_fields(self) -> dict:
        """The model's fields under the family's Hugging Face config names (lstrain's are the same)."""
        if self.family == "llama":
            return {
                "vocab_size": self.vocab_size,
                "hidden_size": self.n_embd,
                "intermediate_size": self.ffn,
                "num_hidden_layers": self.n_layer,
                "num_attention_heads": self.n_head,
                "num_key_value_heads": self.n_kv_head or self.n_head,
                "max_position_embeddings": self.seq,
                "tie_word_embeddings": False,
            }
        if self.family == "bert":
            return {
                "vocab_size": self.vocab_size,
                "hidden_size": self.n_embd,
                "intermediate_size": self.ffn,
                "num_hidden_layers": self.n_layer,
                "num_attention_heads": self.n_head,
                "max_position_embeddings": self.seq,
                "hidden_dropout_prob": self.dropout,
                "attention_probs_dropout_prob": self.dropout,
            }
        return {
            "vocab_size": self.vocab_size,
            "n_positions": self.seq,
            "n_embd": self.n_embd,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "resid_pdrop": self.dropout,
            "embd_pdrop": self.dropout,
            "attn_pdrop": self.dropout,
        }

    def describe(self, warmup: int, steps: int) -> dict:
        """The workload as e2e.json's ``meta["workloads"][name]`` records it.

        Args:
            warmup: warm-up steps of this run.
            steps: timed steps of this run.

        Returns:
            Every field of the workload (``warmup`` and ``steps`` those of the run), plus
            ``tokens_per_step``, ``flop_params`` and ``flops_per_token``.
        """
        return asdict(self) | {
            "warmup": warmup,
            "steps": steps,
            "tokens_per_step": self.tokens_per_step,
            "flop_params": self.flop_params,
            "flops_per_token": self.flops_per_token,
        }


WORKLOADS = {
    w.name: w
    for w in (
        Workload(
            "gpt2-medium", "GPT-2 medium (24 x 1024, 16 heads, V 50257), batch 8 x 1024, dropout 0.1, bf16",
            "medium", n_layer=24, n_embd=1024, n_head=16, vocab_size=50257, seq=1024, batch=8, dropout=0.1,
            bf16=True, warmup=10, steps=20, target_tokens_per_s=200e3, target_speedup=1.25,
            target_peak_vs="torch-compile",
        ),
        Workload(
            "gpt2-small", "GPT-2 small (12 x 768, 12 heads, V 50257), batch 16 x 1024, dropout 0.1, bf16",
            "small", n_layer=12, n_embd=768, n_head=12, vocab_size=50257, seq=1024, batch=16, dropout=0.1,
            bf16=True, warmup=10, steps=20, target_speedup=1.25,
        ),
        Workload(
            "llama-0.75b",
            "LLaMA-style 0.75B (12 x 2048, 16 heads, ff 5632, V 32000, untied head), batch 4 x 2048, bf16 params",
            "llama_0_75b", n_layer=12, n_embd=2048, n_head=16, vocab_size=32000, seq=2048, batch=4, dropout=0.0,
            bf16=True, warmup=10, steps=20, target_tokens_per_s=135e3, family="llama", n_kv_head=16, n_inner=5632,
            torch_bf16_params=True, target_peak_gib=10.0 * 1e9 / 2**30,
        ),
        Workload(
            "bert-large",
            "BERT-large MLM (24 x 1024, 16 heads, V 30522), batch 16 x 512, 15% masked, dropout 0.1, bf16",
            "large", n_layer=24, n_embd=1024, n_head=16, vocab_size=30522, seq=512, batch=16, dropout=0.1,
            bf16=True, warmup=10, steps=20, target_speedup=1.25, family="bert", masked=0.15,
        ),
        Workload(
            "tiny", "tiny GPT-2 (2 x 64, 4 heads, V 1000), batch 2 x 32, dropout 0.1, fp32 (a harness check)",
            "small", n_layer=2, n_embd=64, n_head=4, vocab_size=1000, seq=32, batch=2, dropout=0.1,
            bf16=False, warmup=1, steps=2,
        ),
    )
}  # fmt: skip
DEFAULT_WORKLOADS = ("gpt2-medium", "gpt2-small")


class Skipped(Exception):
    """A variant that cannot run here (raised in the child; its message is the reason)."""


# ----------------------------------------------------------------------------- the variants


def _param_groups(model: torch.nn.Module) -> list[dict]:
    """nanoGPT's groups: weight decay on matrices (embeddings included), none on biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _lstrain_model(workload: Workload, fused: bool) -> torch.nn.Module:
    """lstrain's model of the workload's family (``fused=False``: the plain-torch twin)."""
    if workload.family == "llama":
        from lstrain.models import Llama, LlamaConfig

        return Llama(LlamaConfig(**workload.config_fields(), fused=fused))
    if workload.family == "bert":
        from lstrain.models import BertConfig, BertForMaskedLM

        config = BertConfig(**workload.config_fields(), fused=fused, attn_implementation=workload.attn_implementation)
        return BertForMaskedLM(config)
    from lstrain.models import GPT2, GPT2Config

    preset = getattr(GPT2Config, workload.preset)
    return GPT2(preset(fused=fused, attn_implementation=workload.attn_implementation, **workload.config_fields()))


_HF_FAMILIES = {  # family: (config class, model class) in transformers
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "bert": ("BertConfig", "BertForMaskedLM"),
}


def _hf_model(workload: Workload) -> torch.nn.Module:
    """Hugging Face's model of the workload's family, randomly initialised, SDPA attention."""
    import transformers

    config_class, model_class = (getattr(transformers, name) for name in _HF_FAMILIES[workload.family])
    model = model_class(config_class(**workload.config_fields(), use_cache=False, attn_implementation="sdpa"))
    if model.config._attn_implementation != "sdpa":
        raise RuntimeError(f"transformers gave attention {model.config._attn_implementation!r}, not sdpa")
    return model


def _hf_liger(workload: Workload) -> torch.nn.Module:
    import liger_kernel.transformers as liger

    name = f"apply_liger_kernel_to_{workload.family}"
    patch = getattr(liger, name, None)
    if patch is None:
        version = importlib.metadata.version("liger-kernel")
        raise Skipped(f"Liger-Kernel {version} has no {workload.family} patch (no {name})")
    patch()  # patches transformers' classes, so before the model is built
    return _hf_model(workload)


def _hf_patched(workload: Workload) -> torch.nn.Module:
    import lstrain

    model = _hf_model(workload)
    report = lstrain.patch(model)
    print(report, flush=True)
    return model


StepFn = Callable[..., torch.Tensor]  # step(input_ids, labels, *masked) -> the detached loss


def torch_step(model: torch.nn.Module, workload: Workload, device: torch.device, compiled: bool) -> StepFn:
    """The plain PyTorch user's step: fp32 parameters and bf16 autocast where the workload
    is bf16 (bf16 parameters without autocast where it says ``torch_bf16_params``),
    ``torch.optim.AdamW(fused=True)``, ``clip_grad_norm_``.

    Args:
        model: a model with fp32 parameters whose ``forward(input_ids, labels=...)`` returns
            an object with ``.loss``; moved to ``device`` here.
        workload: the workload (its precision).
        device: where to train.
        compiled: run the forward (and so the backward) through ``torch.compile(model)``.

    Returns:
        ``step(input_ids, labels, *masked) -> loss`` (detached); an MLM batch's ``masked``
        is ignored: torch's and HF's models take the HF-form ``labels``.
    """
    low_params = workload.bf16 and workload.torch_bf16_params
    model.to(device, dtype=torch.bfloat16 if low_params else None).train()
    optimizer = torch.optim.AdamW(_param_groups(model), lr=LR, fused=True)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    forward = torch.compile(model) if compiled else model

    def step(input_ids: torch.Tensor, labels: torch.Tensor, *masked: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=workload.bf16 and not low_params):
            loss = forward(input_ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        optimizer.step()
        return loss.detach()

    return step


def lstrain_step(
    model: torch.nn.Module, workload: Workload, device: torch.device, compiled: bool, rounded: bool = False
) -> StepFn:
    """lstrain's step: parameters in bf16 (fp32 on an fp32 workload), ``FusedAdamW`` with
    the clip inside (fp32 master weights for 16-bit parameters), no autocast.

    Args:
        model: lstrain's model; moved and cast here, before the optimizer flattens it.
        workload: the workload (its precision).
        device: where to train.
        compiled: run the forward through ``torch.compile(model)``.
        rounded: no master weights and bf16 moments, rounded stochastically
            (``FusedAdamW(master_weights=False, state_dtype=torch.bfloat16)``).

    Returns:
        ``step(input_ids, labels, *masked) -> loss`` (detached); an MLM batch's
        ``masked`` (its fixed masked positions and their labels) goes to BERT's
        ``masked_positions`` path.
    """
    from lstrain.optim import FusedAdamW

    model.to(device=device, dtype=torch.bfloat16 if workload.bf16 else torch.float32).train()
    options = {"master_weights": False, "state_dtype": torch.bfloat16} if rounded else {}
    # gradients made as backward frees activations, not a buffer held through forward
    optimizer = FusedAdamW(_param_groups(model), lr=LR, max_grad_norm=MAX_NORM, flat_grads=False, **options)
    forward = torch.compile(model) if compiled else model

    def step(input_ids: torch.Tensor, labels: torch.Tensor, *masked: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        if masked:  # BERT: the fixed-size masked positions (a static shape: capturable)
            positions, masked_labels = masked
            loss = forward(input_ids, labels=masked_labels, masked_positions=positions).loss
        else:
            loss = forward(input_ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


@dataclass(frozen=True)
class Variant:
    """One way to train a workload: how to build its model and step, and what it needs."""

    name: str
    setup: str  # for the report's table
    build_model: Callable[[Workload], torch.nn.Module]
    make_step: Callable[[torch.nn.Module, Workload, torch.device], StepFn]
    needs_cuda: bool
    needs: tuple[str, ...] = ()  # modules it imports beyond torch and lstrain

    def precision(self, workload: Workload) -> str:
        """The parameters' and the compute's precision, for the table."""
        if not workload.bf16:
            return "fp32"
        if self.name in ROUNDED_OPTIMIZER:
            return "bf16 params and moments, stochastic rounding, no master weights"
        if self.name in LSTRAIN_OPTIMIZER:
            return "bf16 params, fp32 master weights"
        return "bf16 params, no master weights" if workload.torch_bf16_params else "fp32 params, bf16 autocast"


def _captured(
    model: torch.nn.Module, workload: Workload, device: torch.device, check_sync: bool = True, rounded: bool = False
) -> StepFn:
    from lstrain.train import CapturedStep

    # restore=(): the warm-up steps may train here, the batches are random
    step = lstrain_step(model, workload, device, compiled=False, rounded=rounded)
    return CapturedStep(step, restore=(), warmup=CAPTURE_WARMUP, check_sync=check_sync)


def _patched_captured(
    model: torch.nn.Module, workload: Workload, device: torch.device, rounded: bool = False
) -> StepFn:
    if workload.family == "bert":
        raise Skipped("HF's BertForMaskedLM takes no fixed masked positions: its loss's row gather is not capturable")
    # HF's mask builders read the device eagerly but not under capture: no sync check
    return _captured(model, workload, device, check_sync=False, rounded=rounded)


# variants on lstrain's optimizer; the rest: torch's AdamW
ROUNDED_OPTIMIZER = ("lstrain-patch-captured-sr", "lstrain-captured-sr")
LSTRAIN_OPTIMIZER = (
    "lstrain-patch-captured",
    "lstrain-eager",
    "lstrain-captured",
    "lstrain-compile",
    *ROUNDED_OPTIMIZER,
)

VARIANTS = {
    v.name: v
    for v in (
        Variant("torch-eager", "lstrain's fused=False twin, torch AdamW(fused) + clip_grad_norm_",
                lambda w: _lstrain_model(w, fused=False), lambda m, w, d: torch_step(m, w, d, compiled=False),
                needs_cuda=False),
        Variant("torch-compile", "the same, torch.compile(model)",
                lambda w: _lstrain_model(w, fused=False), lambda m, w, d: torch_step(m, w, d, compiled=True),
                needs_cuda=True),
        Variant("hf-eager", "HF model (sdpa), torch AdamW(fused) + clip_grad_norm_",
                _hf_model, lambda m, w, d: torch_step(m, w, d, compiled=False),
                needs_cuda=True, needs=("transformers",)),
        Variant("hf-compile", "the same, torch.compile(model)",
                _hf_model, lambda m, w, d: torch_step(m, w, d, compiled=True),
                needs_cuda=True, needs=("transformers",)),
        Variant("hf-liger", "HF model + Liger-Kernel's patch for the family, as hf-eager",
                _hf_liger, lambda m, w, d: torch_step(m, w, d, compiled=False),
                needs_cuda=True, needs=("transformers", "liger_kernel")),
        Variant("lstrain-patch", "HF model + lstrain.patch(model), as hf-eager",
                _hf_patched, lambda m, w, d: torch_step(m, w, d, compiled=False),
                needs_cuda=True, needs=("transformers",)),
        Variant("lstrain-patch-captured", "HF model + lstrain.patch(model), FusedAdamW, the step in one CUDA graph",
                _hf_patched, _patched_captured, needs_cuda=True, needs=("transformers",)),
        Variant("lstrain-patch-captured-sr", "the same, FusedAdamW without master weights, bf16 moments "
                "(stochastic rounding)", _hf_patched, lambda m, w, d: _patched_captured(m, w, d, rounded=True),
                needs_cuda=True, needs=("transformers",)),
        Variant("lstrain-eager", "lstrain's model (fused=True), FusedAdamW(max_grad_norm=1.0)",
                lambda w: _lstrain_model(w, fused=True), lambda m, w, d: lstrain_step(m, w, d, compiled=False),
                needs_cuda=False),
        Variant("lstrain-captured", "the same, the whole step in one CUDA graph",
                lambda w: _lstrain_model(w, fused=True), _captured,
                needs_cuda=True),
        Variant("lstrain-captured-sr", "the same, FusedAdamW without master weights, bf16 moments (stochastic "
                "rounding)", lambda w: _lstrain_model(w, fused=True), lambda m, w, d: _captured(m, w, d, rounded=True),
                needs_cuda=True),
        Variant("lstrain-compile", "the same, torch.compile(model)",
                lambda w: _lstrain_model(w, fused=True), lambda m, w, d: lstrain_step(m, w, d, compiled=True),
                needs_cuda=True),
    )
}  # fmt: skip


def skip_reason(variant: Variant, cuda: bool, importable: Callable[[str], bool]) -> str | None:
    """Why a variant cannot run here, known before starting its process.

    Args:
        variant: the variant.
        cuda: whether a CUDA device is available.
        importable: whether a module can be imported, by name.

    Returns:
        ``"needs CUDA"``, ``"<module> not installed"``, or None where it can run.
    """
    if variant.needs_cuda and not cuda:
        return "needs CUDA"
    missing = [name for name in variant.needs if not importable(name)]
    return f"{', '.join(missing)} not installed" if missing else None


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


# ----------------------------------------------------------------------------- the child: one variant


_current_phase = "start"


def _phase(name: str) -> None:
    """Announce the child's phase in its log, where the parent finds it after a timeout."""
    global _current_phase
    _current_phase = name
    print(PHASE_PREFIX + name, flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class StepClock:
    """Marks between steps: CUDA events on a GPU (no sync between steps), else perf_counter."""

    def __init__(self, device: torch.device, marks: int) -> None:
        self.cuda = device.type == "cuda"
        self.marks = [torch.cuda.Event(enable_timing=True) for _ in range(marks)] if self.cuda else [0.0] * marks

    def mark(self, index: int) -> None:
        """Record mark ``index`` (on the current stream, on a GPU)."""
        if self.cuda:
            self.marks[index].record()
        else:
            self.marks[index] = time.perf_counter()

    def intervals_ms(self) -> list[float]:
        """Milliseconds between consecutive marks (after the device is synchronised)."""
        pairs = list(pairwise(self.marks))
        return [a.elapsed_time(b) for a, b in pairs] if self.cuda else [1e3 * (b - a) for a, b in pairs]


def make_batches(workload: Workload, count: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """``count`` batches of uniform random tokens, the same for every variant (fixed seed).

    Args:
        workload: its batch, sequence length and vocabulary.
        count: how many batches.
        device: where they live (made on the CPU, then moved: the same tokens everywhere).

    Returns:
        ``(input_ids, labels)`` pairs, ``[batch, seq]`` int64; the labels are a copy of
        the inputs (the model shifts them, as Hugging Face's do). An MLM workload's
        batches are ``(input_ids, labels, masked_positions, masked_labels)``: a fixed
        ``round(masked * seq)`` random positions per sequence (BERT's
        ``max_predictions_per_seq``, all of them real), their tokens as ``masked_labels``,
        and ``labels`` the same in HF's ``[batch, seq]`` form (-100 elsewhere); the inputs
        are left unmasked: the kernels do the same work either way.
    """
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, workload.vocab_size, (count, workload.batch, workload.seq), generator=generator)
    if workload.masked:
        predictions = workload.predictions
        order = torch.rand(tokens.shape, generator=generator).argsort(dim=-1)
        positions = order[..., :predictions].sort(dim=-1).values
        masked_labels = tokens.gather(-1, positions)
        labels = torch.full_like(tokens, -100).scatter_(-1, positions, masked_labels)
        parts = (tokens, labels, positions, masked_labels)
        return list(zip(*(part.to(device).unbind(0) for part in parts), strict=True))
    tokens = tokens.to(device)
    # labels a tensor of their own: an input aliasing another would be a guard (and a
    # special case) for torch.compile that no real data loader produces
    return [(t, t.clone()) for t in tokens.unbind(0)]


def measure(step: StepFn, batches: list, warmup: int, steps: int, device: torch.device) -> dict:
    """Warm up, then time ``steps`` steps between marks that never drain the launch queue.

    Args:
        step: ``step(input_ids, labels) -> loss``.
        batches: at least ``warmup + steps`` batches; batch ``i`` feeds step ``i``.
        warmup: warm-up steps (>= 1; the first is timed alone as ``compile_s``).
        steps: timed steps (>= 1).
        device: the device the step runs on.

    Returns:
        ``step_ms`` (one per timed step), ``losses`` (floats, one per timed step),
        ``compile_s`` (the first step's wall time), ``warmup_s`` (all warm-up steps') and
        ``wall_ms_per_step`` (the timed steps' wall time over their count).

    Raises:
        ValueError: warmup or steps below 1, or too few batches.
    """
    if warmup < 1 or steps < 1:
        raise ValueError(f"warmup and steps must be >= 1, got warmup={warmup}, steps={steps}")
    if len(batches) < warmup + steps:
        raise ValueError(f"{len(batches)} batches for {warmup} warm-up + {steps} timed steps")
    _phase("first step")
    start = time.perf_counter()
    step(*batches[0])
    _sync(device)
    compile_s = time.perf_counter() - start
    _phase("warm-up")
    for batch in batches[1:warmup]:
        step(*batch)
    _sync(device)
    warmup_s = time.perf_counter() - start
    _phase("timed steps")
    clock = StepClock(device, steps + 1)
    losses = []
    start = time.perf_counter()
    for i, batch in enumerate(batches[warmup : warmup + steps]):
        clock.mark(i)
        losses.append(step(*batch))
    clock.mark(steps)
    _sync(device)
    wall_s = time.perf_counter() - start
    return {
        "step_ms": clock.intervals_ms(),
        "losses": torch.stack(losses).float().cpu().tolist(),
        "compile_s": compile_s,
        "warmup_s": warmup_s,
        "wall_ms_per_step": 1e3 * wall_s / steps,
    }


def loss_is_sane(losses: list[float], vocab_size: int) -> bool:
    """Whether every loss is finite and the last within ``LOSS_TOLERANCE`` of ln(V).

    Args:
        losses: the timed steps' losses.
        vocab_size: V.

    Returns:
        The verdict (uniform random tokens cannot be learnt: a loss far from ln(V) is a bug).
    """
    return all(math.isfinite(x) for x in losses) and abs(losses[-1] - math.log(vocab_size)) <= LOSS_TOLERANCE


def summarize(timing: dict, workload: Workload) -> dict:
    """A row's figures from ``measure``'s result.

    Args:
        timing: ``measure``'s dict.
        workload: the workload measured.

    Returns:
        ``ms_per_step`` (median), ``ms_per_step_min``, ``ms_per_step_max``,
        ``wall_ms_per_step``, ``tokens_per_s``, ``tflops`` (model FLOPs per second),
        ``first_loss``, ``final_loss``, ``loss_ok``, ``compile_s``, ``warmup_s``.
    """
    ms = statistics.median(timing["step_ms"])
    tokens_per_s = workload.tokens_per_step / (ms * 1e-3)
    losses = timing["losses"]
    return {
        "ms_per_step": ms,
        "ms_per_step_min": min(timing["step_ms"]),
        "ms_per_step_max": max(timing["step_ms"]),
        "wall_ms_per_step": timing["wall_ms_per_step"],
        "tokens_per_s": tokens_per_s,
        "tflops": workload.flops_per_token * tokens_per_s / 1e12,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "loss_ok": loss_is_sane(losses, workload.vocab_size),
        "compile_s": timing["compile_s"],
        "warmup_s": timing["warmup_s"],
    }


def write_profile(step: StepFn, batch: tuple, device: torch.device, path: Path, title: str) -> None:
    """torch.profiler's tables of one step, written to ``path``.

    Args:
        step: the (warmed-up) step.
        batch: its batch.
        device: the device it runs on.
        path: the text file to write.
        title: the first line of the file (workload and variant).
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step(*batch)
        _sync(device)
    averages = prof.key_averages()
    lines = [title, ""]
    # GPU-side ranges of annotations (an optimizer's step) would count their kernels twice
    kernels = sorted(
        (e for e in averages if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)),
        key=lambda e: e.self_device_time_total,
        reverse=True,
    )
    if kernels:
        total_us = sum(e.self_device_time_total for e in kernels)
        lines.append(f"GPU time of the step: {total_us / 1e3:.2f} ms in {sum(e.count for e in kernels)} kernel runs")
        # the first kernel's start to the last one's end: what the busy time leaves idle is launch gaps
        runs = [e.time_range for e in prof.events() if e.device_type == DeviceType.CUDA]
        span_us = max(r.end for r in runs) - min(r.start for r in runs)
        lines += [f"GPU span of the step: {span_us / 1e3:.2f} ms (busy {100 * total_us / span_us:.1f}%)", ""]
        lines.append(f"{'ms':>9} {'%':>6} {'calls':>6}  kernel")
        for e in kernels[:40]:
            share = 100 * e.self_device_time_total / total_us
            lines.append(f"{e.self_device_time_total / 1e3:9.3f} {share:6.1f} {e.count:6d}  {e.key[:160]}")
        lines.append("")
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    lines.append(averages.table(sort_by=sort_by, row_limit=25))
    path.write_text("\n".join(lines) + "\n")


def child_row(workload: Workload, variant: Variant, warmup: int, steps: int, profile_out: Path | None) -> dict:
    """Build and measure one variant in this process (the child's work).

    Args:
        workload: the workload.
        variant: the variant.
        warmup: warm-up steps.
        steps: timed steps.
        profile_out: where to write a profile of one more step, or None.

    Returns:
        The row: ``workload``, ``variant``, ``status`` (``ok``), ``setup``, ``precision``,
        ``params`` and ``param_tensors`` (the model's own count), ``tokens_per_step``,
        ``flops_per_token``, ``warmup``, ``steps``, ``setup_s`` (model and optimizer
        construction), ``peak_gib`` and ``peak_reserved_gib`` (None off CUDA), ``profile``
        (the file's name or None), and ``summarize``'s figures.

    Raises:
        Skipped: the variant cannot run here.
        Exception: whatever building or stepping raised.
    """
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.set_float32_matmul_precision("high")  # what a careful user sets; only fp32 matmuls see it
    _phase("build")
    start = time.perf_counter()
    torch.manual_seed(SEED)
    model = variant.build_model(workload)
    unique = {id(p): p for p in model.parameters()}
    step = variant.make_step(model, workload, device)
    batches = make_batches(workload, warmup + steps + (profile_out is not None), device)
    _sync(device)
    setup_s = time.perf_counter() - start
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    figures = summarize(measure(step, batches, warmup, steps, device), workload)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    reserved = torch.cuda.max_memory_reserved() / 2**30 if cuda else None
    if profile_out is not None:
        _phase("profile")
        write_profile(step, batches[-1], device, profile_out, f"{workload.title}: {variant.name}")
    return {
        "workload": workload.name,
        "variant": variant.name,
        "status": "ok",
        "setup": variant.setup,
        "precision": variant.precision(workload),
        "params": sum(p.numel() for p in unique.values()),
        "param_tensors": len(unique),
        "tokens_per_step": workload.tokens_per_step,
        "flops_per_token": workload.flops_per_token,
        "warmup": warmup,
        "steps": steps,
        "setup_s": setup_s,
        "peak_gib": peak,
        "peak_reserved_gib": reserved,
        "profile": profile_out.name if profile_out is not None else None,
    } | figures


def _one_line(text: str, limit: int = 300) -> str:
    return " ".join(text.split())[:limit]


def child_main(workload: Workload, variant: Variant, warmup: int, steps: int, profile_out: Path | None) -> int:
    """Run one variant and print its row as the last line (``ROW_PREFIX`` + JSON).

    Args:
        workload: the workload.
        variant: the variant.
        warmup: warm-up steps.
        steps: timed steps.
        profile_out: where to write a profile, or None.

    Returns:
        The exit status: 0 when the variant ran or was skipped, 1 when it failed (the row
        says how, the traceback is in the log above it).
    """
    base = {"workload": workload.name, "variant": variant.name, "setup": variant.setup}
    status = 0
    try:
        row = child_row(workload, variant, warmup, steps, profile_out)
    except Skipped as reason:
        row = base | {"status": "skipped", "reason": str(reason)}
    except Exception as error:  # the row reports it; the parent goes on with the next variant
        traceback.print_exc()
        row = base | {"status": "error", "error": _one_line(f"in {_current_phase}: {type(error).__name__}: {error}")}
        status = 1
    print(ROW_PREFIX + json.dumps(row), flush=True)
    return status


# ----------------------------------------------------------------------------- the parent: one run


def row_from_log(workload: str, variant: str, log: str, returncode: int | None, timeout_s: float) -> dict:
    """The row a child left in its log, or an error row where it left none.

    Args:
        workload: the child's workload.
        variant: its variant.
        log: its whole output (stdout and stderr).
        returncode: its exit status, None where it was killed at the timeout.
        timeout_s: the timeout it ran under.

    Returns:
        The child's own row (its last ``ROW_PREFIX`` line), whatever its exit; else ``status`` ``error`` with
        ``error``: the timeout and the phase the child was in, or the exit status and the
        log's last line (the exception, usually).
    """
    lines = log.splitlines()
    rows = [line[len(ROW_PREFIX) :] for line in lines if line.startswith(ROW_PREFIX)]
    if rows:  # a child may hang on its way out (compile workers) after its row: the row stands
        return json.loads(rows[-1])
    setup = VARIANTS[variant].setup if variant in VARIANTS else ""
    base = {"workload": workload, "variant": variant, "setup": setup, "status": "error"}
    phases = [line[len(PHASE_PREFIX) :] for line in lines if line.startswith(PHASE_PREFIX)]
    if returncode is None:
        where = f" in {phases[-1]}" if phases else " before its first phase"
        return base | {"error": f"timed out after {timeout_s:g} s{where}"}
    last = next((line for line in reversed(lines) if line.strip() and not line.startswith(PHASE_PREFIX)), "")
    return base | {"error": _one_line(f"exited with status {returncode}: {last}")}


def run_variant(
    workload: Workload, variant: Variant, warmup: int, steps: int, timeout_s: float, out: Path,
    profile_out: Path | None = None, round_index: int | None = None,
) -> dict:  # fmt: skip
    """One variant in its own process, or the reason it was skipped.

    Args:
        workload: the workload.
        variant: the variant.
        warmup: warm-up steps.
        steps: timed steps.
        timeout_s: seconds the child may take; then its process group is killed.
        out: the output folder (the child's log goes to ``out/logs``).
        profile_out: where the child writes a profile, or None.
        round_index: the round this run is of (its log named after it), or None for one.

    Returns:
        The row (see ``child_row`` and ``row_from_log``), plus ``wall_s`` (the child's whole
        time) and ``log`` (its log's path under ``out``); a skipped row has ``status``
        ``skipped`` and ``reason``.
    """
    cuda = torch.cuda.is_available()
    reason = skip_reason(variant, cuda, _importable)
    if reason:
        base = {"workload": workload.name, "variant": variant.name, "setup": variant.setup}
        return base | {"status": "skipped", "reason": reason}
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    suffix = "" if round_index is None else f".r{round_index}"
    log_path = logs / f"{workload.name}.{variant.name}{suffix}.log"
    command = [
        sys.executable, "-m", "benchmarks.e2e", "--child", "--workload", workload.name, "--variant", variant.name,
        "--warmup", str(warmup), "--steps", str(steps), "--attn-implementation", workload.attn_implementation,
    ]  # fmt: skip
    if profile_out is not None:
        command += ["--profile-out", str(profile_out.resolve())]
    env = dict(os.environ)
    if not cuda:
        env["TRITON_INTERPRET"] = "1"  # lstrain's kernels on the CPU; read when they are defined
    start = time.perf_counter()
    with log_path.open("w") as log:
        # A session of its own, so that a timeout kills Inductor's compile workers with it.
        child = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True
        )
        try:
            returncode = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            returncode = None
    wall_s = time.perf_counter() - start
    row = row_from_log(workload.name, variant.name, log_path.read_text(errors="replace"), returncode, timeout_s)
    return row | {"wall_s": wall_s, "log": str(log_path.relative_to(out))}


def median_round(runs: list[dict]) -> dict:
    """One variant's row from its runs in several rounds: the run of median tokens/s.

    Args:
        runs: the variant's rows, one per round, in round order.

    Returns:
        The measured run of median tokens/s (the lower middle one of an even count), or the
        first run when none was measured, with ``rounds_tokens_per_s``: every run's tokens/s
        in round order, None where a run failed.
    """
    speeds = [r.get("tokens_per_s") if r.get("status") == "ok" else None for r in runs]
    measured = sorted((speed, i) for i, speed in enumerate(speeds) if speed is not None)
    pick = runs[measured[(len(measured) - 1) // 2][1]] if measured else runs[0]
    return pick | {"rounds_tokens_per_s": speeds}


def run_meta(argv: list[str], timeout_s: float, workloads: dict[str, dict]) -> dict:
    """The run's metadata: device, versions, date, command, and the bf16 GEMM rate measured now.

    Args:
        argv: the command's arguments, recorded as the command.
        timeout_s: the per-variant timeout.
        workloads: ``Workload.describe`` of each workload run, by name.

    Returns:
        ``device``, ``cuda``, ``torch``, ``triton``, ``transformers`` and ``liger`` (None:
        not installed), ``python``, ``date`` (ISO), ``command``, ``commit`` (None outside
        git), ``gemm_tflops`` and ``gemm_shape`` (None off CUDA), ``timeout_s``,
        ``workloads``; ``wall_s`` is kept up to date by ``main``.
    """
    # benchmarks.run imports lstrain's op registry: here, never in the children
    from benchmarks.run import GEMM_SIZE, gemm_tflops, git_commit, liger_version

    cuda = torch.cuda.is_available()

    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    meta = {
        "device": torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or platform.machine()})",
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": version("triton"),
        "transformers": version("transformers"),
        "liger": liger_version(),
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "command": shlex.join(["python", "-m", "benchmarks.e2e", *argv]),
        "commit": git_commit(),
        "gemm_tflops": gemm_tflops() if cuda else None,
        "gemm_shape": f"{GEMM_SIZE} x {GEMM_SIZE} x {GEMM_SIZE} bf16 torch.matmul" if cuda else None,
        "timeout_s": timeout_s,
        "workloads": workloads,
        "wall_s": 0.0,
    }
    if cuda:
        torch.cuda.empty_cache()  # the children get the memory back
    return meta


def add_mfu(row: dict, gemm_tflops: float | None) -> dict:
    """The row with ``mfu``: its model TFLOP/s over the run's GEMM rate (None where either is missing)."""
    tflops = row.get("tflops")
    return row | {"mfu": tflops / gemm_tflops if tflops and gemm_tflops else None}


def _print_row(row: dict, round_index: int | None = None) -> None:
    name = f"{row['workload']:<12} {row['variant']:<17}" + ("" if round_index is None else f" r{round_index}")
    if row["status"] == "skipped":
        print(f"{name} skipped: {row['reason']}", flush=True)
    elif row["status"] == "error":
        print(f"{name} error: {row['error']}  [{row.get('wall_s', 0):.0f} s]", flush=True)
    else:
        mfu = f"MFU {100 * row['mfu']:4.1f}%" if row.get("mfu") else ""
        peak = f"peak {row['peak_gib']:5.1f} GiB" if row.get("peak_gib") is not None else ""
        print(
            f"{name} {row['tokens_per_s'] / 1e3:8.1f}k tokens/s {row['ms_per_step']:8.2f} ms/step {mfu} {peak} "
            f"first step {row['compile_s']:5.1f} s  loss {row['final_loss']:.3f}"
            f"{'' if row['loss_ok'] else ' (NOT SANE)'}  [{row['wall_s']:.0f} s]",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring).

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status: 0 (a failed variant is a row, not a failed run); a child returns 1
        when its variant failed.
    """
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS),
                        help=f"repeatable; default {' and '.join(DEFAULT_WORKLOADS)}")  # fmt: skip
    parser.add_argument("--variant", action="append", choices=list(VARIANTS), help="repeatable; default all")
    parser.add_argument("--steps", type=int, help="timed steps (default: the workload's, 20 for GPT-2)")
    parser.add_argument("--warmup", type=int, help="warm-up steps (default: the workload's, 10 for GPT-2)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")))
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per variant")
    parser.add_argument("--rounds", type=int, default=1, help="runs per variant, alternating order; median row")
    parser.add_argument("--profile", choices=list(VARIANTS), help="run this variant alone and profile one step")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument(
        "--attn-implementation", choices=("sdpa", "lstrain"), default="sdpa",  # lstrain.layers.ATTN_IMPLEMENTATIONS
        help="what computes lstrain's GPT-2 and BERT attention (their configs' attn_implementation)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    for name in ("steps", "warmup", "rounds"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.profile and args.rounds > 1:
        parser.error("--profile profiles one run: leave --rounds out")
    if args.child:
        if len(args.workload or ()) != 1 or len(args.variant or ()) != 1:
            parser.error("--child takes exactly one --workload and one --variant")
        workload = replace(WORKLOADS[args.workload[0]], attn_implementation=args.attn_implementation)
        warmup, steps = args.warmup or workload.warmup, args.steps or workload.steps
        return child_main(workload, VARIANTS[args.variant[0]], warmup, steps, args.profile_out)

    started = time.perf_counter()
    workloads = [
        replace(WORKLOADS[name], attn_implementation=args.attn_implementation)
        for name in args.workload or DEFAULT_WORKLOADS
    ]
    variants = [VARIANTS[args.profile]] if args.profile else [VARIANTS[n] for n in args.variant or VARIANTS]
    counts = {w.name: (args.warmup or w.warmup, args.steps or w.steps) for w in workloads}
    args.out.mkdir(parents=True, exist_ok=True)
    meta = run_meta(argv, args.timeout, {w.name: w.describe(*counts[w.name]) for w in workloads})
    gemm = meta["gemm_tflops"]
    print(
        f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}, transformers "
        f"{meta['transformers'] or 'not installed'}, Liger-Kernel {meta['liger'] or 'not installed'}"
        + (f": bf16 GEMM {gemm:.0f} TFLOP/s" if gemm else ""),
        flush=True,
    )
    if args.rounds > 1:
        meta["rounds"] = args.rounds
    runs: dict[tuple[str, str], list[dict]] = {}  # (workload, variant) -> its rows, one per round
    for workload in workloads:
        for index in range(args.rounds):
            for variant in variants if index % 2 == 0 else variants[::-1]:
                profile_out = args.out / f"profile-{workload.name}-{variant.name}.txt" if args.profile else None
                round_index = index + 1 if args.rounds > 1 else None
                row = run_variant(
                    workload, variant, *counts[workload.name], args.timeout, args.out, profile_out, round_index
                )
                runs.setdefault((workload.name, variant.name), []).append(add_mfu(row, gemm))
                _print_row(runs[workload.name, variant.name][-1], round_index)
                meta["wall_s"] = time.perf_counter() - started
                if not args.profile:
                    # after every run, so that a command stopped part-way keeps its rows
                    rows = [median_round(r) if args.rounds > 1 else r[0] for r in runs.values()]
                    results = {"format": FORMAT, "meta": meta, "rows": rows}
                    (args.out / "e2e.json").write_text(json.dumps(results, indent=2) + "\n")
    written = f"profiles in {args.out}" if args.profile else str(args.out / "e2e.json")
    print(f"{len(runs)} rows in {meta['wall_s']:.0f} s: {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
