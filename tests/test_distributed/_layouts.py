"""Parallel layouts, a small MoE-shaped model of plain nn.Linear, rank-dependent calibration data, and
the amax every rank must hold, computed from all ranks' data independently of quantlib.

The model: ``layers.{li}`` each hold a replicated ``gate`` [4, H] (the same on every rank), a
column-parallel ``fc1`` [F/tp, H], a row-parallel ``fc2`` [H, F/tp] and ``mlp.experts.local_experts.{i}`` (two local experts per rank) whose
``linear_fc1`` / ``linear_fc2`` are column / row parallel over the expert-tensor group. Every weight is
a shard of a global weight that depends only on (layer, name, global expert), and the experts' weights
are scaled by ``1 + e`` so that their amax differ. Every input depends on the rank (and its scale grows
with the rank), so an amax that missed a rank, or mixed in one it should not, shows.

Layer 0 is INT8 (per-channel weights, axis 0; per-tensor inputs); layer 1 is NVFP4 weights (one global
amax) and FP8 per-tensor inputs; layer 2 is INT4 weights in static blocks of 8 (each rank owns the
blocks of its shard) and INT8 per-tensor inputs.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

import quantlib as ql

H, F, FE, T = 32, 32, 16, 6  # hidden, dense ffn, expert ffn, tokens per batch
N_LAYERS, N_LOCAL = 3, 2

NVFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}, "axis": None}


def config(policy: str = "max_of_peers", sync_expert_weight_amax: bool = False) -> dict:
    return {
        "quant_cfg": {
            "*weight_quantizer": {"num_bits": 8, "axis": 0},
            "*input_quantizer": {"num_bits": 8, "axis": None},
            "layers.1.*weight_quantizer": dict(NVFP4),
            "layers.1.*input_quantizer": {"num_bits": (4, 3), "axis": None},
            "layers.2.*weight_quantizer": {"num_bits": 4, "block_sizes": {-1: 8}},
            "default": {"enable": False},
        },
        "algorithm": "max",
        "expert_input_policy": policy,
        "sync_expert_weight_amax": sync_expert_weight_amax,
    }


# ------------------------------------------------------------------------------------ layouts


@dataclass(frozen=True)
class Layout:
    """Groups as lists of global ranks (Megatron's conventions: data contains the expert ranks)."""

    name: str
    world: int
    data: tuple = ()
    tensor: tuple = ()
    expert: tuple = ()
    expert_tensor: tuple = ()

    def groups_of(self, kind: str) -> tuple:
        lists = getattr(self, kind)
        return lists or tuple((r,) for r in range(self.world))

    def members(self, kind: str, rank: int) -> tuple:
        return next(g for g in self.groups_of(kind) if rank in g)

    def coord(self, kind: str, rank: int) -> tuple[int, int]:
        """(index of ``rank`` in its ``kind`` group, size of the group)."""
        g = self.members(kind, rank)
        return g.index(rank), len(g)


LAYOUTS = {
    "DP2": Layout("DP2", 2, data=((0, 1),)),
    "TP2": Layout("TP2", 2, tensor=((0, 1),), expert_tensor=((0, 1),)),
    "EP2": Layout("EP2", 2, data=((0, 1),), expert=((0, 1),)),
    "DP2xEP2": Layout("DP2xEP2", 4, data=((0, 1, 2, 3),), expert=((0, 1), (2, 3))),
    "TP2xEP2": Layout(
        "TP2xEP2", 4, tensor=((0, 1), (2, 3)), data=((0, 2), (1, 3)), expert=((0, 2), (1, 3)), expert_tensor=((0, 1), (2, 3))
    ),
    # Megatron TP=2, EP=2, ETP=1: the expert group spans tensor ranks; data = the experts' replicas
    "TP2xEP2_ETP1": Layout("TP2xEP2_ETP1", 4, tensor=((0, 1), (2, 3)), data=((0, 2), (1, 3)), expert=((0, 1), (2, 3))),
}


def parallel_state(layout: Layout, rank: int) -> ql.ParallelState:
    """Create every group of ``layout`` (all ranks call new_group in the same order) and this rank's
    ParallelState; groups of one rank are passed as None."""
    mine = {}
    for kind in ("data", "tensor", "expert", "expert_tensor"):
        mine[kind] = None
        for ranks in getattr(layout, kind):
            g = dist.new_group(list(ranks))
            if rank in ranks:
                mine[kind] = g
    return ql.ParallelState(mine["data"], mine["tensor"], mine["expert"], mine["expert_tensor"])


# ------------------------------------------------------------------------------------ model and data


def _randn(*key, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    return torch.randn(*shape, generator=g)


def global_weight(layer: int, name: str, expert: Optional[int] = None) -> torch.Tensor:
    shapes = {"gate": (4, H), "fc1": (F, H), "fc2": (H, F), "linear_fc1": (FE, H), "linear_fc2": (H, FE)}
    w = _randn("w", layer, name, expert, shape=shapes[name])
    return w if expert is None else w * (1 + expert)


def shard(w: torch.Tensor, role: str, index: int, size: int) -> torch.Tensor:
    if role == "column":
        return w.chunk(size, dim=0)[index].contiguous()
    return w.chunk(size, dim=1)[index].contiguous()


def activation(rank: int, layer: int, name: str, width: int) -> torch.Tensor:
    return _randn("x", rank, layer, name, shape=(T, width)) * (1.0 + 0.5 * rank + 0.125 * layer)


class Expert(nn.Module):
    def __init__(self, layer: int, expert: int, etp: tuple[int, int]) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(H, FE // etp[1], bias=False)
        self.linear_fc2 = nn.Linear(FE // etp[1], H, bias=False)
        with torch.no_grad():
            self.linear_fc1.weight.copy_(shard(global_weight(layer, "linear_fc1", expert), "column", *etp))
            self.linear_fc2.weight.copy_(shard(global_weight(layer, "linear_fc2", expert), "row", *etp))


class Experts(nn.Module):
    def __init__(self, layer: int, ep: tuple[int, int], etp: tuple[int, int]) -> None:
        super().__init__()
        self.local_experts = nn.ModuleList([Expert(layer, ep[0] * N_LOCAL + i, etp) for i in range(N_LOCAL)])


class MoE(nn.Module):
    def __init__(self, layer: int, ep: tuple[int, int], etp: tuple[int, int]) -> None:
        super().__init__()
        self.experts = Experts(layer, ep, etp)


class Layer(nn.Module):
    def __init__(self, layer: int, tp: tuple[int, int], ep: tuple[int, int], etp: tuple[int, int]) -> None:
        super().__init__()
        self.gate = nn.Linear(H, 4, bias=False)
        self.fc1 = nn.Linear(H, F // tp[1])
        self.fc2 = nn.Linear(F // tp[1], H)
        with torch.no_grad():
            self.gate.weight.copy_(global_weight(layer, "gate"))
            self.fc1.weight.copy_(shard(global_weight(layer, "fc1"), "column", *tp))
            self.fc2.weight.copy_(shard(global_weight(layer, "fc2"), "row", *tp))
        self.mlp = MoE(layer, ep, etp)


class Net(nn.Module):
    def __init__(self, layout: Layout, rank: int, n_layers: int = N_LAYERS) -> None:
        super().__init__()
        tp, ep, etp = (layout.coord(k, rank) for k in ("tensor", "expert", "expert_tensor"))
        self.layers = nn.ModuleList([Layer(layer, tp, ep, etp) for layer in range(n_layers)])


def set_roles(model: nn.Module) -> None:
    """What a plugin would do: column / row roles, expert flags on the quantized modules."""
    for layer in model.layers:
        layer.fc1.parallel_role, layer.fc2.parallel_role = "column", "row"
        for ex in layer.mlp.experts.local_experts:
            ex.linear_fc1.parallel_role, ex.linear_fc2.parallel_role = "column", "row"
            ex.linear_fc1.is_expert = ex.linear_fc2.is_expert = True


Tokens = Callable[[int, int, int], bool]  # (rank, layer, local expert) -> whether it gets tokens


def all_tokens(rank: int, layer: int, expert: int) -> bool:
    return True


def forward_loop(
    layout: Layout, rank: int, tokens: Tokens = all_tokens, poison: Optional[tuple] = None, device: str = "cpu"
) -> Callable[[nn.Module], None]:
    """Feed every linear its rank's activations; ``poison = (rank, layer, name)`` puts a NaN in one."""
    tp = layout.coord("tensor", rank)[1]
    etp = layout.coord("expert_tensor", rank)[1]

    def x(layer: int, name: str, width: int) -> torch.Tensor:
        t = activation(rank, layer, name, width)
        if poison == (rank, layer, name):
            t[0, 0] = float("nan")
        return t.to(device)

    def loop(model: nn.Module) -> None:
        for li, layer in enumerate(model.layers):
            layer.gate(x(li, "gate", H))
            layer.fc1(x(li, "fc1", H))
            layer.fc2(x(li, "fc2", F // tp))
            for i, ex in enumerate(layer.mlp.experts.local_experts):
                if tokens(rank, li, i):
                    ex.linear_fc1(x(li, f"e{i}.fc1", H))
                    ex.linear_fc2(x(li, f"e{i}.fc2", FE // etp))

    return loop


def build(
    layout: Layout,
    rank: int,
    cfg: dict,
    tokens: Tokens = all_tokens,
    poison: Optional[tuple] = None,
    n_layers: int = N_LAYERS,
    device: str = "cpu",
):
    """The converted model with roles set and configured (not yet calibrated), and its forward loop."""
    model = ql.convert(Net(layout, rank, n_layers).to(device))
    set_roles(model)
    ql.set_quantizer_by_cfg(model, cfg)
    return model, forward_loop(layout, rank, tokens, poison, device)


def amax_table(model: nn.Module) -> dict[str, Optional[tuple[tuple, list]]]:
    """{leaf quantizer name: (shape, values) or None}, picklable."""
    out = {}
    for name, q in ql.model_quant.iter_leaf_quantizers(model):
        if q.is_enabled:
            a = q.amax
            out[name] = None if a is None else (tuple(a.shape), a.flatten().tolist())
    return out


# ------------------------------------------------------------------------------------ expectations


def _row_amax(w: torch.Tensor) -> torch.Tensor:
    return w.abs().amax(dim=1, keepdim=True)


def _block_amax(w: torch.Tensor) -> torch.Tensor:
    return w.reshape(w.shape[0], -1, 8).abs().amax(dim=-1)


def expected(
    layout: Layout, rank: int, tokens: Tokens = all_tokens, sync_expert_weight_amax: bool = False, n_layers: int = N_LAYERS
) -> dict[str, torch.Tensor]:
    """The amax ``rank`` must hold after the sync, from every rank's data (not from quantlib)."""
    tp = layout.coord("tensor", rank)
    ep = layout.coord("expert", rank)
    etp = layout.coord("expert_tensor", rank)
    world = range(layout.world)
    out: dict[str, torch.Tensor] = {}

    def act_max(layer: int, width_of: Callable[[int], int], who) -> Optional[torch.Tensor]:
        vals = [activation(r, layer, n, width_of(r)).abs().amax() for r, n in who]
        return torch.stack(vals).amax() if vals else None

    n_experts = ep[1] * N_LOCAL
    for li in range(n_layers):
        p = f"layers.{li}"
        w1, w2, wg = global_weight(li, "fc1"), global_weight(li, "fc2"), global_weight(li, "gate")
        out[f"{p}.gate.input_quantizer"] = act_max(li, lambda r: H, [(r, "gate") for r in world])
        out[f"{p}.gate.weight_quantizer"] = (_row_amax, lambda w: w.abs().amax(), _block_amax)[li](wg)
        # dense inputs: every rank (data x tensor covers the world in every layout)
        out[f"{p}.fc1.input_quantizer"] = act_max(li, lambda r: H, [(r, "fc1") for r in world])
        out[f"{p}.fc2.input_quantizer"] = act_max(li, lambda r: F // layout.coord("tensor", r)[1], [(r, "fc2") for r in world])
        if li == 0:  # INT8 per channel: column keeps its own rows, row-parallel gets whole rows
            out[f"{p}.fc1.weight_quantizer"] = _row_amax(shard(w1, "column", *tp))
            out[f"{p}.fc2.weight_quantizer"] = _row_amax(w2)
        elif li == 1:  # NVFP4 global amax: the whole weight
            out[f"{p}.fc1.weight_quantizer"] = w1.abs().amax()
            out[f"{p}.fc2.weight_quantizer"] = w2.abs().amax()
        else:  # static blocks: each rank its own shard's
            out[f"{p}.fc1.weight_quantizer"] = _block_amax(shard(w1, "column", *tp))
            out[f"{p}.fc2.weight_quantizer"] = _block_amax(shard(w2, "row", *tp))

        def expert_weights(e: int, li: int = li) -> tuple[torch.Tensor, torch.Tensor]:
            e1, e2 = global_weight(li, "linear_fc1", e), global_weight(li, "linear_fc2", e)
            if li == 0:
                return _row_amax(shard(e1, "column", *etp)), _row_amax(e2)
            if li == 1:
                return e1.abs().amax(), e2.abs().amax()
            return _block_amax(shard(e1, "column", *etp)), _block_amax(shard(e2, "row", *etp))

        if sync_expert_weight_amax:
            both = [expert_weights(e) for e in range(n_experts)]
            shared = (torch.stack([b[0] for b in both]).amax(0), torch.stack([b[1] for b in both]).amax(0))
        fed = [(r, i) for r in world for i in range(N_LOCAL) if tokens(r, li, i)]
        in1 = act_max(li, lambda r: H, [(r, f"e{i}.fc1") for r, i in fed])
        in2 = act_max(li, lambda r: FE // layout.coord("expert_tensor", r)[1], [(r, f"e{i}.fc2") for r, i in fed])
        for i in range(N_LOCAL):
            e = ep[0] * N_LOCAL + i
            q = f"{p}.mlp.experts.local_experts.{i}"
            wa = shared if sync_expert_weight_amax else expert_weights(e)
            out[f"{q}.linear_fc1.weight_quantizer"], out[f"{q}.linear_fc2.weight_quantizer"] = wa
            out[f"{q}.linear_fc1.input_quantizer"] = in1
            out[f"{q}.linear_fc2.input_quantizer"] = in2
    return out


def assert_matches(table: dict, want: dict[str, Optional[torch.Tensor]], rank: int) -> None:
    assert set(table) == set(want), f"rank {rank}: quantizers {sorted(set(table) ^ set(want))}"
    for name, w in want.items():
        got = table[name]
        if w is None:
            assert got is None, f"rank {rank} {name}: expected no amax, got {got}"
            continue
        assert got is not None, f"rank {rank} {name}: no amax"
        shape, values = got
        assert shape == tuple(w.shape), f"rank {rank} {name}: shape {shape} != {tuple(w.shape)}"
        assert values == w.flatten().tolist(), f"rank {rank} {name}: {values} != {w.flatten().tolist()}"


# ------------------------------------------------------------------------------------ grouped experts


class GroupedExperts(nn.Module):
    """All local experts of a layer in one module (like TE's GroupedLinear): ``weight`` [n, out, in]."""

    def __init__(self, layer: int, ep: tuple[int, int]) -> None:
        super().__init__()
        w = [global_weight(layer, "linear_fc1", ep[0] * N_LOCAL + i) for i in range(N_LOCAL)]
        self.weight = nn.Parameter(torch.stack(w))

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [x @ w.t() for x, w in zip(xs, self.weight)]


@ql.QuantModuleRegistry.register(GroupedExperts, "GroupedExperts")
class _QuantGroupedExperts(ql.QuantModule):
    is_expert = True

    def _setup(self) -> None:
        n = self.weight.shape[0]
        self.input_quantizer = ql.TensorQuantizer(ql.QuantizerAttributeConfig())
        self.weight_quantizer = ql.GroupedQuantizer.from_config(ql.QuantizerAttributeConfig(axis=0), n)
        self.output_quantizer = ql.TensorQuantizer(ql.QuantizerAttributeConfig(enable=False))

    def weight_groups(self):
        yield "weight_quantizer", list(self.weight.unbind(0))

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [self.input_quantizer(x) @ self.weight_quantizer[i](w).t() for i, (x, w) in enumerate(zip(xs, self.weight))]


class GroupedNet(nn.Module):
    def __init__(self, layout: Layout, rank: int) -> None:
        super().__init__()
        ep = layout.coord("expert", rank)
        self.layers = nn.ModuleList([nn.ModuleDict({"experts": GroupedExperts(layer, ep)}) for layer in range(2)])


def grouped_loop(rank: int, tokens: Tokens = all_tokens) -> Callable[[nn.Module], None]:
    def loop(model: nn.Module) -> None:
        for li, layer in enumerate(model.layers):
            xs = [activation(rank, li, f"g{i}", H) for i in range(N_LOCAL) if tokens(rank, li, i)]
            if xs:
                layer["experts"](xs)

    return loop


def grouped_expected(layout: Layout, rank: int, tokens: Tokens = all_tokens, sync_expert_weight_amax: bool = False) -> dict:
    ep = layout.coord("expert", rank)
    out = {}
    for li in range(2):
        fed = [activation(r, li, f"g{i}", H).abs().amax() for r in range(layout.world) for i in range(N_LOCAL) if tokens(r, li, i)]
        out[f"layers.{li}.experts.input_quantizer"] = torch.stack(fed).amax()
        rows = [_row_amax(global_weight(li, "linear_fc1", e)) for e in range(ep[1] * N_LOCAL)]
        for i in range(N_LOCAL):
            w = torch.stack(rows).amax(0) if sync_expert_weight_amax else rows[ep[0] * N_LOCAL + i]
            out[f"layers.{li}.experts.weight_quantizer.{i}"] = w
    return out
