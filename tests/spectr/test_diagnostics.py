"""The host-sync counter counts what would wait for a device, and nothing else."""

import torch

from spectr.diagnostics import HostSyncCounter


def test_device_only_work_counts_nothing():
    x = torch.rand(4, 8)
    with HostSyncCounter() as syncs:
        y = (x * 2).softmax(-1).cumsum(-1)
        idx = torch.searchsorted(y, torch.rand(4, 1))
        torch.where(x > 0.5, x, 0.0).sum(-1)
        y.gather(-1, idx.clamp(max=7))
        x[:, 1:3] = 0
    assert syncs.total == 0, syncs.by_kind


def test_each_host_read_counts_once():
    x = torch.rand(4, 8)
    with HostSyncCounter() as syncs:
        x[0, 0].item()
        x.tolist()
        bool((x > 2).any())
        x[x > 0.5]
        torch.nonzero(x > 0.5)
        torch.where(x > 0.5)
        x.to("cpu")
        x.cpu()
        int(x[0, 0] * 0)
    assert syncs.by_kind == {
        "item": 1, "tolist": 1, "bool": 1, "bool_index": 1, "nonzero": 2, "cpu": 2, "int": 1,
    }
    assert syncs.total == 9


def test_reads_inside_a_module_are_counted_apart_and_the_hooks_go_away():
    class Reads(torch.nn.Module):
        def forward(self, x):
            x.sum().item()  # a model's own host read
            return x * 2

    model = Reads()
    x = torch.rand(3)
    with HostSyncCounter().inside_module(model) as syncs:
        y = model(x)
        y.tolist()  # the caller's read
    assert syncs.by_kind == {"tolist": 1} and syncs.model_by_kind == {"item": 1}
    assert not model._forward_hooks and not model._forward_pre_hooks
