"""Wide Residual Networks (Zagoruyko & Komodakis, 2016) for 32x32 inputs: depth 6n+4, width k."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..choices import wrn_depth_problem


class _Block(nn.Module):
    """Pre-activation basic block: BN-ReLU-conv3x3-(dropout)-BN-ReLU-conv3x3, 1x1 conv shortcut on shape change."""

    def __init__(self, cin: int, cout: int, stride: int, dropout: float) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.dropout = dropout
        self.shortcut = None if cin == cout and stride == 1 else nn.Conv2d(cin, cout, 1, stride, 0, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(x))
        # the shortcut reads the activated input when it has to change shape (as in the paper's code)
        shortcut = x if self.shortcut is None else self.shortcut(out)
        out = self.conv1(out)
        out = F.relu(self.bn2(out))
        if self.dropout:
            out = F.dropout(out, p=self.dropout, training=self.training)
        return self.conv2(out) + shortcut


class WideResNet(nn.Module):
    def __init__(self, depth: int = 16, widen_factor: int = 4, num_classes: int = 100, dropout: float = 0.0) -> None:
        super().__init__()
        if (problem := wrn_depth_problem(depth)) is not None:
            raise ValueError(problem)
        if widen_factor < 1:
            raise ValueError(f"widen factor must be >= 1, got {widen_factor}")
        n = (depth - 4) // 6
        widths = [16, 16 * widen_factor, 32 * widen_factor, 64 * widen_factor]
        self.conv1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        blocks = []
        cin = widths[0]
        for stage, cout in enumerate(widths[1:]):
            for i in range(n):
                blocks.append(_Block(cin, cout, 2 if stage > 0 and i == 0 else 1, dropout))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.bn = nn.BatchNorm2d(cin)
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn(self.blocks(self.conv1(x))))
        return self.fc(F.adaptive_avg_pool2d(out, 1).flatten(1))
