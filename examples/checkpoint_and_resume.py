"""Write checkpoints while training, then resume from the newest one: the result equals an
uninterrupted run's.

    python examples/checkpoint_and_resume.py
"""

import tempfile

import torch
from _common import epochs, loaders
from torch import nn

from paraloom import ParallelWrapper
from paraloom.listeners import CheckpointListener
from paraloom.models import LeNet


def wrapper(model: nn.Module, *listeners: CheckpointListener) -> ParallelWrapper:
    return ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(),
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                           workers=2, training_mode="allreduce", progress=False,
                           listeners=list(listeners))


if __name__ == "__main__":
    total = epochs(4) + 1
    with tempfile.TemporaryDirectory() as runs:
        torch.manual_seed(0)
        first = LeNet(image_size=8)
        train, _ = loaders()
        with wrapper(first, CheckpointListener(runs, every_n_epochs=1)) as w:
            w.fit(train, epochs=total - 1)  # as if interrupted one epoch short
        torch.manual_seed(1)
        resumed = LeNet(image_size=8)  # another process would start from scratch like this
        train, _ = loaders()
        with wrapper(resumed) as w:
            w.fit(train, epochs=total, resume_from=runs)
        torch.manual_seed(0)
        straight = LeNet(image_size=8)
        train, _ = loaders()
        with wrapper(straight) as w:
            w.fit(train, epochs=total)
        same = all(torch.equal(a, b) for a, b in zip(resumed.state_dict().values(),
                                                     straight.state_dict().values(), strict=True))
        print(f"resumed equals uninterrupted: {same}")
