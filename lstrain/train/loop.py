"""The training loop of ``lstrain train``: one process, or one rank of a ``torchrun`` job.

The model family (GPT-2, BERT, LLaMA) comes from :data:`lstrain.train.families.FAMILIES`; the
loop itself knows no family: it builds the family's config and model, asks the data for
causal or masked LM, takes the model's inputs from each batch through the family's entry,
and saves HF checkpoints with the model's ``save_pretrained``.

Several ranks are tested with gloo processes on the CPU only: the NCCL path (more than
one GPU) has not been run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lstrain import _backend
from lstrain.optim import DataParallel, FlatParameters, FusedAdamW, LossScaler, ZeroAdamW
from lstrain.train import checkpoint as ckpt
from lstrain.train.capture import CapturedStep
from lstrain.train.config import RunConfig, TrainingConfig
from lstrain.train.families import Family
from lstrain.train.metrics import MetricsLog, plot_losses
from lstrain.train.schedule import lr_factor

__all__ = ["Summary", "train"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CAPTURE_WARMUP = 3  # eager steps on a side stream before a capture, as torch's CUDA-graph docs do
# dense bf16 tensor-core peaks from NVIDIA's datasheets (TFLOP/s), by a device-name fragment, the
# more specific first (an H100 PCIe or NVL has a lower peak than the SXM part): MFU's denominator
_PEAK_BF16_TFLOPS = {"H200": 989.4, "H100 PCIe": 756.5, "H100 NVL": 835.5, "H100": 989.4, "A100": 312.0}


@dataclass
class Summary:
    """What a run did.

    Attributes:
        steps: optimizer steps taken by this process (a resumed run counts from where it
            resumed).
        tokens: tokens trained on in those steps, over all ranks.
        seconds: wall time of those steps (evaluation and checkpoints included).
        train_loss: the loss of the last step (mean over ranks), None if no step ran.
        eval_loss: the last validation loss, None without evaluation.
        losses: the training loss of each logged step (every ``log_freq`` and the last; rank
            0's view: the mean over ranks), by step: the loss is read back only when logged.
        checkpoint: the last checkpoint written, None if none.
        sample: the generated text, None without ``[sample]`` (and for a family that does
            not generate, such as BERT).
        model: the trained model (its parameters are views of the optimizer's flat buffers).
        tflops: model TFLOP/s over all ranks (``6 N + 12 L T D`` per token, N counting the
            LM head's GEMM, as ``benchmarks/e2e.py``; the family's ``flops_per_token``).
        mfu: tflops over the ranks' datasheet dense bf16 peak, on a GPU the table knows;
            else None.
    """

    steps: int
    tokens: int
    seconds: float
    train_loss: float | None
    eval_loss: float | None
    losses: dict[int, float]
    checkpoint: Path | None
    sample: str | None
    model: torch.nn.Module | None = None
    tflops: float = 0.0
    mfu: float | None = None


@dataclass
class _World:
    rank: int
    size: int
    device: torch.device
    initialized_here: bool

    @property
    def main(self) -> bool:
        return self.rank == 0


def _setup_world(device_name: str) -> _World:
    """Join the ``torchrun`` job the environment describes (gloo on the CPU, NCCL on CUDA)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = device_name == "cuda" or (device_name == "auto" and torch.cuda.is_available())
    if device_name == "cuda" and not torch.cuda.is_available():
        raise ValueError('[training]: device = "cuda" but torch sees no CUDA device')
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    initialized_here = False
    if size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
        initialized_here = True
    return _World(rank, size, device, initialized_here)


def _step_seed(seed: int, step: int, rank: int) -> int:
    """The torch seed of one (step, rank): dropout is a function of them, so a resumed run
    draws the masks the uninterrupted one drew, and ranks draw different ones."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])


def _rng_state() -> dict:
    numpy_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [numpy_state[0], torch.from_numpy(numpy_state[1].copy()), *numpy_state[2:]],
        "python": list(random.getstate()),
    }


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        # one state per GPU the saving process saw: a machine with fewer takes its first ones
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy(), *rest))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def _memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _mfu(tflops: float, device: torch.device, ranks: int) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in _PEAK_BF16_TFLOPS.items() if k in name), None)
    return tflops / (peak * ranks) if peak else None


def _to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The model's inputs on the device; the attention mask only where there is padding
    (checked on the CPU batch: no device sync), since the unmasked kernels are the faster
    ones."""
    out = {}
    for key, value in batch.items():
        if key == "attention_mask" and bool(value.all()):
            continue
        out[key] = value.to(device, non_blocking=True)
    return out


def _optimizer_label(stepper: _Stepper) -> str:
    """The optimizer as the start-up line names it, with its precision where it is not the
    default (fp32 master weights and moments)."""
    if not stepper.fused:
        return "torch.optim.AdamW over flat buffers"
    optimizer = stepper.optimizer
    label = type(optimizer).__name__
    changes = [] if optimizer.master_weights else ["no master weights"]
    if optimizer.state_dtype != torch.float32:
        changes.append(f"{str(optimizer.state_dtype).removeprefix('torch.')} moments, rounded stochastically")
    return f"{label} ({', '.join(changes)})" if changes else label


class _Stepper:
    """One optimizer step: micro-batches' forward and backward, the gradient all-reduce,
    clipping, the (loss-scaled) update. Eager, or captured in a CUDA graph.

    FusedAdamW runs where lstrain's kernels run (CUDA, or the CPU with the Triton
    interpreter on); on the CPU without the interpreter, ``torch.optim.AdamW`` updates the
    same flat buffers (FlatParameters), clipped by the same formula: the checkpoints'
    optimizer state has torch's layout either way.
    """

    def __init__(
        self,
        run: RunConfig,
        model: torch.nn.Module,
        world: _World,
        accumulation: int,
        loss_tokens: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    ) -> None:
        self.run, self.model, self.world, self.accumulation = run, model, world, accumulation
        self.loss_tokens = loss_tokens
        training = run.training
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        opt = run.optimizer
        groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
        kwargs = {"lr": opt.lr, "betas": opt.betas, "eps": opt.eps, "weight_decay": opt.weight_decay}
        max_norm = training.max_norm or None
        self.fused = world.device.type == "cuda" or _backend.interpreter_active()
        self.zero = opt.name == "zero_adamw"
        precision = {"master_weights": opt.master_weights, "state_dtype": getattr(torch, opt.state_dtype)}
        if self.zero:  # ZeRO-1: its step reduce-scatters the gradients and gathers the weights
            self.optimizer = ZeroAdamW(groups, **kwargs, **precision, max_grad_norm=max_norm)
            self.flat = self.optimizer.flat
        elif self.fused:
            self.optimizer = FusedAdamW(groups, **kwargs, **precision, max_grad_norm=max_norm)
            self.flat = self.optimizer.flat
        elif not opt.master_weights or opt.state_dtype != "float32":
            raise ValueError(
                '[optimizer]: master_weights = false and state_dtype = "bfloat16" round stochastically in '
                "lstrain's FusedAdamW, which runs on CUDA or in the Triton interpreter (TRITON_INTERPRET=1); "
                "torch's AdamW here would round to nearest"
            )
        else:
            self.flat = FlatParameters([decay, no_decay])
            self.optimizer = torch.optim.AdamW(groups, **kwargs)
        self.max_norm = max_norm
        self.scaler = LossScaler(device=world.device) if training.mixed_precision == "fp16" else None
        self.forward = torch.compile(model) if training.compile else model
        self.graph: CapturedStep | None = None
        # data parallel: the flat gradient buffers all-reduced in buckets as backward fills them
        data_parallel = world.size > 1 and not self.zero
        self.ddp = DataParallel(self.optimizer if self.fused else self.flat) if data_parallel else None

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _zero_grad(self) -> None:
        if self.fused:
            # the first backward writes lstrain's weight gradients straight into the flat buffers
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.flat.zero_grad()

    def _clip(self) -> None:
        # FusedAdamW's formula, so that both optimizers clip alike
        norms = torch.stack([torch.linalg.vector_norm(b.grad.float()) for b in self.flat.buffers])
        factor = torch.clamp(self.max_norm / (torch.linalg.vector_norm(norms) + 1e-6), max=1.0)
        for buffer in self.flat.buffers:
            buffer.grad.mul_(factor.to(buffer.grad.dtype))

    def eager(self, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """One step on ``batches`` (one per micro-batch, on the device).

        The step's loss is the mean over all its loss tokens, on every rank (as one batch of
        them all would give; HF's ``num_items_in_batch``): each micro-batch's mean loss is
        weighed by its share of the tokens, not by 1 / micro-batches.

        Returns:
            This rank's part of the step's loss, times the ranks: the mean over ranks is the
            step's loss (a detached device scalar).
        """
        self._zero_grad()
        counts = torch.stack([self.loss_tokens(batch) for batch in batches]).double()
        everyone = counts.sum()
        if self.world.size > 1:  # the gradients are averaged over ranks: weigh by the global count
            dist.all_reduce(everyone)
        weights = (counts * self.world.size / everyone).float()
        total = torch.zeros((), dtype=torch.float32, device=self.world.device)
        for number, batch in enumerate(batches):
            # only the last micro-batch's backward reduces (the buckets overlap it)
            local = self.ddp is not None and number < len(batches) - 1
            with self.ddp.no_sync() if local else contextlib.nullcontext():
                # a micro-batch without loss tokens (its mean NaN) weighs nothing
                loss = torch.where(counts[number] > 0, self.forward(**batch).loss.float(), 0.0)
                scaled = loss * weights[number]
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            total += loss.detach() * weights[number]
        if self.ddp is not None:
            self.ddp.finish()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            if not self.fused and self.max_norm is not None:
                self._clip()
            self.optimizer.step()
        return total

    def captured(self, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """The step replayed from one CUDA graph (:class:`lstrain.train.CapturedStep`,
        captured at the first call; the warm-up steps undone on the model, optimizer,
        scaler and RNG).

        Returns:
            What :meth:`eager` returns (a copy: the next replay overwrites it).

        Raises:
            ValueError: a batch has padding (the static inputs have no attention mask).
        """
        if any("attention_mask" in b for b in batches):
            raise ValueError("cuda_graphs: batches with padding are not supported (the captured step has no mask)")
        if self.graph is None:
            restore = (self.model, self.optimizer) + ((self.scaler,) if self.scaler else ())
            self.graph = CapturedStep(self.eager, restore=restore, warmup=CAPTURE_WARMUP)
        return self.graph(batches)

    def state_dict(self) -> dict:
        """The optimizer's and scaler's state; with ZeRO-1 a collective (every rank calls it)
        whose optimizer state, gathered in torch's AdamW layout, only rank 0 receives."""
        return {
            "optimizer": self.optimizer.state_dict(gathered=True) if self.zero else self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler else None,
        }

    def load_state_dict(self, state: dict) -> None:
        # the recipe's betas, eps and weight decays hold on, as its lr (set every step) does:
        # torch's load_state_dict would bring back the checkpoint's without a word
        recipe = [{k: g[k] for k in ("betas", "eps", "weight_decay") if k in g} for g in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state["optimizer"])
        for group, values in zip(self.optimizer.param_groups, recipe, strict=True):
            group.update(values)
        if self.scaler is not None:
            if state["scaler"] is None:
                raise ValueError("--resume: the checkpoint has no loss-scaler state (it was not an fp16 run)")
            self.scaler.load_state_dict(state["scaler"])


def _data_position(training: TrainingConfig, world_size: int, accumulation: int) -> dict[str, int]:
    """What a checkpoint's data position depends on: step k starts at sample k x
    sequences_per_step of sequences of seq_len tokens (ranks and micro-batches may split
    the sequences otherwise: the samples stay the same)."""
    return {"sequences_per_step": training.local_batch_size * world_size * accumulation, "seq_len": training.seq_len}


def _check_run(run: RunConfig, world: _World, family: Family, model_config: Any, data: Any) -> int:
    """Everything that can be wrong before a step runs; returns the accumulation steps."""
    training = run.training
    positions = family.positions(model_config)
    if training.seq_len > positions:
        raise ValueError(
            f"[training]: seq_len {training.seq_len} exceeds the model's {family.positions_field} {positions}"
        )
    if getattr(data, "mlm", family.mlm) != family.mlm:
        task = "masked-LM" if family.mlm else "causal-LM"
        raise ValueError(f"[model] {family.name} trains on {task} data, but the data given is not (build_data's mlm)")
    fixed = getattr(data.train, "max_predictions_per_seq", None) is not None
    if family.mlm and training.cuda_graphs and not fixed:
        raise ValueError(
            f"[training]: cuda_graphs with {family.label} needs [data] max_predictions_per_seq (a fixed number of "
            "masked positions per sequence: the loss then gathers its rows with a static shape, with no host sync)"
        )
    if run.sample.max_new_tokens and not family.generates:
        raise ValueError(
            f"[sample]: {family.label} does not generate text; set sample.max_new_tokens = 0 (or leave [sample] out)"
        )
    if training.cuda_graphs and world.device.type != "cuda":
        raise ValueError("[training]: cuda_graphs needs CUDA (this run is on the CPU)")
    if run.optimizer.name == "zero_adamw":
        if world.size == 1:
            raise ValueError(
                '[optimizer]: name = "zero_adamw" shards over the ranks of a torchrun job; with one process use "adamw"'
            )
        if world.device.type != "cuda" and not _backend.interpreter_active():
            raise ValueError(
                '[optimizer]: name = "zero_adamw" runs lstrain\'s kernels: CUDA, or TRITON_INTERPRET=1 on the CPU'
            )
    if training.cuda_graphs and world.size > 1:
        raise ValueError(
            "[training]: cuda_graphs with more than one rank is not supported yet (the gradient buckets' "
            "collectives are not captured); run data parallel eagerly"
        )
    if training.cuda_graphs and training.compile:
        raise ValueError("[training]: compile and cuda_graphs together are not supported yet; choose one")
    if training.mixed_precision != "fp32" and world.device.type != "cuda":
        raise ValueError(
            f'[training]: mixed_precision = "{training.mixed_precision}" needs CUDA; on the CPU use "fp32" '
            "(the interpreter's bf16 GEMMs are wrong, and the plain-PyTorch CPU path keeps no fp32 master weights)"
        )
    return training.accumulation(world.size)


def _head_share(family: Family, data: Any, training: Any) -> float:
    """The share of rows an MLM head runs on: the fixed masked positions per sequence over
    seq_len, else the masking probability; 0 for causal families (their head is in N)."""
    if family.head_params is None:
        return 0.0
    predictions = getattr(data, "max_predictions_per_seq", None)
    return min(predictions / training.seq_len, 1.0) if predictions else getattr(data, "mlm_probability", 0.15)


def _sample(
    model: torch.nn.Module, tokenizer, run: RunConfig, prompt_ids: list[int], device: torch.device, positions: int
) -> str:
    """Continue ``prompt_ids`` by ``max_new_tokens`` sampled tokens; the decoded text."""
    config = run.sample
    generator = torch.Generator().manual_seed(run.training.seed)
    ids = list(prompt_ids)
    model.eval()
    with torch.no_grad():
        for _ in range(config.max_new_tokens):
            context = torch.tensor([ids[-positions:]], device=device)
            logits = model(context).logits[0, -1].float().cpu()
            if config.temperature == 0:
                token = int(logits.argmax())
            else:
                probs = torch.softmax(logits / config.temperature, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
            ids.append(token)
    model.train()
    return tokenizer.decode(ids)


def train(
    run: RunConfig,
    *,
    resume: str | Path | bool | None = None,
    data: Any = None,
    progress: bool = True,
    echo: Callable[[str], None] | None = None,
    allow_batch_change: bool = False,
) -> Summary:
    """Train the recipe's model on its data; checkpoints, metrics and a summary on rank 0.

    Args:
        run: the recipe.
        resume: True: continue from the latest checkpoint in ``[checkpoint] folder``; a
            path: from that checkpoint (or the latest in that folder); None/False: a new
            run, refused when the checkpoint folder already holds checkpoints.
        data: an object with ``tokenizer``, ``train`` and ``val`` as ``lstrain.data``
            builds it (None: ``lstrain.data.build_data(run.data, ...)``).
        progress: show the tqdm progress bar (rank 0).
        echo: where rank 0's lines go (default: print to stdout).
        allow_batch_change: resume a checkpoint trained with another number of sequences
            per optimizer step or another seq_len (refused by default: its data position
            does not carry over); the data then continues at step x the new batch.

    Returns:
        The :class:`Summary` (on every rank; the losses are the mean over ranks).

    Raises:
        ValueError, FileNotFoundError: bad input, found before any step runs and before
            anything is written: no data (neither ``data`` nor ``run.data``), a missing
            data path, seq_len beyond the model's positions, a batch that does not divide
            across ranks, a new run over existing checkpoints, a checkpoint of another
            model or of another batch / seq_len,
            cuda_graphs without CUDA (or, for BERT, without fixed masked positions),
            ``[sample]`` for a family that does not generate.
    """
    world = _setup_world(run.training.device)
    try:
        summary = _train(run, world, resume, data, progress, echo or print, allow_batch_change)
    except BaseException:
        if world.initialized_here:  # no barrier: the other ranks may never reach one
            dist.destroy_process_group()
        raise
    if world.initialized_here:
        dist.barrier()
        dist.destroy_process_group()
    return summary


def _train(run: RunConfig, world: _World, resume, data, progress: bool, echo, allow_batch_change: bool) -> Summary:
    training, device = run.training, world.device
    family = run.model.family
    say = echo if world.main else (lambda line: None)
    if data is None:
        if run.data is None:
            raise ValueError("train: no data: pass data= or set RunConfig.data (the recipe's [data])")
        from lstrain.data import build_data

        data = build_data(run.data, seq_len=training.seq_len, seed=training.seed, mlm=family.mlm)
    model_config = run.model.build(data.tokenizer.vocab_size, data.tokenizer.pad_id)
    if "fused" not in run.model.fields and world.device.type == "cpu" and not _backend.interpreter_active():
        # lstrain's ops would run their plain-PyTorch references here anyway; the fused=False
        # twin (the same parameters and checkpoints) is the faster way to run them
        model_config = dataclasses.replace(model_config, fused=False)
    accumulation = _check_run(run, world, family, model_config, data)
    dtype = _DTYPES[training.mixed_precision]
    folder = Path(run.checkpoint.folder)
    start_checkpoint, state, changed = None, None, None
    if world.main and (run.checkpoint.enabled or resume is True):
        # before any checkpoint is looked for: a killed re-save's moved-aside directory is
        # put back first, so that resume and the checks below see it
        ckpt.remove_partial_writes(folder)
    if world.size > 1:
        dist.barrier()
    if resume:
        start_checkpoint = ckpt.find_checkpoint(folder if resume is True else resume)
        later = [c.name for c in ckpt.list_checkpoints(folder) if c.name > start_checkpoint.name]
        if run.checkpoint.enabled and later:
            raise ValueError(
                f"--resume: {folder} holds checkpoints after {start_checkpoint.name} ({', '.join(later)}), from the "
                "run being branched from; this run's would mix with them and keep_latest_k could delete the one "
                "resumed from: move them away, or set [checkpoint] folder to another one"
            )
        mismatch = ckpt.model_mismatch(start_checkpoint, model_config.to_hf_dict())
        if mismatch:
            raise ValueError(f"--resume: {start_checkpoint} holds another model: {'; '.join(mismatch)}")
        state = ckpt.load_trainer_state(start_checkpoint)
        differs = ckpt.run_mismatch(state, training.seed, data.tokenizer.fingerprint(), ckpt.data_splits(data))
        if differs is not None:
            raise ValueError(f"--resume: {start_checkpoint} was trained with {differs}; resume with its settings")
        changed = ckpt.data_mismatch(state, _data_position(training, world.size, accumulation))
        if changed and not allow_batch_change:
            raise ValueError(
                f"--resume: {start_checkpoint} was trained with {changed}: its data position (step x sequences per "
                "step) does not carry over; resume with the checkpoint's batch and seq_len, or pass "
                "--allow-batch-change to continue anyway (the data then continues at step x the new batch)"
            )
    elif run.checkpoint.enabled and ckpt.list_checkpoints(folder):
        raise ValueError(
            f"[checkpoint]: {folder} already holds checkpoints; pass --resume to continue, or set another folder "
            "(nothing is written over them)"
        )

    torch.manual_seed(training.seed)  # every rank builds the same initial model
    model = family.model_cls(model_config, device=device, dtype=dtype).train()
    start_step = 0
    if start_checkpoint is not None:
        loaded = family.model_cls.from_pretrained(start_checkpoint, device=device, dtype=dtype)
        model.load_state_dict(loaded.state_dict())
        del loaded
        start_step = state["step"]
        if start_step >= training.steps:
            raise ValueError(
                f"--resume: {start_checkpoint} is at step {start_step}, and training.steps is {training.steps}: "
                "nothing is left to run; raise training.steps to train on"
            )
    stepper = _Stepper(run, model, world, accumulation, family.loss_tokens)
    if state is not None:
        stepper.load_state_dict(state)
        _set_rng_state(state["rng"])
    parameters = sum(p.numel() for p in model.parameters())
    layers, width = family.shape(model_config)
    local = training.local_batch_size  # rows per rank: the data's batch() gives each rank its own
    tokens_per_step = local * world.size * accumulation * training.seq_len
    say(
        f"lstrain train: {family.label}, {layers} layers x {width}, {parameters / 1e6:.2f}M parameters, "
        f"vocab {model_config.vocab_size}; {training.local_batch_size} x {world.size} rank(s) x {training.seq_len} "
        f"x {accumulation} accumulation = {tokens_per_step} tokens per step; {training.steps} steps on {device} "
        f"({'lstrain kernels' if model_config.fused else 'plain-PyTorch model'}, "
        f"{_optimizer_label(stepper)}, {training.mixed_precision})"
    )
    if run.lr_scheduler.warmup_steps >= training.steps:
        say(
            f"note: [lr_scheduler] warmup_steps {run.lr_scheduler.warmup_steps} >= [training] steps "
            f"{training.steps}: the learning rate rises for the whole run and never reaches {run.optimizer.lr:g}"
        )
    if start_checkpoint is not None:
        say(f"resuming from {start_checkpoint} (step {start_step})")
        saved_total = state.get("scheduler", {}).get("total_steps", training.steps)
        if saved_total != training.steps:
            say(
                f"note: the checkpoint's run was to take {saved_total} steps, this one {training.steps}: the learning "
                "rate schedule is stretched to the new total from here on"
            )
        if changed:
            say(f"--allow-batch-change: trained with {changed}; the data continues at step x the new batch")

    log = None
    if world.main:
        log = MetricsLog(run.metrics.folder, resume_step=start_step if start_checkpoint is not None else None)
        if start_checkpoint is None:
            log.write({"step": 0, "run": run.to_dict(), "parameters": parameters, "world_size": world.size})
    plot_path = Path(run.metrics.folder) / "loss.png"

    def inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return _to_device(family.inputs(batch), device)

    def mean_over_ranks(value: torch.Tensor) -> float:
        if world.size > 1:
            value = value.clone()
            dist.all_reduce(value)
            value /= world.size
        return float(value)

    # the first step whose loss was not finite on any rank (0: none yet), kept on the device
    # so that steps between logs do not wait for the host
    first_nonfinite = torch.zeros((), dtype=torch.int64, device=device)

    def check_finite(before: str) -> None:
        """Raise before logging, evaluating or saving a step once any loss went NaN or inf."""
        bad = first_nonfinite.clone()
        if world.size > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad := int(bad):
            raise FloatingPointError(f"lstrain train: the loss is not finite at step {bad} (found before {before})")

    def evaluate() -> float | None:
        if run.eval.steps == 0:
            return None
        model.eval()
        # the mean over every evaluated token, as training's step loss is
        sums = torch.zeros(2, dtype=torch.float32, device=device)
        with torch.no_grad():
            for i in range(run.eval.steps):
                batch = inputs(data.val.batch(i, local, rank=world.rank, world_size=world.size))
                count = family.loss_tokens(batch).float()
                loss = torch.where(count > 0, model(**batch).loss.float(), 0.0)  # none: NaN, weighs nothing
                sums += torch.stack([loss * count, count])
        model.train()
        if world.size > 1:
            dist.all_reduce(sums)
        return float(sums[0] / sums[1])

    def save(step: int, stepper_state: dict) -> Path:
        state = {
            "step": step,
            "data_step": step * accumulation,
            "data": _data_position(training, world.size, accumulation),
            "tokenizer": data.tokenizer.fingerprint(),
            "splits": ckpt.data_splits(data),
            **stepper_state,
            "scheduler": {"step": step, "total_steps": training.steps},
            "rng": _rng_state(),
            "world_size": world.size,
            "run": run.to_dict(),
        }
        return ckpt.save_checkpoint(folder, step, model, state, run.checkpoint.keep_latest_k)

    from tqdm import tqdm

    bar = tqdm(
        total=training.steps,
        initial=start_step,
        disable=not (progress and world.main),
        unit="step",
        dynamic_ncols=True,
        file=sys.stderr,
    )
    losses: dict[int, float] = {}
    eval_loss = None
    last_checkpoint = None
    started = time.perf_counter()
    interval_start, interval_tokens = started, 0
    step_fn = stepper.captured if training.cuda_graphs else stepper.eager
    for step in range(start_step, training.steps):
        lr = run.optimizer.lr * lr_factor(step, training.steps, run.lr_scheduler)
        stepper.set_lr(lr)
        if not training.cuda_graphs:  # the graph's dropout offsets advance per replay instead
            torch.manual_seed(_step_seed(training.seed, step, world.rank))
        batches = [
            inputs(data.train.batch(step * accumulation + m, local, rank=world.rank, world_size=world.size))
            for m in range(accumulation)
        ]
        loss = step_fn(batches)
        done = step + 1
        unseen = (first_nonfinite == 0) & ~torch.isfinite(loss)
        first_nonfinite = torch.where(unseen, done, first_nonfinite)
        bar.update(1)
        interval_tokens += tokens_per_step
        if done % run.metrics.log_freq == 0 or done == training.steps:
            check_finite(f"logging step {done}")  # the host reads: only at logged steps
            value = mean_over_ranks(loss)
            now = time.perf_counter()
            rate = interval_tokens / max(now - interval_start, 1e-9)
            interval_start, interval_tokens = now, 0
            losses[done] = value
            memory = _memory_mib(device)
            bar.set_postfix(loss=f"{value:.4f}", tok_s=f"{rate:,.0f}", lr=f"{lr:.2e}", mem=f"{memory:,.0f}MiB")
            if log is not None:
                log.write({"step": done, "loss": value, "lr": lr, "tokens_per_s": rate, "memory_mib": memory})
        evaluating = run.eval.freq and done % run.eval.freq == 0
        interval = run.checkpoint.interval
        saving = run.checkpoint.enabled and ((interval and done % interval == 0) or done == training.steps)
        pausing = evaluating or saving or done == training.steps
        if pausing:
            # the steps queued so far finish inside the interval; the pause is not timed
            check_finite(f"evaluating or saving step {done}")
            paused = time.perf_counter()
        if evaluating or done == training.steps:
            eval_loss = evaluate()
            if eval_loss is not None and not math.isfinite(eval_loss):
                raise FloatingPointError(f"lstrain train: the eval loss is {eval_loss} at step {done}")
            if log is not None and eval_loss is not None:
                log.write({"step": done, "eval_loss": eval_loss})
                (bar.write if progress else say)(f"step {done}: eval loss {eval_loss:.4f}")
            if log is not None:
                plot_losses(plot_path, log.records, f"{layers} x {width} {family.label}")
        if saving:
            if world.main or stepper.zero:  # ZeRO-1's gather is a collective: every rank joins it
                stepper_state = stepper.state_dict()
            if world.main:
                last_checkpoint = save(done, stepper_state)
            if world.size > 1:
                dist.barrier()  # no rank runs ahead of a checkpoint it could be killed after
        if pausing:
            interval_start += time.perf_counter() - paused
    bar.close()
    seconds = time.perf_counter() - started
    ran = training.steps - start_step
    sample = None
    if run.sample.max_new_tokens and world.main:
        prompt = data.tokenizer.encode(run.sample.prompt) if run.sample.prompt else []
        if not prompt:
            prompt = data.val.batch(0, 1)["input_ids"][0, :8].tolist()
        sample = _sample(model, data.tokenizer, run, prompt, device, family.positions(model_config))
    flops_per_token = family.flops_per_token(model_config, training.seq_len, _head_share(family, run.data, training))
    tflops = ran * tokens_per_step * flops_per_token / max(seconds, 1e-9) / 1e12
    summary = Summary(
        steps=ran,
        tokens=ran * tokens_per_step,
        seconds=seconds,
        train_loss=losses[max(losses)] if losses else None,
        eval_loss=eval_loss,
        losses=losses,
        checkpoint=last_checkpoint,
        sample=sample,
        model=model,
        tflops=tflops,
        mfu=_mfu(tflops, device, world.size),
    )
    if log is not None:
        names = ("steps", "tokens", "seconds", "train_loss", "eval_loss", "tflops", "mfu", "sample")
        record = {k: getattr(summary, k) for k in names}
        log.write({"step": training.steps, "summary": {**record, "checkpoint": str(last_checkpoint)}})
        log.close()
    _print_summary(say, summary, run)
    return summary


def _print_summary(say: Callable[[str], None], summary: Summary, run: RunConfig) -> None:
    rate = summary.tokens / max(summary.seconds, 1e-9)
    first = summary.losses[min(summary.losses)] if summary.losses else None
    mfu = f", MFU {summary.mfu:.1%} of the datasheet bf16 peak" if summary.mfu is not None else ""
    say(
        f"done: {summary.steps} steps, {summary.tokens:,} tokens in {summary.seconds:.1f} s ({rate:,.0f} tokens/s, "
        f"model {summary.tflops:.3g} TFLOP/s{mfu})"
    )
    if first is not None:
        say(f"train loss {first:.4f} -> {summary.train_loss:.4f}" + (
            f", eval loss {summary.eval_loss:.4f}" if summary.eval_loss is not None else ""))  # fmt: skip
    if summary.checkpoint is not None:
        say(f"checkpoint: {summary.checkpoint}")
    say(f"metrics: {Path(run.metrics.folder) / 'metrics.jsonl'}, loss curve: {Path(run.metrics.folder) / 'loss.png'}")
    if summary.sample is not None:
        say(f"sample:\n{summary.sample}")
