"""Share threshold-encoded updates instead of dense gradients: about 1/300 of the bytes.

    python examples/compressed_sharing.py
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
                         workers=2, training_mode="shared_gradients", progress=False) as wrapper:
        stats = wrapper.fit(train, epochs=epochs(10))
    dense = 4 * sum(p.numel() for p in model.parameters())  # a float32 all-reduce's payload
    sent = sum(stats["bytes_sent_per_step"]) / len(stats["bytes_sent_per_step"])
    print(f"bytes sent per step and worker {sent:.0f} (dense: {dense}, 1/{dense / sent:.0f})")
    print(f"test accuracy {evaluate(model, test).accuracy:.4f}")
