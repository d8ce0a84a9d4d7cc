"""The per-token loss's count of loss positions under the NCCL model.

With ``--calculate-per-token-loss`` and ``--eod-mask-loss`` every rank all-reduces the count of the loss
positions in its microbatches over its data- and context-parallel group (``Microbatches.begin``, called by
the assembly's ``make_stage`` before the schedule): a new collective in each step. It runs on the
data-parallel communicator, the one ZeRO-3's gathers and reductions run on, so :func:`with_token_count`
puts it first on every rank of a multi-replica trace (``ptdp.simulate.nccl.zero.record_zero_trace``), its
group the rank's data-parallel peers, and makes the compute stream wait for it at once (the first
microbatch's loss reads it); ``check_trace`` then plays it with the schedule's sends, receives and ZeRO-3
collectives.
"""

from __future__ import annotations

import copy

TOKEN_COUNT = ["loss_token_count"]


def with_token_count(trace: dict, p: int, replicas: int) -> dict:
    """``trace`` (``replicas`` copies of a ``p``-rank pipeline, rank ``k·p + r``) with the count's all-reduce
    first on every rank; later issues are renumbered."""
    ranks = []
    for rank, events in enumerate(trace["ranks"]):
        group = [j * p + rank % p for j in range(replicas)]
        shifted = [{"wait": e["wait"] + 1} if "wait" in e else e for e in copy.deepcopy(events)]
        ranks.append([{"issue": [{"op": "coll", "group": group, "msg": TOKEN_COUNT}], "comm": "dp"}, {"wait": 0},
                      *shifted])
    return {**trace, "ranks": ranks, "token_count": True}
