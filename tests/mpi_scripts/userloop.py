"""Your own loop under psgrad, checked on every worker against what it must equal.

Usage: mpiexec -n N python userloop.py OUT SCENARIO TOPOLOGY CODEC [FEEDBACK] [DOWN_CODEC]

Scenario ``train``:

1. A small CNN and SGD with momentum, trained for STEPS steps by a plain torch loop with
   ``psgrad.DistributedOptimizer``; each worker takes its own batch of each step.
2. The same steps in one process without psgrad: each worker's batch's gradient, their mean,
   the same SGD (``reference``). With codec ``none`` the two must agree to float tolerance.
3. A checkpoint round trip at step CUT: the model and optimizer go back to what they saved there
   (``state_dict`` / ``load_state_dict``) and train the remaining steps again; they must end
   where they ended the first time, bit for bit.
4. With codec ``none``: torch DDP on gloo over the workers, same seed, data and SGD; psgrad must
   equal it to float tolerance.
Scenario ``run``: the same training in psgrad's own loop (``psgrad.train.run``, its servers
applying the same SGD), each rank saving its parameters; scenario ``against_run`` trains your loop
and must end where that run ended, bit for bit. Scenario ``hook``: the same training through torch DDP with ``psgrad.ddp_hook`` of the same
codec and feedback must equal psgrad's (the servers' sum of the same messages). Scenario
``accumulate``: two half batches a step (``backward_passes_per_step=2``) against the
reference on whole batches. Scenario ``clip``: ``synchronize()``, ``clip_grad_norm_``, then
``step()`` inside ``skip_synchronize()``, against the reference clipping the mean gradient.
Scenario ``scaler``: a loss scale (``GradScaler``): ``synchronize()``, ``unscale_``, then the
scaler's step inside ``skip_synchronize()``, against the reference. Scenario ``autocast``: forward
and backward inside a bf16 autocast block (psgrad's coding must stay fp32), against the same steps
without autocast, from the same state. Scenario ``no_optimizer``: every worker exits after
``init`` without a ``DistributedOptimizer`` (the job must end, status 0); ``one_optimizer``: only
the first worker builds one (the job must end, naming both). Scenario ``stall``: the second worker stops itself
(SIGSTOP) at step 3, with ``timeout=5``: the watchdog must end the job; ``busy``: it sleeps 9 s in
your loop instead (the job must go on, the watchdog naming it). Scenario ``forever``
trains until the job is interrupted; ``forever_saving`` as well, and its first worker then takes
3 s in a ``finally`` block to write OUT/saved; ``forever_loader`` takes its batches from a
DataLoader with a worker process. Scenario ``average``: the workers' mean of values and of
BatchNorm buffers; ``average_apart``: of values that differ in structure. Scenario ``misuse``: each
misuse must raise, and the loop go on after it. Scenario ``raise_all``: every worker raises the
same error at step 3.
Each worker writes OUT/rank<r>.json: the largest differences, or what raised.
"""

import copy
import gc
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import psgrad

STEPS, CUT, BATCH = 12, 5, 8
LOCAL_STEPS = 4  # an exchange every 4th step: 3 in STEPS


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 16), nn.ReLU(), nn.Linear(16, 10)
    )


def batch(worker: int, step: int):
    gen = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(BATCH, 3, 8, 8, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train(model, opt, steps, autocast: bool = False) -> None:
    for step in steps:
        opt.zero_grad()
        images, labels = batch(psgrad.worker_index(), step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            F.cross_entropy(model(images), labels).backward()
        opt.step()


def reference(workers: int, clip: float = 0.0) -> nn.Module:
    model = make_model()
    opt = sgd(model)
    for step in range(STEPS):
        grads = []
        for worker in range(workers):
            model.zero_grad()
            images, labels = batch(worker, step)
            F.cross_entropy(model(images), labels).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads, strict=True):
            p.grad = torch.stack(gs).mean(0)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model


def largest_difference(a: nn.Module, b: nn.Module) -> float:
    return max(float((x - y).detach().abs().max()) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def ddp(hook=None) -> nn.Module:
    """The same training under torch DDP on gloo, among the workers only (with ``hook``: DDP's
    communication through it)."""
    import torch.distributed as dist

    port = torch.tensor([_free_port() if psgrad.worker_index() == 0 else 0])
    psgrad.broadcast_parameters({"port": port})  # the first worker's free port, to every worker
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{int(port)}",
        rank=psgrad.worker_index(),
        world_size=psgrad.num_workers(),
    )
    model = nn.parallel.DistributedDataParallel(make_model())
    if hook is not None:
        model.register_comm_hook(model, hook)
    train(model, sgd(model), range(STEPS))
    # gloo torn down in the one order that cannot deadlock. DDP's reducer holds the process group;
    # freed last by the reducer, the group's destructor joins gloo's threads with the GIL held,
    # while a thread still finishing the last collective waits for the GIL (pytorch#56297): both
    # wait for ever. So the barrier (no worker tears gloo down while the other has a collective in
    # flight), then the reducer goes, in this frame (the only one holding the DDP module: passed
    # to a helper, it would outlive the group here), and the group last, through
    # ``destroy_process_group``, whose destructor lets the GIL go.
    dist.barrier()
    module = model.module
    del model
    gc.collect()
    dist.destroy_process_group()
    return module


def scenario_train(model: nn.Module, opt, codec: str) -> dict:
    train(model, opt, range(CUT))
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "opt": copy.deepcopy(opt.state_dict())}
    train(model, opt, range(CUT, STEPS))
    first = [p.detach().clone() for p in model.parameters()]
    result = {"reference": largest_difference(model, reference(psgrad.num_workers()))}
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    train(model, opt, range(CUT, STEPS))
    result["resumed"] = max(float((a - p.detach()).abs().max()) for a, p in zip(first, model.parameters(), strict=True))
    if codec == "none":  # DDP is the same training only without coding
        result["ddp"] = largest_difference(model, ddp())
    return result


def scenario_hook(model: nn.Module, opt, codec: str, feedback: str) -> dict:
    """psgrad's server path against DDP with ``psgrad.ddp_hook``: one codec, two doors."""
    train(model, opt, range(STEPS))
    return {"hook": largest_difference(model, ddp(psgrad.ddp_hook(codec, feedback=feedback)))}


def scenario_accumulate(model: nn.Module, opt) -> dict:
    for step in range(STEPS):
        opt.zero_grad()
        images, labels = batch(psgrad.worker_index(), step)
        for half in (slice(0, BATCH // 2), slice(BATCH // 2, BATCH)):
            (F.cross_entropy(model(images[half]), labels[half]) * 0.5).backward()
        opt.step()
    return {"reference": largest_difference(model, reference(psgrad.num_workers()))}


def scenario_clip(model: nn.Module, opt) -> dict:
    for step in range(STEPS):
        opt.zero_grad()
        images, labels = batch(psgrad.worker_index(), step)
        F.cross_entropy(model(images), labels).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        with opt.skip_synchronize():
            opt.step()
    return {"reference": largest_difference(model, reference(psgrad.num_workers(), clip=0.5))}


def scenario_scaler(model: nn.Module, opt) -> dict:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(STEPS):
        opt.zero_grad()
        images, labels = batch(psgrad.worker_index(), step)
        scaler.scale(F.cross_entropy(model(images), labels)).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
    return {"reference": largest_difference(model, reference(psgrad.num_workers()))}


def scenario_autocast(model: nn.Module, opt) -> dict:
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "opt": copy.deepcopy(opt.state_dict())}
    train(model, opt, range(STEPS), autocast=True)
    mixed = [p.detach().clone() for p in model.parameters()]
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    train(model, opt, range(STEPS))
    return {
        "autocast": max(float((a - p.detach()).abs().max()) for a, p in zip(mixed, model.parameters(), strict=True))
    }


def scenario_warmup(model: nn.Module, opt) -> dict:
    """DGC's sparsity warm-up (dgc_warmup_epochs=2, top-k 1 %): a worker's bytes in a step of
    epoch 0, and in one once ``set_epoch`` passed the warm-up."""

    def bytes_up(step: int) -> int:
        opt.zero_grad()
        images, labels = batch(psgrad.worker_index(), step)
        F.cross_entropy(model(images), labels).backward()
        opt.synchronize()
        sent = opt.worker.stats.bytes_up
        opt.step()
        return sent

    first = bytes_up(0)
    opt.set_epoch(2)
    return {"epoch0": first, "after": bytes_up(1)}


def raised(action) -> str:
    try:
        action()
    except (RuntimeError, ValueError) as err:
        return str(err)
    return ""


def scenario_average() -> dict:
    """``psgrad.average`` and ``average_buffers`` against the mean worked out here: worker k holds
    k + 1 (and BatchNorm buffers of k + 1), so the mean is (n + 1) / 2; counts stay the first
    worker's."""
    k, want = psgrad.worker_index(), (psgrad.num_workers() + 1) / 2
    got = psgrad.average(
        {"acc": float(k + 1), "t": torch.full((3,), k + 1.0), "count": torch.tensor(k), "pair": (k + 1, "w"),
         "numpy": np.float32(k + 1)}
    )  # fmt: skip
    bn = nn.BatchNorm1d(4)
    bn.running_mean.fill_(k + 1.0)
    bn.running_var.fill_(2.0 * (k + 1))
    bn.num_batches_tracked.fill_(7 + k)
    psgrad.average_buffers(bn)
    return {
        "acc": got["acc"] - want,
        "t": float((got["t"] - want).abs().max()),
        "count": int(got["count"]),
        "pair": [got["pair"][0] - want, got["pair"][1]],
        "numpy": got["numpy"] - want,
        "mean": float((bn.running_mean - want).abs().max()),
        "var": float((bn.running_var - 2 * want).abs().max()),
        "tracked": int(bn.num_batches_tracked),
    }


def scenario_misuse(model: nn.Module, opt) -> dict:
    images, labels = batch(psgrad.worker_index(), 0)

    def backward() -> None:
        F.cross_entropy(model(images), labels).backward()

    result = {}
    backward()
    result["zero_grad"] = raised(opt.zero_grad)
    result["second_backward"] = raised(backward)
    result["state_mid_step"] = raised(opt.state_dict)
    opt.step()
    backward()

    def unsynchronized_step() -> None:
        with opt.skip_synchronize():
            opt.step()

    result["skip_without_synchronize"] = raised(unsynchronized_step)
    opt.step()
    result["second_optimizer"] = raised(lambda: psgrad.DistributedOptimizer(sgd(model), model))
    train(model, opt, range(1, 3))  # and the loop goes on
    anothers = copy.deepcopy(opt.state_dict())
    anothers["psgrad"]["rank"] = (psgrad.rank() + 1) % psgrad.size()  # a file mixed up
    result["anothers_state"] = raised(lambda: opt.load_state_dict(anothers))
    train(model, opt, range(3, 4))  # nothing of it was loaded
    result["went_on"] = "yes"
    if psgrad.worker_index() == 0:  # the first worker's state reaches the others
        opt.param_groups[0]["lr"] = 0.123
    psgrad.broadcast_optimizer_state(opt.optimizer)
    result["broadcast_lr"] = opt.param_groups[0]["lr"]
    result["momentum_buffers"] = sum(1 for state in opt.state.values() if "momentum_buffer" in state)
    return result


class Batches:
    """psgrad's own loop's loader: the same batches, ``batch(worker, step)``."""

    def __init__(self, worker: int, workers: int) -> None:
        self.worker, self.steps_per_epoch = worker, STEPS

    def batch(self, step: int):
        return batch(self.worker, step)


def psgrad_train(out: Path, topology: str, codec: str, feedback: str, local_steps: int = 0) -> None:
    """Scenario ``run``: the same training through psgrad's own loop (``psgrad.train.run``), the
    servers applying the same SGD (``run_local``: the workers, between the servers' outer steps);
    each rank saves its parameters in OUT/run<rank>.pt."""
    from psgrad.config import RunConfig
    from psgrad.train import run

    cfg = RunConfig(
        topology=topology, codec=codec, feedback=feedback, lr=0.1, steps=STEPS, progress=False, local_steps=local_steps
    )
    result = run(
        cfg,
        model_fn=make_model,
        loader_fn=Batches,
        eval_data=[batch(0, 0)],
        optimizer_fn=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    )
    torch.save(result.params, out / f"run{result.rank}.pt")  # a worker's copy, or a server's values


def scenario_against_run(model: nn.Module, opt, out: Path) -> dict:
    """Your loop against psgrad's own loop (scenario ``run``, saved in OUT/run<rank>.pt): the same
    messages, the same sums, the same SGD, on the workers or on the servers."""
    train(model, opt, range(STEPS))
    theirs = torch.load(out / f"run{psgrad.rank()}.pt", weights_only=True)
    return {"run": max(float((p.detach() - theirs[name]).abs().max()) for name, p in model.named_parameters())}


def step_changing_grad(model: nn.Module, opt, step: int) -> float:
    """Step ``step`` of ``train``: how far ``.grad`` after ``step()`` is from what backward left."""
    opt.zero_grad()
    images, labels = batch(psgrad.worker_index(), step)
    F.cross_entropy(model(images), labels).backward()
    backward = [p.grad.clone() for p in model.parameters()]
    opt.step()
    return max(float((g - p.grad).abs().max()) for g, p in zip(backward, model.parameters(), strict=True))


def scenario_against_run_local(model: nn.Module, opt, out: Path) -> dict:
    """Local steps in your loop against ``psgrad train --local-steps`` (scenario ``run_local``):
    the same changes, the same sums, the same outer steps; ``.grad`` after an exchange is the
    gradient backward left; and a checkpoint taken between two exchanges resumes them exactly
    (theta_sync, the outer momentum, the steps since)."""
    train(model, opt, range(CUT))
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "opt": copy.deepcopy(opt.state_dict())}
    train(model, opt, range(CUT, STEPS - 1))
    grad_changed = step_changing_grad(model, opt, STEPS - 1)  # an exchange step (STEPS is a multiple of H)
    first = [p.detach().clone() for p in model.parameters()]
    theirs = torch.load(out / f"run{psgrad.rank()}.pt", weights_only=True)
    result = {"run": max(float((p.detach() - theirs[name]).abs().max()) for name, p in model.named_parameters())}
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    result["apart"] = float((flat - psgrad.average(flat)).abs().max())  # the workers' parameters agree
    result["grad_changed"] = grad_changed
    per_step = copy.deepcopy(saved["opt"])
    del per_step["psgrad"]["local"]  # what a DistributedOptimizer without local steps saves
    result["per_step_state"] = raised(lambda: opt.load_state_dict(per_step))
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    train(model, opt, range(CUT, STEPS))
    result["resumed"] = max(float((a - p.detach()).abs().max()) for a, p in zip(first, model.parameters(), strict=True))
    return result


def main() -> None:
    out, scenario, topology, codec = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    feedback = sys.argv[5] if len(sys.argv) > 5 else "none"
    down = sys.argv[6] if len(sys.argv) > 6 else "none"
    out.mkdir(parents=True, exist_ok=True)
    if scenario in ("run", "run_local"):
        return psgrad_train(out, topology, codec, feedback, local_steps=LOCAL_STEPS if scenario == "run_local" else 0)
    settings = (
        {"dgc_warmup_epochs": 2} if scenario == "warmup" else {"timeout": 5} if scenario in ("stall", "busy") else {}
    )
    if scenario == "against_run_local":
        settings = {"local_steps": LOCAL_STEPS}
    psgrad.init(topology=topology, codec=codec, feedback=feedback, down_codec=down, **settings)
    # only workers get here
    if scenario == "no_optimizer" or (scenario == "one_optimizer" and psgrad.worker_index() == 1):
        sys.exit(0)  # a script that ends after init without training (its own --help, a dry run)
    model = make_model()
    passes = 2 if scenario == "accumulate" else 1
    opt = psgrad.DistributedOptimizer(sgd(model), model, backward_passes_per_step=passes)
    psgrad.broadcast_parameters(model.state_dict())
    if scenario == "train":
        result = scenario_train(model, opt, codec)
    elif scenario == "against_run":
        result = scenario_against_run(model, opt, out)
    elif scenario == "against_run_local":
        result = scenario_against_run_local(model, opt, out)
    elif scenario == "hook":
        result = scenario_hook(model, opt, codec, feedback)
    elif scenario == "accumulate":
        result = scenario_accumulate(model, opt)
    elif scenario == "clip":
        result = scenario_clip(model, opt)
    elif scenario == "scaler":
        result = scenario_scaler(model, opt)
    elif scenario == "warmup":
        result = scenario_warmup(model, opt)
    elif scenario == "autocast":
        result = scenario_autocast(model, opt)
    elif scenario in ("stall", "busy"):
        for step in range(STEPS):
            if step == 3 and psgrad.worker_index() == 1:
                os.kill(os.getpid(), signal.SIGSTOP) if scenario == "stall" else time.sleep(9)
            train(model, opt, [step])
        result = {}
    elif scenario == "raise_all":  # every worker raises the same error at step 3
        for step in range(STEPS):
            if step == 3:
                raise ValueError("the same error on every worker")
            train(model, opt, [step])
    elif scenario == "average":
        result = scenario_average()
    elif scenario == "average_apart":  # the workers pass values of different structures
        result = psgrad.average({"loss" if psgrad.worker_index() == 0 else "acc": 1.0})
    elif scenario in ("forever", "forever_saving"):  # until Ctrl-C, saying when it has taken steps
        try:
            for step in range(10**9):
                train(model, opt, [step % STEPS])
                if step == 3:
                    print(f"worker {psgrad.worker_index()} trains", file=sys.stderr, flush=True)
        finally:
            if scenario == "forever_saving" and psgrad.worker_index() == 0:  # a slow save, on one worker
                time.sleep(3)
                (out / "saved").write_text("saved")
        result = {}
    elif scenario == "forever_loader":  # until stopped, taking its batches from a DataLoader's worker process
        from torch.utils.data import DataLoader, TensorDataset

        images, labels = batch(psgrad.worker_index(), 0)
        loader = DataLoader(
            TensorDataset(images.repeat(64, 1, 1, 1), labels.repeat(64)), batch_size=BATCH, num_workers=1
        )
        for step in range(10**9):
            for images, labels in loader:
                opt.zero_grad()
                F.cross_entropy(model(images), labels).backward()
                opt.step()
            if step == 1:
                print(f"worker {psgrad.worker_index()} trains", file=sys.stderr, flush=True)
        result = {}
    elif scenario == "uneven":  # the last worker takes one step more: the job must end, not hang
        train(model, opt, range(STEPS + (psgrad.worker_index() == psgrad.num_workers() - 1)))
        result = {}
    else:
        result = scenario_misuse(model, opt)
    (out / f"rank{psgrad.rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
