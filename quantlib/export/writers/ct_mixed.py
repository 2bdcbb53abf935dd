"""compressed-tensors ``mixed-precision``: one ``config_groups`` entry per scheme, each with its own
``format`` and the full names of its modules as ``targets`` (CT decompresses each module by its group's
format); tensors as the single-scheme ``ct_*`` formats write them. Experts are targeted by ``re:`` patterns
(transformers takes the group whose ``re:`` targets name experts for the MoE experts, the first other group
for every dense module, so transformers loads a mixed export whose dense modules share one scheme)."""

from __future__ import annotations

import re

from ...kv.scales import CTKVCache
from ..types import ExportFormat
from .base import ConfigInfo
from .ct_fp8_block import CTFP8Block
from .ct_int8 import CTInt8
from .ct_int_pack import CTIntPack
from .ct_mxfp4 import CTMXFP4
from .ct_mxfp8 import CTMXFP8
from .ct_nvfp4 import CTNVFP4
from .mixed import MixedPacker


class CTMixed(CTKVCache, MixedPacker):
    fmt = ExportFormat.CT_MIXED
    members = (CTInt8(), CTIntPack(), CTFP8Block(), CTNVFP4(), CTMXFP8(), CTMXFP4())  # INT8 as int-quantized before pack-quantized

    def config(self, info: ConfigInfo) -> dict:
        groups, formats, out = {}, set(), {}
        for i, (member, scheme, sub) in enumerate(self.parts(info)):
            out = member.config(sub)
            experts = set(scheme.experts)
            targets = [f"re:^{re.escape(n)}$" if n in experts else n for n in scheme.modules]
            group = dict(out["config_groups"]["group_0"], targets=targets)
            groups[f"group_{i}"] = group
            formats.add(group["format"])
        out["config_groups"] = groups
        out["format"] = formats.pop() if len(formats) == 1 else "mixed-precision"
        return out
