"""One rank of the 2-process FSDP check in test_sharding.py (run as a script, not collected by pytest).

    python shard_worker.py RANK WORLD INIT_FILE OUT_DIR

Shards the same tiny Llama on every rank as the trainer does with ``parallel.strategy: fsdp`` and runs the
reference's operations on it: clone, refresh (twice through one workspace), ‖u − w̃‖, scoring this rank's
rows, loading full weights into shards, and the in-process reference's blade-nosync refreshes (uninterrupted and
through a checkpoint); saves what it saw to OUT_DIR/rank{RANK}.pt.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from curation.core.losses import model_token_losses
from curation.core.refresh import RefreshSettings, RefreshStart, RefreshWorkspace, refresh_reference
from curation.core.stats import param_distance
from curation.io.models import build_causal_lm
from schemas.train_config import demo_model_config
from training.blocks.sharding import full_state_dict, shard_like, sharded_clone

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_parts import make_reference  # noqa: E402

V, L, B, K = 96, 16, 4, 3


def model() -> torch.nn.Module:
    return build_causal_lm(demo_model_config(V, hidden=32, layers=2, seq_len=L))


def batches() -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]], torch.Tensor]:
    """K validation batches, K candidate batches with masks, and a batch to score (B rows per rank of 2)."""
    g = torch.Generator().manual_seed(7)
    val = [torch.randint(0, V, (B, L), generator=g) for _ in range(K)]
    cand = [{"tokens": torch.randint(0, V, (B, L), generator=g), "mask": torch.rand(B, L, generator=g) > 0.5}
            for _ in range(K)]
    return val, cand, torch.randint(0, V, (2 * B, L), generator=g)


def refresh(proxy: torch.nn.Module, **kw):
    val, cand, _ = batches()
    return refresh_reference(proxy, val, cand, RefreshSettings(refresh_steps=K, lam=1.0, lr=1e-2), RefreshStart(**kw))


def reference(proxy: torch.nn.Module, policy: str = "blade-nosync"):
    """A reference of ``policy`` refreshing on these batches (its candidate batches are ``batches()``'s, with their
    masks), scoring this rank's rows of the score batch; placed like the proxy (sharded or not)."""
    val, cand, score = batches()
    ref, recent = make_reference(demo_model_config(V, hidden=32, layers=2, seq_len=L), policy, val=torch.cat(val),
                                 recent=cand, score=score, steps=K, batch=B)
    ref.start(proxy, 0)
    return ref, recent


def _nosync_refresh(ref, recent, proxy: torch.nn.Module, version: int) -> None:
    """One blade-nosync refresh as the algorithm runs it (from the reference itself, its AdamW continued)."""
    ref.refresh(proxy, version, recent)
    ref.losses(version)  # it scores (no grad) before it is refreshed again,
    param_distance(proxy, ref.for_distance())  # and ‖u − w̃‖ reshards it (the next forward gathers again)


def nosync(proxy: torch.nn.Module) -> dict:
    """blade-nosync: two refreshes in a row, and the same with a checkpoint in between (the gathered weights and
    AdamW state, loaded back into new shards as a resumed worker does). Sharded or not (the test's expectation)."""
    ref, recent = reference(proxy)
    _nosync_refresh(ref, recent, proxy, 1)
    saved = [copy.deepcopy(ref.state_dict(next_step=2))]  # as a checkpoint file holds it (sharded: gathered on rank 0)
    if dist.is_initialized():
        dist.broadcast_object_list(saved, src=0)  # every worker reads the checkpoint file
    _nosync_refresh(ref, recent, proxy, 2)
    resumed, _ = reference(proxy)
    resumed.load_state_dict(saved[0])
    resumed.start(proxy, 2)
    _nosync_refresh(resumed, recent, proxy, 2)
    full = full_state_dict if dist.is_initialized() else (lambda m: m.state_dict())
    return {"nosync_opt": saved[0]["ref_optimizer"], "nosync": full(ref.module), "nosync_resumed": full(resumed.module)}


def main() -> None:
    rank, world, init, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    proxy = shard_like(model())
    res: dict = {"proxy": full_state_dict(proxy)}
    clone = sharded_clone(proxy)
    res["clone"] = full_state_dict(clone)
    ws = RefreshWorkspace()
    first = refresh(proxy, clone=sharded_clone, workspace=ws)
    res["refreshed"] = full_state_dict(first.model)
    res["val_losses"], res["grad_norms"] = torch.tensor(first.val_losses), torch.tensor(first.grad_norms)
    res["distance"] = torch.tensor(param_distance(proxy, first.model))
    _, _, score = batches()
    with torch.no_grad():
        losses, _ = model_token_losses(first.model, score[rank * B:(rank + 1) * B])
    res["losses"] = losses
    res["proxy_after"] = full_state_dict(proxy)  # the proxy is not modified by a refresh
    second = refresh(proxy, clone=sharded_clone, workspace=ws)  # the workspace's module, w_0 copied shard by shard
    res["same_module"] = torch.tensor(second.model is first.model)
    res["refreshed_again"] = full_state_dict(second.model)
    ref, _ = reference(proxy, "blade")
    built = ref.build(proxy, model().state_dict())  # a checkpoint's full weights, loaded into this rank's shards
    res["built"] = full_state_dict(built)
    ref.use(built, 1, step=0)
    res["reference_state"] = ref.weights()  # gathered (a collective), offload was a no-op
    res.update(nosync(proxy))
    torch.save(res, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
