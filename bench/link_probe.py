"""One rank of a two-rank link probe: Gloo messages of one step's size, one way and both ways at
once.

A full-duplex link carries its rate in each direction at once only if nothing else gets in the
way; over ``tc tbf`` queues (the namespace hosts of ``bench/pipeline.py``) each direction's ACKs
wait behind the other direction's data, and both ways at once measured about half the one-way
rate per direction. The scaling model reads both figures (``bench/scaling.py``).

Run by ``bench/pipeline.py`` in each namespace: ``RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` set;
argv: message bytes, repetitions, output JSON path (rank 0 writes it).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def _timed(fn, reps: int) -> float:
    fn(1)  # warm: connections up, buffers touched
    dist.barrier()
    t = time.perf_counter()
    fn(reps)
    dist.barrier()
    return time.perf_counter() - t


def main() -> None:
    nbytes, reps, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    rank = int(os.environ["RANK"])
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=120),
        init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
    )
    send, recv = torch.ones(nbytes // 4), torch.empty(nbytes // 4)  # [nbytes / 4] fp32
    peer = 1 - rank

    def one_way(n: int) -> None:
        for _ in range(n):
            if rank == 0:
                dist.send(send, peer)
            else:
                dist.recv(recv, peer)

    def both_ways(n: int) -> None:
        for _ in range(n):
            a, b = dist.isend(send, peer), dist.irecv(recv, peer)
            a.wait()
            b.wait()

    def ping(n: int) -> None:
        tiny = torch.ones(1)
        for _ in range(n):
            if rank == 0:
                dist.send(tiny, peer)
                dist.recv(tiny, peer)
            else:
                dist.recv(tiny, peer)
                dist.send(tiny, peer)

    one = _timed(one_way, reps)
    both = _timed(both_ways, reps)
    rtt = _timed(ping, 50) / 50
    if rank == 0:
        result = {
            "message_bytes": nbytes,
            "one_way_bytes_per_s": reps * nbytes / one,
            "both_ways_bytes_per_s": reps * nbytes / both,
            "latency_s": rtt / 2,
        }
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
