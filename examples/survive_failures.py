"""Keep training when a worker dies: worker 1 kills itself once, mid-fit; the fit recovers
from a restore point with a warm spare and ends with the uninterrupted run's parameters.

    python examples/survive_failures.py
"""

import os
import signal
import tempfile

import torch
import torch.distributed as dist
from _common import epochs, loaders
from torch import nn

from paraloom import ParallelWrapper
from paraloom.models import LeNet


class DiesOnce(nn.Module):
    """LeNet whose worker 1 is killed (SIGKILL) at its 20th step, once (a marker file)."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.net, self.marker, self.calls = LeNet(image_size=8), marker, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.marker and dist.is_initialized() and dist.get_rank() == 1:
            self.calls += 1
            if self.calls == 20 and not os.path.exists(self.marker):
                open(self.marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        return self.net(x)


def train(model: nn.Module, **options) -> ParallelWrapper:
    loader, _ = loaders()
    wrapper = ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(),
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.05,
                                                        momentum=0.9),
                              workers=2, training_mode="allreduce", progress=False, **options)
    with wrapper:
        wrapper.fit(loader, epochs=epochs(3) + 1)
    return wrapper


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = DiesOnce(os.path.join(tmp, "died"))
        wrapper = train(model, max_failures=2, heartbeat_timeout=1.0)
        for r in wrapper.recoveries:
            cause = str(r.error).split(";")[0]  # "worker 1 (pid N) was killed by SIGKILL"
            print(f"worker {r.rank} failed ({cause}); "
                  f"restarted in {r.restart_seconds:.3f} s, {r.replayed_rounds} rounds replayed, "
                  f"{r.redone_rounds} of them trained again")
        torch.manual_seed(0)
        clean = DiesOnce("")
        train(clean)
        same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                     clean.state_dict().values(), strict=True))
        print(f"failures survived {len(wrapper.recoveries)}; equals the fault-free run: {same}")
