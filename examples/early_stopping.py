"""Train epoch by epoch until the test accuracy stops improving, keeping the best model.

    python examples/early_stopping.py
"""

import torch
from _common import QUICK, loaders
from torch import nn

from paraloom import EarlyStoppingConfig, EarlyStoppingParallelTrainer
from paraloom.early_stopping import AccuracyCalculator, MaxEpochs, ScoreImprovement
from paraloom.models import LeNet

if __name__ == "__main__":
    torch.manual_seed(0)
    model = LeNet(image_size=8)
    train, test = loaders()
    config = EarlyStoppingConfig(
        epoch_conditions=[MaxEpochs(2 if QUICK else 30), ScoreImprovement(patience=3)],
        score_calculator=AccuracyCalculator(test))
    trainer = EarlyStoppingParallelTrainer(
        config, model, train, loss_fn=nn.CrossEntropyLoss(),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), workers=2,
        progress=False)
    result = trainer.fit()
    print(f"stopped: {result.termination_reason} after {result.total_epochs} epochs")
    print(f"best epoch {result.best_epoch}, test accuracy {result.best_score:.4f}")
