"""What a run leaves to read: one JSON line per logged step, and the loss curve as a PNG."""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["MetricsLog", "plot_losses"]


class MetricsLog:
    """``metrics.jsonl`` in a folder: one JSON object per line, flushed as written.

    A resumed run drops the lines of the steps it will run again (a killed run logged
    past its last checkpoint), so that the file reads as one uninterrupted run.

    Args:
        folder: the metrics folder, created if needed.
        resume_step: keep only the lines of steps below this (None: start a new file).
    """

    def __init__(self, folder: str | Path, resume_step: int | None = None) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / "metrics.jsonl"
        kept = []
        if resume_step is not None and self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # the last line of a killed run may be cut short
                    continue
                if record.get("step", 0) <= resume_step:
                    kept.append(record)
        self.records: list[dict] = kept
        with open(self.path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        self._file = open(self.path, "a")  # noqa: SIM115 (closed by close())

    def write(self, record: dict) -> None:
        """Append one record.

        Args:
            record: JSON-serialisable; ``step`` is the number of steps taken.
        """
        self.records.append(record)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()


def plot_losses(path: str | Path, records: list[dict], title: str) -> None:
    """Draw the train and eval losses of ``records`` to a PNG, replaced atomically.

    Args:
        path: the PNG.
        records: metrics records; those with ``loss`` are train points, those with
            ``eval_loss`` eval points, both against ``step``.
        title: the figure's title.
    """
    # the Agg canvas directly: no pyplot, so no global backend state and no display needed
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    if train:
        axes.plot(*zip(*train, strict=True), label="train", linewidth=1.2)
    if evals:
        axes.plot(*zip(*evals, strict=True), "o-", label="eval", linewidth=1.2, markersize=4)
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path = Path(path)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    figure.savefig(temp, format="png")
    os.replace(temp, path)
