"""A small residual MLP and its training step, shared by the oarlock.debug tests (line markers are checked)."""

from pathlib import Path

import torch
import torch.nn.functional as F


class Block(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.ln = torch.nn.LayerNorm(dim)
        self.fc = torch.nn.Linear(dim, dim)

    def forward(self, x, extra: bool = False):
        h = self.ln(x)
        if extra:
            h = h * 1.0  # an extra op that keeps the values: the alignment test inserts it
        h = self.fc(h)  # FC_LINE
        return x + torch.relu(h)


class Net(torch.nn.Module):
    def __init__(self, dim: int = 16, layers: int = 3, classes: int = 5):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, x, extra_in: int | None = None):
        for i, layer in enumerate(self.layers):
            x = layer(x, extra=(i == extra_in))
        return self.head(x)


_SOURCE = Path(__file__).read_text().splitlines()
FC_LINE = next(i for i, line in enumerate(_SOURCE, 1) if line.endswith("# " + "FC_LINE"))
BACKWARD_LINE = next(i for i, line in enumerate(_SOURCE, 1) if line.endswith("# " + "BACKWARD_LINE"))


def make_inputs(perturb: bool = False):
    """(model, x, y) with fixed seeds; ``perturb`` moves layers.1.fc.weight[2, 3] up by one ulp."""
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(8, 16)
    y = torch.randint(0, 5, (8,))
    if perturb:
        with torch.no_grad():
            w = model.layers[1].fc.weight
            w[2, 3] = torch.nextafter(w[2, 3], torch.tensor(float("inf")))
    return model, x, y


def train_step(model, x, y, extra_in=None):
    loss = F.cross_entropy(model(x, extra_in), y)
    loss.backward()  # BACKWARD_LINE
    return loss
