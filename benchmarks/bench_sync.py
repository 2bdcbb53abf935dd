"""Cost of quantlib.sync_amax for a model with many quantizers: time and number of collectives.

The model is MoE-shaped: ``layers`` blocks of a column-parallel and a row-parallel dense Linear and
``experts`` local experts of two Linears each (hidden 16); INT8 per-channel weights (axis 0) and
per-tensor inputs, outputs disabled, so every Linear has 2 enabled quantizers. ``--quantizers 10000``
picks the number of layers. Amax are set directly (weights from the weights, inputs random per rank)
so that only the sync is timed; each repetition is one full ``sync_amax`` (it is idempotent).

For reference it also times the naive scheme this replaces: one all-reduce per quantizer per group.

    python benchmarks/bench_sync.py                       # DP2 and TP2xEP2 on gloo (CPU), 10k quantizers
    python benchmarks/bench_sync.py --backend nccl --layouts DP2 EP2   # 2 GPUs

Prints one markdown row per layout.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import quantlib as ql

HIDDEN = 16
LAYOUTS = {  # name: (world, data, tensor, expert, expert_tensor), groups as lists of global ranks
    "DP2": (2, [[0, 1]], [], [], []),
    "EP2": (2, [[0, 1]], [], [[0, 1]], []),
    "TP2xEP2": (4, [[0, 2], [1, 3]], [[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0, 1], [2, 3]]),
    "DP2xEP2": (4, [[0, 1, 2, 3]], [], [[0, 1], [2, 3]], []),
}
CFG = {
    "quant_cfg": {
        "*weight_quantizer": {"num_bits": 8, "axis": 0},
        "*input_quantizer": {"num_bits": 8, "axis": None},
        "default": {"enable": False},
    },
    "algorithm": None,
}


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.linear_fc2 = nn.Linear(HIDDEN, HIDDEN, bias=False)


class Block(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.local_experts = nn.ModuleList([Expert() for _ in range(experts)])


def build(layers: int, experts: int, rank: int, device: torch.device) -> nn.Module:
    torch.manual_seed(rank)
    model = ql.quantize(nn.ModuleList([Block(experts) for _ in range(layers)]).to(device), CFG)
    for block in model:
        block.fc1.parallel_role, block.fc2.parallel_role = "column", "row"
        for ex in block.local_experts:
            ex.linear_fc1.parallel_role, ex.linear_fc2.parallel_role = "column", "row"
            ex.linear_fc1.is_expert = ex.linear_fc2.is_expert = True
    g = torch.Generator().manual_seed(1000 + rank)
    for m in model.modules():
        if isinstance(m, ql.QuantModule):
            m.calibrate_weights()
            m.input_quantizer.amax = torch.rand((), generator=g).to(device) + rank
    return model


def _groups(layout: str, rank: int) -> ql.ParallelState:
    _, *lists = LAYOUTS[layout]
    mine = []
    for kind in lists:
        found = None
        for ranks in kind:
            g = dist.new_group(ranks)
            if rank in ranks:
                found = g
        mine.append(found)
    return ql.ParallelState(*mine)


def _worker(rank: int, world: int, port: int, args, layout: str, results) -> None:
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if args.backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(
        args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    state = _groups(layout, rank)
    model = build(args.layers, args.experts, rank, device)
    leaves = [q for _, q in ql.model_quant.iter_leaf_quantizers(model) if q.is_enabled and q.needs_calibration]
    real = dist.all_reduce
    calls: list[tuple[int, float]] = []

    def counting(tensor, *a, **k):
        t0 = time.perf_counter()
        out = real(tensor, *a, **k)
        if tensor.is_cuda:
            torch.cuda.synchronize()
        calls.append((tensor.numel() * tensor.element_size(), time.perf_counter() - t0))
        return out

    initial = [q.amax for q in leaves]
    dist.all_reduce = counting
    try:
        ql.sync_amax(model, state)  # warm-up
        times, comm = [], []
        for _ in range(args.repeat):
            for q, a in zip(leaves, initial):  # back to the unsynced amax: every sync does the full work
                q.amax = a
            calls.clear()
            dist.barrier()
            t0 = time.perf_counter()
            ql.sync_amax(model, state)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            comm.append(sum(t for _, t in calls))
        n_calls, n_bytes = len(calls), sum(b for b, _ in calls)
    finally:
        dist.all_reduce = real
    naive = None
    if args.naive:  # one all-reduce per quantizer and group it takes part in (data + one more at most)
        groups = [state.group(n) for n in ("data", "tensor", "expert", "expert_tensor") if state.size(n) > 1][:2]
        dist.barrier()
        t0 = time.perf_counter()
        for q in leaves:
            for g in groups:
                dist.all_reduce(q.amax.clone(), op=dist.ReduceOp.MAX, group=g)
        if device.type == "cuda":
            torch.cuda.synchronize()
        naive = (time.perf_counter() - t0, len(leaves) * len(groups))
    results.put((rank, len(leaves), statistics.median(times), statistics.median(comm), n_calls, n_bytes, naive))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(layout: str, args) -> dict:
    world = LAYOUTS[layout][0]
    ctx = mp.get_context("fork" if args.backend == "gloo" else "spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, args, layout, results)) for r in range(world)]
    for p in procs:
        p.start()
    rows = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    rows.sort()
    return {
        "layout": layout,
        "world": world,
        "quantizers": rows[0][1],
        "sync_ms": max(r[2] for r in rows) * 1e3,
        "comm_ms": max(r[3] for r in rows) * 1e3,
        "collectives": rows[0][4],
        "bytes": max(r[5] for r in rows),
        "naive": None if rows[0][6] is None else (max(r[6][0] for r in rows) * 1e3, rows[0][6][1]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quantizers", type=int, default=10000, help="enabled quantizers per rank (approximately)")
    ap.add_argument("--experts", type=int, default=8, help="local experts per layer")
    ap.add_argument("--layouts", nargs="+", default=["DP2", "TP2xEP2"], choices=sorted(LAYOUTS))
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-naive", dest="naive", action="store_false")
    args = ap.parse_args()
    args.layers = max(1, round(args.quantizers / (4 + 4 * args.experts)))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"torch {torch.__version__}, backend {args.backend}, {args.layers} layers x ({2} dense + {2 * args.experts} expert Linears)")
    print(
        "| layout | ranks | quantizers/rank | sync_amax (ms, median) | of which in all_reduce (ms) | all_reduce calls | bytes/rank | naive "
        "per-quantizer all_reduce (ms, calls) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for layout in args.layouts:
        r = run(layout, args)
        naive = "-" if r["naive"] is None else f"{r['naive'][0]:.0f} ({r['naive'][1]})"
        print(
            f"| {r['layout']} | {r['world']} | {r['quantizers']} | {r['sync_ms']:.1f} | {r['comm_ms']:.1f} | {r['collectives']} | "
            f"{r['bytes']} | {naive} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
