"""curation/core/flat_weights.py: a model's weights between the device and the host in one copy per dtype, checked on
the CPU with a GPU run's branches taken (the host-read counter's stand-in device, bench/host_reads.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bench.host_reads import HostReadCounter
from curation.core.flat_weights import FlatStaging, device_to_host, load_state_flat


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    m[2].to(torch.bfloat16)  # two dtypes: two flat copies
    return m


def test_a_flat_load_on_the_device_equals_load_state_dict_and_reuses_its_staging():
    source, target, expected = _model(0), _model(1), _model(1)
    expected.load_state_dict(source.state_dict())
    staging = FlatStaging()
    with HostReadCounter() as counter:
        counter.place(target)
        load_state_flat(target, source.state_dict(), staging=staging)
        first = {dtype: buf.data_ptr() for dtype, buf in staging._buffers.items()}
        load_state_flat(target, _model(2).state_dict(), staging=staging)  # the next version: the same buffers
        load_state_flat(target, source.state_dict(), staging=staging)
        host = device_to_host(target.state_dict())
    assert set(first) == {torch.float32, torch.bfloat16}
    assert {dtype: buf.data_ptr() for dtype, buf in staging._buffers.items()} == first
    for name, t in expected.state_dict().items():
        assert torch.equal(target.state_dict()[name], t), name
        assert torch.equal(host[name], t) and host[name].dtype == t.dtype, name
    # the host's only reads: a load waits for the previous load's copies out of the staging, device_to_host once
    assert [r.kind for r in counter.reads] == ["wait"] * 3


def test_weights_that_do_not_fit_are_refused_naming_what_and_the_tensor():
    target = _model(0)
    wrong = {k: (v[:1] if k == "0.weight" else v) for k, v in _model(1).state_dict().items()}
    with HostReadCounter() as counter:
        counter.place(target)
        with pytest.raises(RuntimeError, match=r"^scorer weights: weights do not fit the model: 0\.weight has shape "
                                               r"\(1, 3\), the model's \(4, 3\)$"):
            load_state_flat(target, wrong, what="scorer weights")
        with pytest.raises(RuntimeError, match=r"missing \['2\.bias'\]"):
            load_state_flat(target, {k: v for k, v in _model(1).state_dict().items() if k != "2.bias"})
    with pytest.raises(RuntimeError, match="size mismatch"):  # on a CPU: load_state_dict's own error
        load_state_flat(target, wrong)
