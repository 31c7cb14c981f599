"""``parallel.strategy: fsdp``: the reference sharded like the proxy (training.blocks.sharding), on 2 gloo ranks.

One 2-process group (tests/training/shard_worker.py, plain processes with a file rendezvous: test
scaffolding; the product's trainer processes come from Ray Train) runs the reference's operations on a
sharded tiny Llama; every result is compared with the same operation on the unsharded model in this process.
The end-to-end run (Composer FSDP2 under Ray Train) is in test_parallel.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from curation.core.losses import model_token_losses
from curation.core.stats import param_distance
from tests import timing
from training.blocks.sharding import decoder_layers, is_sharded

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
import shard_worker as W  # noqa: E402


def _close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), atol=atol, rtol=0), (k, (a[k] - b[k]).abs().max())


def test_decoder_layers_and_a_model_without_them():
    m = W.model()
    assert [c.__name__ for c in decoder_layers(m)] == ["LlamaDecoderLayer"] and not is_sharded(m)
    with pytest.raises(ValueError, match="names no decoder layer class .* use strategy=ddp"):
        decoder_layers(torch.nn.Linear(2, 2))


@pytest.mark.slow
def test_sharded_reference_operations_equal_the_unsharded_ones(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(HERE / "shard_worker.py"), str(r), "2", str(tmp_path / "rdv"),
                               str(tmp_path)], env=env, stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        _, err = timing.communicate(p, timeout=300)
        assert p.returncode == 0, err[-3000:]
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    r0 = got[0]
    assert got[1]["proxy"] == {} and got[1]["reference_state"] == {}  # gathered on rank 0 only

    proxy = W.model()
    want = proxy.state_dict()
    _close(r0["proxy"], want, 0)  # sharding and gathering loses nothing
    _close(r0["clone"], want, 0)  # the clone is the proxy, built without a deep copy
    _close(r0["proxy_after"], want, 0)  # the refresh left the proxy alone
    _close(r0["built"], want, 0)
    _close(r0["reference_state"], want, 0)

    single = W.refresh(proxy)
    # Every rank refreshed on the same batches; FSDP averages identical gradients: the single-process
    # refresh up to float summation order.
    assert torch.allclose(r0["val_losses"], torch.tensor(single.val_losses), atol=1e-5)
    assert torch.allclose(r0["grad_norms"], torch.tensor(single.grad_norms), rtol=1e-4)
    _close(r0["refreshed"], single.model.state_dict(), 1e-5)
    _close(r0["refreshed_again"], r0["refreshed"], 1e-6)  # the reused workspace restarts from u
    assert bool(r0["same_module"])
    # ‖u − w̃‖ from the shards, summed over the ranks (both ranks got the total)
    d = param_distance(proxy, single.model)
    assert d > 0 and all(abs(float(g["distance"]) - d) < 1e-4 * d for g in got)
    # blade-nosync (the in-process reference): two refreshes continuing one AdamW, uninterrupted and through a
    # checkpoint in between, equal the same reference's unsharded ones
    single_nosync = W.nosync(proxy)
    _close(r0["nosync"], single_nosync["nosync"], 1e-5)
    _close(single_nosync["nosync_resumed"], single_nosync["nosync"], 0)
    _close(r0["nosync_resumed"], r0["nosync"], 0)  # the resumed shards continue exactly
    opt = r0["nosync_opt"]["state"]  # gathered to full tensors
    shapes = [p.shape for p in proxy.parameters()]
    assert len(opt) == len(shapes) and all(opt[i]["exp_avg"].shape == shapes[i] for i in opt)
    # each rank scored its own rows with the sharded reference (a collective forward)
    _, _, score = W.batches()
    with torch.no_grad():
        losses, _ = model_token_losses(single.model, score)
    assert torch.allclose(torch.cat([g["losses"] for g in got]), losses, atol=1e-5)
