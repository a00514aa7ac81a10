"""psgrad's codecs as a DDP communication hook, on gloo, without MPI.

Usage: python ddphook.py OUT RANK WORLD SCENARIO [CODEC] [FEEDBACK]   (one process per rank; the
ranks meet through a file store in OUT)

Scenario ``dense``: the hook with codec CODEC against DDP without a hook, same seed and data; and
against torch's own PowerSGD hook (``torch_powersgd``), both at a rank that makes the
approximation exact. Scenario ``resume``: a checkpoint round trip mid-run (model, SGD and the
hook's ``state_dict``) ends where the uninterrupted run does. Scenario ``nonfinite``: the last
rank's gradient turns NaN at step 3; every rank must raise, none may wait. Scenario ``overlap``:
DDP in several buckets, the last rank 1.5 s late into one backward; the first rank's hook must hand
DDP every bucket of that step back pending (the late rank has sent nothing yet), and the run must
still end where DDP without a hook does. Scenario ``subgroup`` (three ranks): DDP over ranks 0
and 1 only, with and without the hook; rank 2 waits at the final barrier.
Each rank writes OUT/rank<r>.json.
"""

import copy
import gc
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

import psgrad

STEPS, CUT, BATCH = 10, 4, 8
LATE, LATE_AT = 1.5, 2  # seconds the last rank starts one backward late, and at which step


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 16), nn.ReLU(), nn.Linear(16, 10)
    )


def batch(rank: int, step: int):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, 3, 8, 8, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen)


def train(
    model: nn.Module, opt: torch.optim.Optimizer, steps, *, poison_at: int = -1, late_at: int = -1, device="cpu"
) -> None:
    last = dist.get_rank() == dist.get_world_size() - 1
    for step in steps:
        opt.zero_grad()
        images, labels = (t.to(device) for t in batch(dist.get_rank(), step))
        if step == poison_at and last:
            images = images * float("nan")
        loss = F.cross_entropy(model(images), labels)
        if step == late_at and last:
            time.sleep(LATE)
        loss.backward()
        opt.step()


def trained(hook=None, state=None, steps=range(STEPS), late_at: int = -1, device="cpu", **ddp_options) -> nn.Module:
    ddp = nn.parallel.DistributedDataParallel(make_model().to(device), **ddp_options)
    if hook is not None:
        ddp.register_comm_hook(ddp if state is None else state, hook)
    train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9), steps, late_at=late_at, device=device)
    module = ddp.module
    del ddp  # the reducer goes before the process group (see leave)
    gc.collect()
    return module


def largest_difference(a: nn.Module, b: nn.Module) -> float:
    return max(float((x - y).detach().abs().max()) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def scenario_dense(codec: str, feedback: str) -> dict:
    plain = trained()
    ours = trained(psgrad.ddp_hook(codec, feedback=feedback))
    state = powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=16, min_compression_rate=0, start_powerSGD_iter=2
    )
    theirs = trained(powerSGD_hook.powerSGD_hook, state=state)
    return {"plain": largest_difference(ours, plain), "torch_powersgd": largest_difference(ours, theirs)}


def scenario_resume(codec: str, feedback: str) -> dict:
    hook = psgrad.ddp_hook(codec, feedback=feedback)
    ddp = nn.parallel.DistributedDataParallel(make_model())
    ddp.register_comm_hook(ddp, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    train(ddp, opt, range(CUT))
    saved = copy.deepcopy({"model": ddp.state_dict(), "opt": opt.state_dict(), "hook": hook.state_dict()})
    train(ddp, opt, range(CUT, STEPS))
    first = [p.detach().clone() for p in ddp.parameters()]
    ddp.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    hook.load_state_dict(saved["hook"])
    train(ddp, opt, range(CUT, STEPS))
    resumed = max(float((a - p.detach()).abs().max()) for a, p in zip(first, ddp.parameters(), strict=True))
    memories = sum(1 for key in saved["hook"] if key != "step")
    del ddp
    gc.collect()
    return {"resumed": resumed, "memories": memories, "steps_saved": int(saved["hook"]["step"])}


def scenario_nonfinite(codec: str, feedback: str) -> dict:
    try:
        ddp = nn.parallel.DistributedDataParallel(make_model())
        ddp.register_comm_hook(ddp, psgrad.ddp_hook(codec, feedback=feedback))
        train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), range(STEPS), poison_at=3)
    except RuntimeError as err:
        return {"raised": str(err)}
    return {"raised": ""}


def scenario_overlap(codec: str, feedback: str) -> dict:
    hook, handed = psgrad.ddp_hook(codec, feedback=feedback), []

    def watched(state, bucket):
        step = hook.step  # the steps done before this call's
        future = hook(state, bucket)
        handed.append({"step": step, "pending": not future.done()})
        return future

    several = {"bucket_cap_mb": 0.01}  # 10 kB: a bucket or two a layer
    plain, ours = trained(**several), trained(watched, late_at=LATE_AT, **several)
    late = [call["pending"] for call in handed if call["step"] == LATE_AT]
    return {"plain": largest_difference(ours, plain), "buckets": len(late), "pending": sum(late)}


def scenario_subgroup(codec: str, feedback: str) -> dict:
    group = dist.new_group([0, 1])  # every rank makes it; only 0 and 1 train in it
    result = {"outside": True}
    if dist.get_rank() in (0, 1):
        plain = trained(process_group=group)
        ours = trained(psgrad.ddp_hook(codec, feedback=feedback, group=group), process_group=group)
        result = {"plain": largest_difference(ours, plain)}
    # a group every rank makes afterwards must still meet: the hook's group left the count of
    # groups, which names them, the same on the ranks outside DDP's
    ones = torch.ones(1)
    dist.all_reduce(ones, group=dist.new_group([0, 1, 2]))
    return {**result, "after": float(ones)}


def scenario_cuda(codec: str, feedback: str) -> dict:
    """The model on a GPU (the ranks share the GPUs there are): DDP without the hook, then with it."""
    device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    plain = trained(device=device)
    ours = trained(psgrad.ddp_hook(codec, feedback=feedback), device=device)
    return {"plain": largest_difference(ours, plain), "device": str(next(ours.parameters()).device)}


def scenario_hostcopy(codec: str, feedback: str) -> dict:
    """The GPU path's copies on the CPU: the hook exchanges a copy of each bucket (as it does a GPU
    bucket's host copy) and must write the average back into DDP's bucket, on its device."""
    from psgrad import ddpcomm

    ddpcomm.on_host = lambda buffer, *, written: buffer.clone()
    hook, handed = psgrad.ddp_hook(codec, feedback=feedback), []

    def watched(state, bucket):
        future = hook(state, bucket)
        handed.append((bucket.buffer(), future))
        return future

    plain, ours = trained(), trained(watched)
    into_bucket = all(future.wait().data_ptr() == buffer.data_ptr() for buffer, future in handed)
    return {"plain": largest_difference(ours, plain), "into_bucket": into_bucket, "buckets": len(handed)}


def scenario_buckets(codec: str, feedback: str) -> dict:
    """Two steps in DDP's default buckets, then two in small ones, of a model of 2.4 MiB in which no
    parameter holds half: rank 0 says, once, that the default's last bucket leaves nothing to overlap."""

    def wide() -> nn.Module:
        torch.manual_seed(0)
        hidden = [nn.Linear(512, 512) for _ in range(2)]
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 512), *hidden, nn.Linear(512, 10))

    for cap in (25, 0.25):
        ddp = nn.parallel.DistributedDataParallel(wide(), bucket_cap_mb=cap)
        ddp.register_comm_hook(ddp, psgrad.ddp_hook(codec, feedback=feedback))
        train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.01), range(2))
        del ddp
        gc.collect()
    return {}


def main() -> None:
    out, rank, world, scenario = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    codec = sys.argv[5] if len(sys.argv) > 5 else "none"
    feedback = sys.argv[6] if len(sys.argv) > 6 else "none"
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=world)
    scenarios = {
        "dense": scenario_dense,
        "resume": scenario_resume,
        "nonfinite": scenario_nonfinite,
        "overlap": scenario_overlap,
        "subgroup": scenario_subgroup,
        "buckets": scenario_buckets,
        "cuda": scenario_cuda,
        "hostcopy": scenario_hostcopy,
    }
    result = scenarios[scenario](codec, feedback)
    result["mpi_started"] = "mpi4py.MPI" in sys.modules  # the hook needs no MPI
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    leave()


def leave() -> None:
    """The barrier (no rank tears gloo down while another has a collective in flight), then the
    group. Every DDP reducer is gone by now: freed last by a reducer, the group's destructor
    would join gloo's threads with the GIL held (pytorch#56297)."""
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
