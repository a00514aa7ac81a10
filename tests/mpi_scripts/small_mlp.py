"""The small run the reference scripts train and recompute in one process: an MLP on a few
synthetic samples, SGD with momentum and weight decay (reference.py, gossip.py)."""

SETTINGS = dict(
    model="mlp",
    batch_size=8,
    synthetic_size=256,
    lr=0.05,
    momentum=0.9,
    weight_decay=5e-4,
    progress=False,
    seed=3,
)
