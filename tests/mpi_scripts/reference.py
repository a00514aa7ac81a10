"""Under mpiexec: psgrad with codec `none` == plain averaged SGD in one process (rank 0 checks).

Arguments: one scenario each, ``NAME=FLAGS`` (FLAGS space-separated, below); the scenarios run one
after another in the same job, and rank 0 prints ``REFERENCE OK NAME`` or ``REFERENCE FAILED NAME:
why`` for each (the job exits 1 if any failed).

``--alltoall`` / ``--colocated``: every rank is a worker (and with colocated, also a server).

``--shared-randomk``: random-k with coordinates shared by the workers (``shared=1``) equals SGD
on the workers' averaged gradient kept at those coordinates (layers that travel exactly: whole).

``--powersgd``: PowerSGD rank 2 equals the paper's algorithm written out below (per-worker
gradients, error feedback, warm start, Gram-Schmidt as QR with a positive diagonal);
``--powersgd-full``: at full rank (every matrix factored exactly) it equals plain averaged SGD.

``--sign-one-step [--no-bucket-vectors]``: one step with the lossy sign codec both ways. The 1-D
parameters travel exactly in their own bucket, so they must equal the reference while every
weight matrix must differ; without the bucket the biases are sign-coded and differ too.
"""

import sys

import torch
from small_mlp import SETTINGS

from psgrad.codecs import make_codec
from psgrad.comm.protocol import SHARED_STREAM, message_seed, plan_layers
from psgrad.comm.transport import world_rank, world_size
from psgrad.config import RunConfig
from psgrad.data import ShardLoader, load_dataset
from psgrad.models import build_model
from psgrad.train import run

FLAGS = {
    "--nesterov",
    "--model-granularity",
    "--push-after",
    "--delta-down",
    "--alltoall",
    "--colocated",
    "--serve-thread",
    "--sign-one-step",
    "--no-bucket-vectors",
    "--shared-randomk",
    "--powersgd",
    "--powersgd-full",
}


def check(flags: list[str]) -> None:
    sign_one_step = "--sign-one-step" in flags
    bucket = "--no-bucket-vectors" not in flags
    alltoall = "--alltoall" in flags
    colocated = "--colocated" in flags
    steps = 1 if sign_one_step else 6
    kw = dict(SETTINGS, steps=steps)
    nesterov = "--nesterov" in flags
    granularity = "model" if "--model-granularity" in flags else "layer"
    push = "after" if "--push-after" in flags else "backward"
    # a down-codec that keeps everything: the workers follow the server through deltas, not values
    down = "topk:ratio=1.0" if "--delta-down" in flags else "none"
    codec = "none"
    shared_randomk = "--shared-randomk" in flags
    if shared_randomk:
        codec = "randomk:ratio=0.3,shared=1"
    if sign_one_step:
        codec, down = "sign", "sign"
    powersgd = "--powersgd" in flags
    if powersgd:
        codec = "powersgd:rank=2"
    if "--powersgd-full" in flags:
        codec = "powersgd:rank=64,min_rate=0"
    cfg = RunConfig(
        **kw,
        nesterov=nesterov,
        granularity=granularity,
        push=push,
        codec=codec,
        down_codec=down,
        bucket_vectors=bucket,
        topology="alltoall" if alltoall else "colocated" if colocated else "ps",
        serve_thread="--serve-thread" in flags,
    )
    result = run(cfg)
    if world_rank() == 0:
        workers = world_size() if alltoall or colocated else world_size() - 1
        torch.manual_seed(cfg.seed)
        model = build_model("mlp", 10)
        opt = torch.optim.SGD(
            model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, nesterov=nesterov
        )
        data = load_dataset("synthetic", "train", synthetic_size=256, seed=cfg.seed)
        loaders = [
            ShardLoader(data, dataset="synthetic", worker=w, workers=workers, batch_size=cfg.batch_size, seed=cfg.seed)
            for w in range(workers)
        ]
        layers = plan_layers(
            [(n, tuple(p.shape)) for n, p in model.named_parameters()],
            granularity=granularity,
            owners=1,
            bucket_vectors=bucket,
        )
        params = dict(model.named_parameters())
        error: dict[str, list] = {}  # PowerSGD: each worker's error memory, and the shared Q
        q_of: dict[str, torch.Tensor] = {}

        def orthonormal(a: torch.Tensor) -> torch.Tensor:
            q, r = torch.linalg.qr(a)
            return q * torch.sign(torch.diagonal(r))  # Gram-Schmidt's signs: R's diagonal positive

        for step in range(steps):
            opt.zero_grad()
            grads = []  # per worker, for PowerSGD
            for loader in loaders:
                x, y = loader.batch(step)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                if powersgd:
                    opt.zero_grad()
                    loss.backward()
                    grads.append({n: p.grad.clone() for n, p in params.items()})
                else:
                    (loss / workers).backward()
            for layer in layers if powersgd else []:
                if not layer.compress:
                    for name in layer.params:
                        params[name].grad = sum(g[name] for g in grads) / workers
                    continue
                (name,) = layer.params
                shape = params[name].shape
                n = shape[0]
                ms = [g[name].reshape(n, -1) + error.get(name, [0] * workers)[w] for w, g in enumerate(grads)]
                if name not in q_of:
                    seed = message_seed(cfg.seed, step, layer.index, SHARED_STREAM)
                    gen = torch.Generator().manual_seed(seed)
                    q_of[name] = torch.randn(ms[0].shape[1], 2, generator=gen)
                q = orthonormal(q_of[name])
                p_hat = orthonormal(sum(m @ q for m in ms))
                q_mean = sum(m.t() @ p_hat for m in ms) / workers
                approx = p_hat @ q_mean.t()
                error[name] = [m - approx for m in ms]
                q_of[name] = q_mean
                params[name].grad = approx.view(shape)
            for layer in layers if shared_randomk else []:
                if not layer.compress:
                    continue
                (name,) = layer.params
                seed = message_seed(cfg.seed, step, layer.index, SHARED_STREAM)
                kept = make_codec(codec)._kept(params[name].numel(), seed, torch.device("cpu"))
                mask = torch.zeros(params[name].numel())
                mask[kept] = 1.0
                params[name].grad.mul_(mask.view(params[name].shape))
            opt.step()
        for name, p in model.named_parameters():
            if sign_one_step and (p.dim() > 1 or not bucket):
                assert not torch.allclose(result.params[name], p.detach(), rtol=1e-5, atol=1e-6), (
                    f"{name} was not coded"
                )
            else:
                torch.testing.assert_close(result.params[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


failed = []
for scenario in sys.argv[1:]:
    name, _, flags = scenario.partition("=")
    unknown = set(flags.split()) - FLAGS
    if unknown:
        sys.exit(f"reference.py: unknown flags {sorted(unknown)} in scenario {name!r}")
    try:
        check(flags.split())
    except AssertionError as err:
        failed.append(name)
        print(f"REFERENCE FAILED {name}: {err}", flush=True)
    else:
        if world_rank() == 0:
            print(f"REFERENCE OK {name}", flush=True)
sys.exit(1 if failed else 0)
