"""A saved stop in your own loop (psgrad/userloop/savedstop.py), the way docs/api.md shows it.

Usage: mpiexec -n N python saved_stop.py OUT TOPOLOGY MODE [END]

Mode ``stop`` trains until ``psgrad.should_stop()`` says to stop (after a SIGTERM the test sends),
saying on stderr when every worker has taken steps; each worker then saves its model, optimizer
and step in OUT/ckpt-<rank>.pt and exits with status 143. Mode ``resume`` loads that checkpoint and trains on to
step END; mode ``straight`` trains steps 0..END-1 without a stop. Both save each worker's model in
OUT/<mode>-<rank>.pt, and the two must be equal bit for bit. Mode ``unasked`` trains as ``stop``
but never calls ``should_stop()``: a SIGTERM stops it at once, as without saved stops. Mode
``stop_loader`` is ``stop`` taking its batches from a DataLoader with a worker process, which
ignores SIGTERM (``keep_on_sigterm``, as docs/api.md shows) so that the loop can go on to its stop;
it returns after saving (status 0). Mode ``one_asks`` is ``stop`` with ``should_stop()`` asked on
the first worker alone, a loop the job cannot stop together: it fails, naming the worker that
did not ask. Mode ``lagging`` has an exchange every 8 steps (``local_steps``: after steps 7 and
15), the last worker taking 1.5 s a step and the first a moment: both ask ``should_stop()`` from
step 10 on, and the first reads its first vote after step 14, 6 s before the other has asked; it
must train its 16 steps and return.
"""

import signal
import sys
import time
from itertools import count
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from userloop import batch, make_model, sgd, train

import psgrad


def main() -> None:
    out, topology, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    end = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    out.mkdir(parents=True, exist_ok=True)
    psgrad.init(topology=topology, codec="topk:ratio=0.2", feedback="ef", local_steps=8 if mode == "lagging" else 0)
    model = make_model()
    opt = psgrad.DistributedOptimizer(sgd(model), model)
    saved = out / f"ckpt-{psgrad.rank()}.pt"
    if mode == "stop_loader":
        return stop_loader(model, opt, saved)
    if mode in ("stop", "unasked", "one_asks"):
        asks = mode == "stop" or (mode == "one_asks" and psgrad.worker_index() == 0)
        for step in count():
            train(model, opt, [step])
            if step == 3:
                print(f"worker {psgrad.worker_index()} trains", file=sys.stderr, flush=True)
            if asks and psgrad.should_stop():
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, saved)
                sys.exit(143)  # the signal's status, for the scheduler
        return
    if mode == "lagging":
        for step in range(16):
            train(model, opt, [step])
            time.sleep(1.5 if psgrad.worker_index() == psgrad.num_workers() - 1 else 0)
            assert step < 10 or not psgrad.should_stop()
        return
    start = 0
    if mode == "resume":
        state = torch.load(saved, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"] + 1
    train(model, opt, range(start, end))
    torch.save(model.state_dict(), out / f"{mode}-{psgrad.rank()}.pt")


def keep_on_sigterm(worker_id: int) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a scheduler's SIGTERM: the loop saves, then ends


def stop_loader(model, opt, saved: Path) -> None:
    images, labels = batch(psgrad.worker_index(), 0)
    data = TensorDataset(images.repeat(64, 1, 1, 1), labels.repeat(64))
    # one batch ahead: the stop, some steps after the signal, needs batches the worker made after it
    loader = DataLoader(data, batch_size=8, num_workers=1, prefetch_factor=1, worker_init_fn=keep_on_sigterm)
    for epoch in count():
        for step, (x, y) in enumerate(loader):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            if epoch == 1 and step == 20:  # the loader's worker is well under way
                print(f"worker {psgrad.worker_index()} trains", file=sys.stderr, flush=True)
            if epoch >= 1 and step >= 20:
                time.sleep(0.3)  # a step as long as a real one: the stop comes a few batches later
            if psgrad.should_stop():
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, saved)
                return


if __name__ == "__main__":
    main()
