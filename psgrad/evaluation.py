"""Evaluation on rank 0: when it is due, the model it loads, running it (on a helper thread with
``--eval-background``, so the workers never wait for it), and its eval.csv rows, in order.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch
from torch import nn

from .config import RunConfig
from .data import RankData, eval_batches
from .models.layout import in_layout, memory_format

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def evaluate(
    model: nn.Module, batches: Iterable, loss_fn: LossFn, layout: torch.memory_format = torch.contiguous_format
) -> tuple[float, float]:
    """Mean loss and accuracy of ``model`` over ``batches``, its images in ``layout``."""
    model.eval()
    total, loss_sum, correct = 0, 0.0, 0
    with torch.no_grad():
        for images, labels in batches:
            out = model(in_layout(images, layout))
            loss_sum += float(loss_fn(out, labels)) * len(labels)
            correct += int((out.argmax(1) == labels).sum())
            total += len(labels)
    if total == 0:  # not an accuracy of 0: there was nothing to score
        raise ValueError("the evaluation data yielded no samples (is eval_data a loader that runs dry?)")
    return loss_sum / total, correct / total


class Evaluations:
    """Rank 0's evaluations of one run (see the module). ``model`` is the rank's own model;
    ``trains`` whether this rank also trains it (then evaluations load a copy of it)."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        model: nn.Module,
        trains: bool,
        loss_fn: LossFn,
        data: RankData,
        eval_data: Iterable | None = None,
    ) -> None:
        self.cfg, self.own_model, self.trains, self.loss_fn, self.label = cfg, model, trains, loss_fn, data.label
        self.steps_per_epoch, self.total = data.steps_per_epoch, data.total
        self.eval_data, self.test_set = eval_data, data.test_set
        self._copy: nn.Module | None = None
        self._helper: ThreadPoolExecutor | None = None
        self._running: list[Future] = []

    def is_due(self, step: int) -> bool:
        """The last step, every ``eval_every_steps``-th step, and the end of every ``eval_every_epochs``-th epoch."""
        spe, every = self.steps_per_epoch, self.cfg.eval_every_epochs
        if step == self.total - 1 or (self.cfg.eval_every_steps and (step + 1) % self.cfg.eval_every_steps == 0):
            return True
        return every > 0 and (step + 1) % spe == 0 and ((step + 1) // spe) % every == 0

    def doing(self, step: int) -> str:
        """What rank 0 reports doing (the watchdog's lines) from the moment it starts the
        evaluation after ``step``: in the training loop the other ranks wait for it, which is
        expected, not a rank stuck; a background one may first wait for the one before."""
        if self.cfg.eval_background:
            return f"starting the evaluation after step {step}"
        return f"evaluating after step {step} in the training loop (--no-eval-background), which the others wait for"

    def model(self) -> nn.Module:
        """The model an evaluation is loaded into, free to change (the previous evaluation has
        finished): a serving-only rank's own model, which never trains; on a training rank a copy
        of it, made once (building a new model would draw from the RNG the run trains with),
        without the worker's pull hooks."""
        self.wait()
        if not self.trains:
            return self.own_model
        if self._copy is None:
            self._copy = copy.deepcopy(self.own_model).cpu()
            for module in self._copy.modules():
                module._forward_pre_hooks.clear()
        return self._copy

    def start(self, model: nn.Module, step: int, paused: float = 0.0) -> None:
        """Evaluate ``model`` after ``step``; the row comes out of ``take``.

        With ``--eval-background`` (default) a helper thread evaluates while this rank goes on
        serving or training: the caller hands ``model`` over and must not change it before
        ``wait`` (at most one runs at a time). Otherwise it runs here and now. ``paused``: the
        seconds the caller already held training up (the row's ``paused_seconds`` adds the
        evaluation itself when it runs in the foreground)."""
        if not self.cfg.eval_background:
            row = self.row(model, step)
            row["paused_seconds"] = paused + row["eval_seconds"]
            future: Future = Future()
            future.set_result(row)
        else:
            if self._helper is None:
                self._helper = ThreadPoolExecutor(1, thread_name_prefix="psgrad-eval")
            future = self._helper.submit(lambda: {**self.row(model, step), "paused_seconds": paused})
        self._running.append(future)

    def wait(self) -> None:
        """Block until every evaluation started has finished (its model may be changed again)."""
        wait(self._running)

    def take(self, block: bool = False) -> list[dict]:
        """The rows of the evaluations finished so far, in order (with ``block``: of all, and the
        helper thread ends)."""
        if block:
            self.wait()
            if self._helper is not None:
                self._helper.shutdown()
                self._helper = None
        rows = []
        while self._running and self._running[0].done():
            rows.append(self._running.pop(0).result())  # re-raises an evaluation's exception here
        return rows

    def row(self, model: nn.Module, step: int) -> dict:
        """One eval.csv row: ``model`` evaluated on the test set after ``step``."""
        batches = self.eval_data if self.eval_data is not None else eval_batches(self.test_set, self.cfg.dataset)
        start = time.perf_counter()
        device = next(model.parameters()).device
        test_loss, test_acc = evaluate(model, batches, self.loss_fn, memory_format(self.cfg.memory_format, device))
        return {
            "epoch": round((step + 1) / self.steps_per_epoch, 4),
            "step": step,  # the last step trained, 0-based as in metrics.csv
            "test_loss": test_loss,
            "test_acc": test_acc,
            "dataset": self.label,
            "eval_seconds": time.perf_counter() - start,
        }
