"""Batches that are not tensors, tuples or dicts, and the train mode at every fit()."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from paraloom import ParallelWrapper

_SCRIPT = '''
from collections import namedtuple
from dataclasses import dataclass
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from paraloom import ParallelWrapper

Batch = namedtuple("Batch", ["x", "y"])

@dataclass
class Sample:
    x: torch.Tensor
    y: torch.Tensor

class Rows(Dataset):
    def __init__(self):
        self.x = torch.randn(40, 4); self.y = (self.x[:, 0] > 0).long()
    def __len__(self):
        return 40
    def __getitem__(self, i):
        return Sample(self.x[i], self.y[i])

def collate(rows):
    return Batch(torch.stack([r.x for r in rows]), torch.stack([r.y for r in rows]))

if __name__ == "__main__":
    loader = DataLoader(Rows(), batch_size=10, num_workers=1, collate_fn=collate)
    with ParallelWrapper(nn.Linear(4, 2), loss_fn=nn.CrossEntropyLoss(), workers=2,
                         optimizer=lambda p: torch.optim.SGD(p, lr=0.1), progress=False,
                         timeout=30) as w:
        print("samples", w.fit(loader, epochs=2)["samples"])
'''


def test_loader_processes_send_back_batches_of_classes_from_the_script(tmp_path):
    """A namedtuple batch (collate_fn) and dataclass samples (the dataset's __getitem__),
    both from the user's script: the loader processes could not pickle them back, and the
    fit waited on them until its timeout."""
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["samples", "80"]


@dataclass
class _Batch:
    x: torch.Tensor
    y: torch.Tensor


def _collate(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> _Batch:
    return _Batch(torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]))


def _object_step(model: nn.Module, batch: _Batch) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch.x), batch.y)


def test_a_step_fn_takes_a_batch_object_and_its_rows_are_counted():
    x = torch.randn(40, 4)
    loader = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=10,
                        collate_fn=_collate)
    for workers in (1, 2):
        with ParallelWrapper(nn.Linear(4, 2), step_fn=_object_step, workers=workers,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                             progress=False) as w:
            assert w.fit(loader)["samples"] == 40  # the first tensor among its attributes


def _eval_after(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    was_training = float(model.training)
    loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
    model.eval()  # an evaluation pass in the step that does not switch back
    return loss * 0 + was_training


def test_every_fit_starts_the_replicas_in_train_mode():
    x = torch.randn(10, 4)
    data = [(x, (x[:, 0] > 0).long())]
    for workers in (1, 2):
        seen: list[float] = []
        with ParallelWrapper(nn.Linear(4, 2), step_fn=_eval_after, workers=workers,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1), progress=False,
                             listeners=[lambda i, e, loss, seen=seen: seen.append(loss)]) as w:
            w.fit(data)
            w.fit(data)  # the same replicas, left in eval by the last step
        assert seen == [1.0, 1.0]
