"""A warm fit() sends the model and optimizer state only when the user changed them."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from paraloom import ParallelWrapper
from paraloom.training.mirror import ReplicaMirror
from paraloom.training.optim import load_state_copying
from paraloom.training.transport import SharedOutbox

pytestmark = pytest.mark.timeout(120)


def _data(rows: int = 128) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 6, generator=g)
    y = (x[:, 0] > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=g)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_the_mirror_sees_every_kind_of_write():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()

    def mirror() -> ReplicaMirror:
        return ReplicaMirror(model, opt, pool=None)

    m = mirror()
    model(torch.randn(4, 6))  # a forward pass writes nothing
    assert m.model_unchanged(model) and m.optimizer_unchanged(opt)
    with torch.no_grad():
        model[0].weight.add_(0.0)  # same values, but an in-place write: counted as a change
    assert not m.model_unchanged(model)
    m = mirror()
    model[2].bias.data.copy_(torch.tensor([5.0, -5.0]))  # .data bypasses the version counter
    assert not m.model_unchanged(model)
    m = mirror()
    model[0].weight.data = torch.zeros(8, 6)  # new storage
    assert not m.model_unchanged(model)
    m = mirror()
    model.load_state_dict(_model().state_dict())
    assert not m.model_unchanged(model)
    m = mirror()
    opt.param_groups[0]["lr"] = 0.5  # hyperparameters are always sent, not compared
    assert m.optimizer_unchanged(opt)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()  # momentum buffers written in place
    assert not m.optimizer_unchanged(opt) and not m.model_unchanged(model)
    m = mirror()
    opt.state.clear()
    assert not m.optimizer_unchanged(opt)


def test_the_mirror_sees_values_moved_through_data_without_being_changed():
    # Rows of a 100-class head swapped through .data (a relabelling): the values' multiset
    # and the sampled positions are unchanged, so only a position-aware checksum sees it.
    torch.manual_seed(0)
    head = nn.Linear(64, 100)
    opt = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    (head(torch.randn(4, 64)) * torch.randn(4, 100)).sum().backward()  # rows of unlike grads
    opt.step()
    for swap in ([2, 4], [10, 50]):
        m = ReplicaMirror(head, opt, pool=None)
        head.weight.data[swap] = head.weight.data[swap[::-1]].clone()
        assert not m.model_unchanged(head)
    # Rows of 2,042 float32 values are 1,021 words, the checksum's row: swapped, the column
    # sums were the same, and the fit undid the user's edit (0.043 off, model_sent False).
    wide = nn.Linear(2042, 20)
    m = ReplicaMirror(wide, None, pool=None)
    wide.weight.data[[4, 8]] = wide.weight.data[[8, 4]].clone()  # rows no sample falls in
    assert not m.model_unchanged(wide)
    m = ReplicaMirror(head, opt, pool=None)
    momentum = opt.state[head.weight]["momentum_buffer"]
    momentum.data[[2, 4]] = momentum.data[[4, 2]].clone()
    assert not m.optimizer_unchanged(opt) and m.model_unchanged(head)


def test_stamps_sample_tensors_past_float32s_exact_integers():
    """BERT-base's embedding (30,522 x 768 = 23,440,896 elements): float32 sample positions
    rounded past the last element."""
    model = nn.Embedding(30522, 768)
    with torch.no_grad():
        model.weight[-1, -1] = 7.0
    mirror = ReplicaMirror(model, None, pool=None)
    assert mirror.model_unchanged(model)
    model.weight.data[-1, -1] = 8.0  # the last element is sampled: the write is seen
    assert not mirror.model_unchanged(model)
    mirror = ReplicaMirror(model, None, pool=None)
    model.weight.data[5].zero_()  # a row no sample falls in: the checksum sees it
    assert not mirror.model_unchanged(model)


def test_a_warm_fit_of_an_unchanged_model_sends_nothing_and_trains_the_same():
    """Leaving the model out must not change the result: compared with a fit() made to send
    it (a no-op in-place write marks the model changed). With allreduce every replica holds
    rank 0's optimizer state, so the two are bit-identical."""
    finals = []
    for force in (False, True):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), optimizer=opt, workers=2,
                             training_mode="allreduce", progress=False) as w:
            first = w.fit(_data(), epochs=1)
            assert first["model_sent"] and first["optimizer_state_sent"]
            if force:
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(1.0)
                    for state in opt.state.values():
                        state["momentum_buffer"].mul_(1.0)
            second = w.fit(_data(), epochs=1)
        assert second["model_sent"] is force and second["optimizer_state_sent"] is force
        finals.append(_params(model))
    for a, b in zip(*finals, strict=True):
        assert torch.equal(a, b)


def test_changes_between_fits_reach_the_replicas():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), optimizer=opt, workers=2,
                         training_mode="allreduce", progress=False) as w:
        w.fit(_data(), epochs=1)
        # A learning rate of 0 and no momentum left: the next fit() must not move anything.
        opt.param_groups[0]["lr"] = 0.0
        stats = w.fit(_data(), epochs=1)
        assert not stats["model_sent"] and not stats["optimizer_state_sent"]
        trained = _params(model)
        stats = w.fit(_data(), epochs=1)
        for a, b in zip(trained, _params(model), strict=True):
            assert torch.equal(a, b), "lr=0 was not applied on the replicas"
        # New weights written through .data, as old code does: sent, and kept by lr=0.
        for p in model.parameters():
            p.data.copy_(torch.full_like(p, 0.25))
        stats = w.fit(_data(), epochs=1)
        assert stats["model_sent"] and not stats["optimizer_state_sent"]
        assert all(torch.equal(p, torch.full_like(p, 0.25)) for p in model.parameters())
        # The optimizer's state replaced by the user: sent.
        opt.param_groups[0]["lr"] = 0.1
        opt.state.clear()
        stats = w.fit(_data(), epochs=1)
        assert stats["optimizer_state_sent"] and not stats["model_sent"]
        assert not torch.equal(next(model.parameters()), torch.full((8, 6), 0.25))


class _Tempered(nn.Module):
    """A linear layer divided by a non-persistent ``temp``, counting its training rows in a
    non-persistent ``seen``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(6, 2)
        self.register_buffer("temp", torch.tensor(1.0), persistent=False)
        self.register_buffer("seen", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen += x.shape[0]
        return self.linear(x) / self.temp


def test_non_persistent_buffers_travel_both_ways_as_in_a_plain_loop():
    model, reference = _Tempered(), _Tempered()
    with torch.no_grad():
        model.temp.fill_(4.0)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=1, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as w:
        w.fit(_data(32))
        assert float(model.seen) == 32.0  # what training left in it comes back
        model.temp.fill_(100.0)  # a value set between fits goes out with the next one
        stats = w.fit(_data(32))
        assert stats["model_sent"] and float(model.seen) == 64.0
    for temp in (4.0, 100.0):  # one epoch at each temperature, in one process
        with torch.no_grad():
            reference.temp.fill_(temp)
        for x, y in _data(32):
            opt.zero_grad()
            nn.functional.cross_entropy(reference(x), y).backward()
            opt.step()
    # Without the new temperature the second epoch would differ by ~1e-2.
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("mode", ["allreduce", "shared_gradients"])
@pytest.mark.parametrize("factory", [False, True], ids=["instance", "factory"])
def test_freezing_and_unfreezing_between_fits_applies(mode, factory):
    """Fine-tuning: the trainable set changes between fits (the workers restart for it)."""
    model = _model()
    opt = (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)) if factory else \
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), optimizer=opt, workers=2,
                         training_mode=mode, progress=False) as w:
        w.fit(_data(), epochs=1)
        pids = w.worker_pids
        model[0].requires_grad_(False)
        frozen, head = _params(model[0]), _params(model[2])
        w.fit(_data(), epochs=1)
        assert w.worker_pids != pids
        assert all(torch.equal(a, b) for a, b in zip(frozen, _params(model[0]), strict=True))
        assert not torch.equal(head[0], model[2].weight)
        pids = w.worker_pids
        w.fit(_data(), epochs=1)  # nothing changed: the same workers
        assert w.worker_pids == pids
        model[0].requires_grad_(True)
        w.fit(_data(), epochs=5)  # sharing moves about 1/160 of the elements per step
        assert any(not torch.equal(a, b)
                   for a, b in zip(frozen, _params(model[0]), strict=True))


def test_freezing_between_fits_applies_in_process_too():
    model = _model()
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=1, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as w:
        w.fit(_data(), epochs=1)
        model[2].requires_grad_(False)
        head = _params(model[2])
        w.fit(_data(), epochs=1)
        assert all(torch.equal(a, b) for a, b in zip(head, _params(model[2]), strict=True))


def test_a_param_group_added_between_fits_trains_with_its_settings():
    model = _model()
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), optimizer=opt, workers=2,
                         training_mode="allreduce", progress=False) as w:
        w.fit(_data(), epochs=1)
        model[0].requires_grad_(True)
        opt.add_param_group({"params": list(model[0].parameters()), "lr": 0.0})
        backbone = _params(model[0])
        stats = w.fit(_data(), epochs=1)
        assert stats["model_sent"] and stats["optimizer_state_sent"]
        # Trained with the new group's lr of 0: unmoved; its momentum exists now.
        assert all(torch.equal(a, b) for a, b in zip(backbone, _params(model[0]), strict=True))
        assert "momentum_buffer" in opt.state[model[0].weight]
        opt.param_groups[1]["lr"] = 0.1
        w.fit(_data(), epochs=1)
        assert not torch.equal(backbone[0], model[0].weight)


def test_a_new_pool_after_a_failure_gets_the_model_again():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), optimizer=opt, workers=2,
                         progress=False) as w:
        w.fit(_data(), epochs=1)
        with pytest.raises(Exception, match="expected|shape|size"):
            w.fit([(torch.randn(4, 3), torch.zeros(4, dtype=torch.long))], epochs=1)
        before = _params(model)
        stats = w.fit(_data(), epochs=1)
        assert stats["model_sent"]
        assert any(not torch.equal(a, b) for a, b in zip(before, _params(model), strict=True))


def test_the_outbox_reuses_its_shared_memory_and_reallocates_on_a_new_shape():
    outbox = SharedOutbox()
    state = {"w": torch.randn(3, 4), "opt": [torch.ones(2), 7]}
    first = outbox.copy(state)
    assert first["w"].is_shared() and torch.equal(first["w"], state["w"]) and first["opt"][1] == 7
    state["w"].add_(1.0)  # the copy is independent of the source
    assert not torch.equal(first["w"], state["w"])
    second = outbox.copy(state)
    assert second["w"].data_ptr() == first["w"].data_ptr()  # the same segment, refilled
    assert torch.equal(second["w"], state["w"])
    third = outbox.copy({"w": torch.zeros(5), "opt": [torch.ones(2), 7]})
    assert third["w"].shape == (5,) and third["w"].is_shared()
    assert third["opt"][0].data_ptr() == first["opt"][0].data_ptr()


def test_loading_optimizer_state_copies_into_the_optimizers_own_tensors():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    p = next(model.parameters())
    own = opt.state[p]["exp_avg"]
    other = torch.optim.Adam(model.parameters(), lr=0.1)
    other.load_state_dict(opt.state_dict())
    incoming = {k: v for k, v in other.state_dict().items()}
    for slot in incoming["state"].values():
        slot["exp_avg"] = slot["exp_avg"] + 1.0
    load_state_copying(opt, incoming)
    assert opt.state[p]["exp_avg"] is own  # updated in place, as step() does
    assert torch.equal(own, incoming["state"][0]["exp_avg"])
    incoming["state"][0]["exp_avg"].zero_()  # the sender's tensors are not kept
    assert not torch.equal(own, incoming["state"][0]["exp_avg"])
    fresh = torch.optim.Adam(model.parameters(), lr=0.1)  # no state yet: cloned
    load_state_copying(fresh, incoming)
    assert fresh.state[p]["exp_avg"] is not incoming["state"][0]["exp_avg"]
    assert torch.equal(fresh.state[p]["exp_avg"], incoming["state"][0]["exp_avg"])


@pytest.mark.parametrize("mode", ["allreduce", "shared_gradients"])
def test_the_users_optimizer_state_is_updated_in_place_and_owned(mode):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    p = next(model.parameters())
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), optimizer=opt, workers=2,
                         training_mode=mode, progress=False) as w:
        w.fit(_data(), epochs=1)
        buffer = opt.state[p]["momentum_buffer"]
        after_first = buffer.clone()
        w.fit(_data(), epochs=1)
        assert opt.state[p]["momentum_buffer"] is buffer and not buffer.is_shared()
        assert not torch.equal(buffer, after_first)
        kept = buffer.clone()
        w.fit(_data(), epochs=1)  # the worker refills its outbox: the user's copy moves on
        assert opt.state[p]["momentum_buffer"] is buffer and not torch.equal(buffer, kept)


def test_sharing_skips_the_parameter_broadcast_only_when_no_replica_changed():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), optimizer=opt, workers=2,
                         training_mode="shared_gradients", progress=False) as w:
        first = w.fit(_data(), epochs=1)["per_worker"][0]["setup_bytes_sent"]
        second = w.fit(_data(), epochs=1)["per_worker"][0]["setup_bytes_sent"]
        assert first > 0 and second == first  # the warm fit broadcast nothing (no buffers)
        with torch.no_grad():
            for q in model.parameters():
                q.fill_(0.01)
        stats = w.fit(_data(), epochs=1)
        assert stats["model_sent"] and stats["per_worker"][0]["setup_bytes_sent"] == 2 * first


def test_diloco_keeps_its_residuals_and_outer_momentum_across_warm_fits():
    """fit(1) twice is fit(2) when an epoch ends on a synchronization: the residuals (what
    the 5% messages left out) and the Nesterov momentum carry over (they restarted, so the
    second fit's first synchronization dropped both)."""
    from paraloom.sync import DiLoCo, nesterov_outer_optimizer

    finals = []
    for fits in ((1, 1), (2,)):
        model = _model()
        with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(),
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1), workers=2,
                             training_mode=DiLoCo(sync_every=2, density=0.05,
                                                  outer_optimizer=nesterov_outer_optimizer),
                             progress=False) as w:
            data = _data()  # one loader: its shuffling goes on from epoch to epoch
            for epochs in fits:  # 8 batches an epoch: 4 rounds, 2 synchronizations
                w.fit(data, epochs=epochs)
        finals.append(_params(model))
    for a, b in zip(*finals, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["diloco", "shared_gradients"])
def test_weights_loaded_between_fits_drop_the_old_trajectorys_leftovers(mode):
    """At lr 0 nothing may move the weights the user loaded: shared gradients sent the old
    residual (up to 0.026 off), DiLoCo would have stepped its outer momentum."""
    model = _model()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    options = {"sync_every": 2} if mode == "diloco" else {}
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), optimizer=opt, workers=2,
                         training_mode=mode, progress=False, **options) as w:
        w.fit(_data(), epochs=1)
        model.load_state_dict(start)
        opt.param_groups[0]["lr"] = 0.0
        stats = w.fit(_data(), epochs=1)
    assert stats["model_sent"]
    for name, value in model.state_dict().items():
        assert torch.equal(value, start[name]), name


@pytest.mark.parametrize("overlap", [False, True])
def test_two_shared_gradients_fits_end_where_one_longer_fit_does(overlap):
    """The replicas keep their residuals between fits and fit() returns the mean of their
    local views: to float rounding without overlap; with it, a fit collects its last exchange
    as it ends where one longer fit collects it a step later (measured 2e-3 apart)."""
    finals, batches = [], list(_data())
    for split in (False, True):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), optimizer=opt, workers=2,
                             training_mode="shared_gradients", overlap=overlap,
                             progress=False) as w:
            if split:
                w.fit(batches)
                assert not w.fit(batches)["model_sent"]
            else:
                w.fit(batches + batches)
        finals.append(_params(model))
    for a, b in zip(*finals, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-3 if overlap else 1e-6)
