"""gptq under tensor, expert and data parallelism (2 and 4 gloo ranks) equals one process, bit for bit.

The model is tests/test_distributed/_layouts.py's (per layer a replicated gate, a column-parallel fc1,
a row-parallel fc2 and two local experts whose linear_fc1 / linear_fc2 are column / row parallel over
the expert-tensor group), every weight a shard of a layout-independent global weight. Each linear is
fed directly: the tensor ranks the same tokens (a row-parallel linear its slice of them), each data
rank its own batch. The one process holds every expert and gets every rank's batch, one call each in
data-rank order, so its Hessian sums are the ranks' sums in the same order (x0^T x0 + x1^T x1).
Compared: every weight in its global form (shards joined, experts by global index).
"""

from __future__ import annotations

import pytest
import torch

import quantlib as ql
from quantlib.traversal import set_applied_config
from tests.test_distributed import _layouts as L

pytestmark = pytest.mark.distributed

INT4_8 = {"num_bits": 4, "block_sizes": {-1: 8, "type": "static"}, "narrow_range": False}
#: layer 0: INT4 blocks of 8 inside each shard; layer 1: INT8 per output channel (a row-parallel row's
#: amax is MAX-reduced over the shards); layer 2: NVFP4 static blocks in the dense linears, and one INT4
#: block spanning both 8-column shards of an expert's linear_fc2
QUANT_CFG = {
    "default": {"enable": False},
    "layers.0.*weight_quantizer": INT4_8,
    "layers.1.*weight_quantizer": {"num_bits": 8, "axis": 0},
    "layers.2.*weight_quantizer": {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "static", "scale_bits": (4, 3)}},
    "layers.2.mlp.*weight_quantizer": {"num_bits": 4, "block_sizes": {-1: 16, "type": "static"}},
}
CFG = {"quant_cfg": QUANT_CFG, "algorithm": {"method": "gptq", "block_size": 16}}
E = 2 * L.N_LOCAL  # experts at EP=2


def _x(d: int, li: int, name: str, width: int) -> torch.Tensor:
    """Data rank ``d``'s input of one linear: correlated channels (where GPTQ's compensation acts)."""
    mix = L._randn("mix", li, name, shape=(width, width)) / width**0.5
    return L._randn("x", d, li, name, shape=(4 * L.T, width)) @ mix


def _loop(datas: list[int], tp: tuple[int, int], etp: tuple[int, int], experts: list[tuple[int, int, int]]):
    """Feed data ranks ``datas`` in order; ``experts``: (local index, global expert, data rank feeding it)."""

    def loop(model) -> None:
        for d in datas:
            for li, layer in enumerate(model.layers):
                layer.gate(_x(d, li, "gate", L.H))
                layer.fc1(_x(d, li, "fc1", L.H))
                layer.fc2(L.shard(_x(d, li, "fc2", L.F), "row", *tp))
                for i, e, fed in experts:
                    if fed == d:
                        ex = layer.mlp.experts.local_experts[i]
                        ex.linear_fc1(_x(d, li, f"e{e}.fc1", L.H))
                        ex.linear_fc2(L.shard(_x(d, li, f"e{e}.fc2", L.FE), "row", *etp))

    return loop


def _weights(model, tp: tuple[int, int], etp: tuple[int, int], base: int) -> list[tuple[str, int, int, torch.Tensor]]:
    """(global name, split dim or -1, shard index, weight) of every linear; experts by global index."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            role, pos = getattr(m, "parallel_role", "replicated"), etp if getattr(m, "is_expert", False) else tp
            if ".local_experts." in name:
                head, tail = name.split(".local_experts.")
                i, rest = tail.split(".", 1)
                name = f"{head}.experts.{base + int(i)}.{rest}"
            dim = {"column": 0, "row": 1}.get(role, -1)
            out.append((name, dim, pos[0], m.weight.detach().clone()))
    return out


def _join(per_rank: list[list]) -> dict[str, torch.Tensor]:
    """Global weights from every rank's pieces; replicas must hold the same bits."""
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    for rank_pieces in per_rank:
        for name, dim, idx, w in rank_pieces:
            held = pieces.setdefault(name, {}).setdefault(idx, w)
            assert torch.equal(held, w), f"{name}: replicas differ"
            pieces[name]["dim"] = dim
    out = {}
    for name, by_idx in pieces.items():
        dim = by_idx.pop("dim")
        out[name] = by_idx[0] if dim < 0 else torch.cat([by_idx[i] for i in sorted(by_idx)], dim=dim)
    return out


def _quantize(model, loop, state):
    ql.set_quantizer_by_cfg(model, CFG)
    set_applied_config(model, ql.QuantizeConfig.from_any(CFG))
    return ql.calibrate(model, CFG["algorithm"], loop, parallel_state=state)


def _rank(rank: int, world: int, layout_name: str):
    layout = L.LAYOUTS[layout_name]
    state = L.parallel_state(layout, rank)
    tp, ep, etp, d = (layout.coord(k, rank) for k in ("tensor", "expert", "expert_tensor", "data"))
    model = ql.convert(L.Net(layout, rank))
    L.set_roles(model)
    experts = [(i, ep[0] * L.N_LOCAL + i, d[0]) for i in range(L.N_LOCAL)]
    _quantize(model, _loop([d[0]], tp, etp, experts), state)
    return _weights(model, tp, etp, ep[0] * L.N_LOCAL)


def _one_process(layout_name: str) -> dict[str, torch.Tensor]:
    layout = L.LAYOUTS[layout_name]
    datas = list(range(layout.coord("data", 0)[1]))
    n_experts = layout.coord("expert", 0)[1] * L.N_LOCAL
    net = L.Net(L.Layout("EP2", 2, expert=((0, 1),)), 0)
    if n_experts > L.N_LOCAL:  # the other rank's experts join this one's: one model with every expert
        other = L.Net(L.Layout("EP2", 2, expert=((0, 1),)), 1)
        for mine, theirs in zip(net.layers, other.layers):
            mine.mlp.experts.local_experts.extend(theirs.mlp.experts.local_experts)
    model = ql.convert(net)
    L.set_roles(model)
    per_data = n_experts == L.N_LOCAL  # every data rank holds the same experts (DP, TP): each feeds them
    experts = [(e, e, d) for e in range(n_experts) for d in (datas if per_data else [e // L.N_LOCAL])]
    _quantize(model, _loop(datas, (0, 1), (0, 1), experts), ql.ParallelState())
    return _join([_weights(model, (0, 1), (0, 1), 0)])


@pytest.mark.parametrize("layout_name", ["TP2", "EP2", "DP2", "TP2xEP2"])
def test_gptq_on_several_ranks_equals_one_process_bit_for_bit(layout_name):
    from tests.ranks import run_on_ranks

    got = _join(run_on_ranks(_rank, L.LAYOUTS[layout_name].world, layout_name, timeout=240))
    want = _one_process(layout_name)
    assert sorted(got) == sorted(want)
    before = _join([_weights(ql.convert(L.Net(L.Layout("EP2", 2, expert=((0, 1),)), r)), (0, 1), (0, 1), r * L.N_LOCAL) for r in (0, 1)])
    for name, w in want.items():
        assert torch.equal(got[name], w), f"{layout_name} {name}: {(got[name] != w).sum().item()} of {w.numel()} differ"
        assert not torch.equal(w, before[name]), f"{name}: gptq left the weight as it was"


def _straddling_rank(rank: int, world: int) -> str:
    layout = L.LAYOUTS["TP2"]
    nvfp4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "static", "scale_bits": (4, 3)}}
    cfg = {"quant_cfg": {"default": {"enable": False}, "*linear_fc2.weight_quantizer": nvfp4}, "algorithm": "gptq"}
    model = ql.convert(L.Net(layout, rank))
    L.set_roles(model)
    ql.set_quantizer_by_cfg(model, cfg)
    set_applied_config(model, ql.QuantizeConfig.from_any(cfg))
    tp, etp = layout.coord("tensor", rank), layout.coord("expert_tensor", rank)
    try:
        loop = _loop([0], tp, etp, [(i, i, 0) for i in range(L.N_LOCAL)])
        ql.calibrate(model, "gptq", loop, parallel_state=L.parallel_state(layout, rank))
    except ql.CalibrationError as exc:
        return str(exc)
    return "no error"


def test_nvfp4_blocks_straddling_row_shards_are_refused_on_every_rank():
    from tests.ranks import run_on_ranks

    outs = run_on_ranks(_straddling_rank, 2, timeout=120)  # an expert's linear_fc2: 8 columns a shard, blocks of 16
    want = "layers.0.mlp.experts.local_experts.0.linear_fc2.weight_quantizer: gptq cannot join the block scales of a row-parallel linear"
    assert all(want in o for o in outs), outs
