"""DiLoCo: each replica trains alone for sync_every rounds, then sends the top 5% of what it
learned, in 8 bits. For slow links and long runs.

    python examples/slow_network_diloco.py
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
                         optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3),
                         workers=2, training_mode="diloco", sync_every=10,
                         progress=False) as wrapper:
        stats = wrapper.fit(train, epochs=epochs(15))
    dense = 4 * sum(p.numel() for p in model.parameters())
    sent = sum(stats["bytes_sent_per_step"]) / len(stats["bytes_sent_per_step"])
    print(f"bytes sent per step and worker {sent:.0f} (all-reduce: {dense}, "
          f"1/{dense / sent:.0f})")
    print(f"test accuracy {evaluate(model, test).accuracy:.4f}")
