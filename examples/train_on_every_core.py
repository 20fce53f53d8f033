"""Train an existing model on 2 worker processes with parameter averaging (DL4J's default).

    python examples/train_on_every_core.py
"""

import torch
from _common import epochs, loaders
from torch import nn

from paraloom import ParallelWrapper
from paraloom.evaluation import evaluate
from paraloom.models import LeNet

if __name__ == "__main__":
    torch.manual_seed(0)
    model = LeNet(image_size=8)
    train, test = loaders()
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(),
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                         workers=2, training_mode="averaging", averaging_frequency=3,
                         progress=False) as wrapper:
        stats = wrapper.fit(train, epochs=epochs(10))
    print(f"samples/s {stats['samples_per_s']:.0f}")
    print(f"test accuracy {evaluate(model, test).accuracy:.4f}")
