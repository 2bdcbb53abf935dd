"""TensorQuantizer: the state of one quantizer (config, amax buffer, switches, calibrator) and one op call."""

from __future__ import annotations

import itertools
from typing import NoReturn, Optional, Union

import torch
from torch import nn

from ..config import QuantizerAttributeConfig, make_attribute_config
from ..formats import FormatSpec
from ..kernels import block_amax as blocks_amax, ops
from .bias_collector import BiasCalibrator
from .max_collector import MaxCalibrator, static_amax, static_amax_shape


class CalibrationError(ValueError):
    """Calibration produced no usable amax; the message names the quantizer."""


#: Exceptions re-raised with the quantizer's name in front of their message. Only these exact builtin
#: types: subclasses may take other constructor arguments (and ours already name the quantizer), and
#: errors such as torch.OutOfMemoryError are not about one quantizer.
_NAMED_ERRORS = (TypeError, ValueError, RuntimeError, IndexError, NotImplementedError)


def _raise_named(exc: Exception, qname: str) -> NoReturn:
    """Raise ``exc`` again, as the same type with ``qname: `` in front of its message where it is one
    of :data:`_NAMED_ERRORS` that does not name the quantizer yet (chained to the original)."""
    if type(exc) not in _NAMED_ERRORS or str(exc).startswith(qname):
        raise exc
    raise type(exc)(f"{qname}: {exc}") from exc


#: buffers whose values survive a round trip through the meta device (TensorQuantizer._apply)
_KEPT_ON_META = ("_amax", "_pre_quant_scale", "_bias_value", "_block_amax")

#: the source of TensorQuantizer.generation: one counter for all quantizers, so that a generation is never
#: reused (not by another quantizer, not by a copy: __setstate__ takes a new one)
_GENERATIONS = itertools.count(1)
#: the last generation issued (see latest_generation)
_LATEST = [0]


def latest_generation() -> int:
    """The generation last issued to any quantizer: while it stays the same, no quantizer was made and none changed
    state but by in-place writes into its buffers. Read it before the generations it vouches for: a quantizer bumped
    meanwhile changes it later (a bump sets the quantizer's generation first, then this)."""
    return _LATEST[0]


class TensorQuantizer(nn.Module):
    """Fake-quantizes one tensor as its :class:`QuantizerAttributeConfig` says.

    Works standalone like ModelOpt's: ``TensorQuantizer(QuantizerAttributeConfig(num_bits=8))(x)``; a
    static format without a calibrated amax uses the amax of the tensor it is given.
    """

    def __init__(self, quant_attribute_cfg: Optional[Union[QuantizerAttributeConfig, dict]] = None, if_quant: bool = True,
                 if_calib: bool = False, amax: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self._attrs = make_attribute_config(quant_attribute_cfg or QuantizerAttributeConfig())
        self._disabled = not self._attrs.enable
        self._if_quant = if_quant
        self._if_calib = if_calib
        self._calibrator = MaxCalibrator()
        self._block_calibrator = MaxCalibrator()  # NVFP4 with static blocks: the block amax next to the global one
        self._bias_calibrator = BiasCalibrator(self._attrs.bias_axes) if self._attrs.bias is not None else None
        self._qname = "TensorQuantizer"  # full name in the model, set when a model is configured
        if amax is not None:
            self.amax = amax
        self._bump()

    # ------------------------------------------------------------------ state generation
    @property
    def generation(self) -> int:
        """A number that changes with every change of this quantizer's state except the in-place writes
        into its buffers (their version counters say those): any attribute set (config, switches, amax,
        block amax, pre-quant scale, bias), buffer added / dropped / moved, state dict loaded, copy made.
        Never the same for two states, of this quantizer or any other, so one int compare per
        quantizer validates a cache of what it computed (:func:`quantlib.nn.quant_module._quantizer_token`)."""
        return self.__dict__["_gen"]

    def _bump(self) -> None:
        gen = next(_GENERATIONS)
        self.__dict__["_gen"] = gen  # not nn.Module.__setattr__ (which would bump again)
        _LATEST[0] = gen

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)  # property setters (amax, ...) run inside
        self._bump()

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._bump()

    def register_buffer(self, name: str, tensor: Optional[torch.Tensor], persistent: bool = True) -> None:
        super().register_buffer(name, tensor, persistent)
        self._bump()

    # ------------------------------------------------------------------ config
    @property
    def attrs(self) -> QuantizerAttributeConfig:
        return self._attrs

    @property
    def spec(self) -> FormatSpec:
        return self._attrs.format_spec()

    @property
    def num_bits(self):
        return self._attrs.num_bits

    @property
    def axis(self):
        return self._attrs.axis

    @property
    def block_sizes(self):
        return self._attrs.block_sizes

    @property
    def needs_calibration(self) -> bool:
        """True for formats that use a calibrated amax (everything but MX, dynamic blocks, per token)."""
        return not self._attrs.is_dynamic

    @property
    def static_blocks(self) -> bool:
        """True for NVFP4 with static blocks (ModelOpt's ``"type": "static"``): a stored block amax
        (:attr:`block_amax`) next to the global amax (:attr:`amax`)."""
        return self.spec.static_blocks and self.needs_calibration

    def set_from_attribute_config(self, attrs: Union[QuantizerAttributeConfig, dict]) -> None:
        """Replace the config; a dict holding only ``enable`` just toggles. A new format drops the amax."""
        if isinstance(attrs, dict) and set(attrs) <= {"enable"}:
            if "enable" in attrs:
                self.enable() if attrs["enable"] else self.disable()
            return
        new = make_attribute_config(attrs)
        old = self._attrs
        if new.format_spec() != self.spec or new.axis != old.axis or new.is_dynamic != old.is_dynamic or new.bias != old.bias:
            self.reset_amax()
        self._attrs = new
        self._bias_calibrator = BiasCalibrator(new.bias_axes) if new.bias is not None else None
        self._disabled = not new.enable

    # ------------------------------------------------------------------ switches
    @property
    def is_enabled(self) -> bool:
        return not self._disabled

    def enable(self) -> None:
        self._disabled = False

    def disable(self) -> None:
        self._disabled = True

    def enable_quant(self) -> None:
        self._if_quant = True

    def disable_quant(self) -> None:
        self._if_quant = False

    def enable_calib(self) -> None:
        self._if_calib = True

    def disable_calib(self) -> None:
        self._if_calib = False

    # ------------------------------------------------------------------ amax
    @property
    def amax(self) -> Optional[torch.Tensor]:
        return self._buffers.get("_amax")  # not getattr: a missing buffer would raise inside nn.Module

    @amax.setter
    def amax(self, value: Optional[torch.Tensor]) -> None:
        if value is None:
            self.reset_amax()
            return
        self._set_kept_buffer("_amax", torch.as_tensor(value, dtype=torch.float32).detach().clone())

    @property
    def block_amax(self) -> Optional[torch.Tensor]:
        """NVFP4 static blocks: the fp32 amax of every block (shape ``blocked_shape(weight)``), chosen
        against :attr:`amax` (the global amax); None: each block's max |x| at quantization time."""
        return self._buffers.get("_block_amax")

    @block_amax.setter
    def block_amax(self, value: Optional[torch.Tensor]) -> None:
        if value is None:
            self._drop_kept_buffer("_block_amax")
            return
        if not self.static_blocks:
            raise ValueError(f"{self._qname}: a block amax is for NVFP4 with static blocks (block_sizes 'type': 'static'), this quantizer "
                             f"is {self.spec.kind.value} with block_sizes={self.block_sizes}")
        value = torch.as_tensor(value, dtype=torch.float32).detach().clone()
        if not value.is_meta and not bool(torch.isfinite(value).all() and (value >= 0).all()):
            raise ValueError(f"{self._qname}: block amax must be finite and >= 0, got {value.flatten()[:4].tolist()}...")
        self._set_kept_buffer("_block_amax", value)

    @property
    def block_amax_values(self) -> Optional[torch.Tensor]:
        """:attr:`block_amax` with values, as :attr:`amax_values`."""
        return self._values_of("_block_amax")

    def _set_kept_buffer(self, name: str, value: torch.Tensor) -> None:
        """Write buffer ``name`` on its device; on the meta device its values are kept aside (see _apply)."""
        kept = self.__dict__.setdefault("_meta_values", {})
        kept.pop(name, None)
        current = self._buffers.get(name)
        if current is None:
            self.register_buffer(name, value)
            return
        if current.is_meta and not value.is_meta:
            kept[name] = value  # the values come back when to_empty materialises the buffer
        self._buffers[name] = value.to(current.device)
        self._bump()

    def _drop_kept_buffer(self, name: str) -> None:
        self._buffers.pop(name, None)
        self.__dict__.get("_meta_values", {}).pop(name, None)
        self._bump()

    # ------------------------------------------------------------------ pre_quant_scale
    @property
    def pre_quant_scale(self) -> Optional[torch.Tensor]:
        """Factor along the last dim that the input is multiplied by before anything else, or None:
        SmoothQuant / AWQ set ``1/s`` (per input channel) on a linear's input quantizer and ``s`` on its
        weight quantizer, which then quantizes ``W * s``. Applied whenever set, even with quantization
        disabled, since the module's function depends on both halves. A 2-D ``[E, C]`` scale belongs to
        an input quantizer shared by E fused experts: row e scales expert e's tokens (``row=e``)."""
        return self._buffers.get("_pre_quant_scale")

    @pre_quant_scale.setter
    def pre_quant_scale(self, value: Optional[torch.Tensor]) -> None:
        if value is None:
            self._drop_kept_buffer("_pre_quant_scale")
            return
        value = torch.as_tensor(value).detach().clone()
        if value.dim() not in (1, 2) or not value.is_floating_point():
            raise ValueError(f"{self._qname}: pre_quant_scale must be a 1-D float tensor (one factor per input channel; 2-D: one row per "
                             f"fused expert), got {value.dtype} of shape {tuple(value.shape)}")
        if not value.is_meta and not bool(torch.isfinite(value).all() and (value > 0).all()):
            raise ValueError(f"{self._qname}: pre_quant_scale must be finite and positive, got {value[:4].tolist()}...")
        self._set_kept_buffer("_pre_quant_scale", value)

    def pre_scale(self, x: torch.Tensor, row: Optional[Union[int, torch.Tensor]] = None) -> torch.Tensor:
        """``x`` times ``pre_quant_scale`` along its last dim (``x`` itself when there is none); a 2-D
        scale takes its row ``row`` (the expert whose tokens ``x`` holds), which must then be given; a
        tensor ``row`` names the expert of each row of a 2-D ``x`` (tokens of several experts, sorted)."""
        pqs = self.pre_quant_scale
        if pqs is None:
            return x
        if pqs.dim() == 2:
            if row is None:
                raise ValueError(f"{self._qname}: pre_quant_scale holds one row per expert {tuple(pqs.shape)}; quantize each expert's "
                                 "tokens with its row (row=e)")
            pqs = pqs[row]
        if x.shape[-1] != pqs.shape[-1]:
            raise ValueError(f"{self._qname}: pre_quant_scale has {pqs.shape[-1]} channels, the input's last dim is {x.shape[-1]}")
        return x * pqs.to(x.dtype)

    def reset_amax(self) -> None:
        """Drop the amax and the bias (the amax was calibrated against that bias) and their statistics."""
        self._drop_kept_buffer("_amax")
        self._drop_kept_buffer("_bias_value")
        self._drop_kept_buffer("_block_amax")
        self._calibrator.reset()
        self._block_calibrator.reset()
        if self._bias_calibrator is not None:
            self._bias_calibrator.reset()

    # ------------------------------------------------------------------ bias (affine quantization)
    @property
    def bias_value(self) -> Optional[torch.Tensor]:
        """The calibrated static bias (fp32, the input's shape with the averaged axes of size 1), or None.
        ``bias`` in the config says which axes; see :mod:`quantlib.nn.bias_collector`."""
        return self._buffers.get("_bias_value")

    @bias_value.setter
    def bias_value(self, value: Optional[torch.Tensor]) -> None:
        if value is None:
            self._drop_kept_buffer("_bias_value")
            return
        if self._attrs.bias is None:
            raise ValueError(f"{self._qname}: a bias value for a quantizer whose config has no 'bias'")
        value = torch.as_tensor(value).detach().clone()
        if not value.is_floating_point():
            raise ValueError(f"{self._qname}: the bias must be a float tensor, got {value.dtype}")
        if not value.is_meta and not bool(torch.isfinite(value).all()):
            raise ValueError(f"{self._qname}: the bias holds NaN or Inf ({value.flatten()[:4].tolist()}...)")
        self._set_kept_buffer("_bias_value", value.float())

    @property
    def bias_values(self) -> Optional[torch.Tensor]:
        """:attr:`bias_value` with values, as :attr:`amax_values`."""
        return self._values_of("_bias_value")

    def _bias_for(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias_value
        if bias is None:
            raise RuntimeError(f"bias={self._attrs.bias}: the static bias is not calibrated; calibrate with a forward_loop "
                               "(quantlib.quantize / quantlib.calibrate)")
        try:
            torch.broadcast_shapes(bias.shape, x.shape)
        except RuntimeError:
            raise ValueError(f"bias={self._attrs.bias}: the calibrated bias of shape {tuple(bias.shape)} does not fit an input of shape "
                             f"{tuple(x.shape)}") from None
        return bias

    def _apply(self, fn, recurse: bool = True):
        """``nn.Module._apply`` (``to``, ``to_empty``, ``half``...) that keeps the amax and
        pre_quant_scale values across the meta device: a buffer sent to meta (a model built on meta, then
        restored, as large models are) keeps its values aside, and gets them back when ``to_empty``
        materialises it, instead of uninitialised memory. A meta buffer that never had values (calibrated
        on meta weights) is dropped there: uninitialised memory is no amax, and an uncalibrated quantizer
        is well defined."""
        before = {name: self._buffers.get(name) for name in _KEPT_ON_META}
        super()._apply(fn, recurse)
        kept = self.__dict__.setdefault("_meta_values", {})
        for name, old in before.items():
            new = self._buffers.get(name)
            if old is None or new is None or old.is_meta == new.is_meta:
                continue
            if new.is_meta:
                kept[name] = old.detach()
                continue
            held = kept.pop(name, None)
            if held is None:
                self._buffers.pop(name)
            else:
                with torch.no_grad():
                    new.copy_(held)
        self._bump()  # the buffers are new tensors (another device or dtype), their versions start again
        return self

    @property
    def amax_values(self) -> Optional[torch.Tensor]:
        """The amax with values: the buffer, or for a quantizer on the meta device the values it keeps
        aside (None where it has none: an uncalibrated quantizer, or an amax calibrated on meta)."""
        return self._values_of("_amax")

    @property
    def pre_quant_scale_values(self) -> Optional[torch.Tensor]:
        """``pre_quant_scale`` with values, as :attr:`amax_values`."""
        return self._values_of("_pre_quant_scale")

    def _values_of(self, name: str) -> Optional[torch.Tensor]:
        buf = self._buffers.get(name)
        if buf is not None and buf.is_meta:
            return self.__dict__.get("_meta_values", {}).get(name)
        return buf

    def amax_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the static amax for an input of ``shape``."""
        return static_amax_shape(self.spec, self._attrs.axis, tuple(shape))

    def check_fits(self, shape: tuple[int, ...]) -> None:
        """Raise ValueError, naming this quantizer, the key and its value, where ``axis`` / ``block_sizes``
        cannot quantize a tensor of ``shape`` (e.g. an axis beyond its dimensions)."""
        try:
            self.amax_shape(tuple(shape))
        except ValueError as exc:
            key, value = ("block_sizes", self.block_sizes) if self.spec.block is not None else ("axis", self.axis)
            raise ValueError(f"{self._qname}: {key}={value!r} does not fit a tensor of shape {tuple(shape)}: {exc}") from None

    def collect(self, x: torch.Tensor, row: Optional[Union[int, torch.Tensor]] = None) -> None:
        """Add ``x`` (times ``pre_quant_scale``, its row ``row`` if 2-D) to the calibration statistics (an
        empty ``x``, e.g. an expert's 0-token split, adds nothing)."""
        self._collect(self.pre_scale(x, row))

    def _collect(self, x: torch.Tensor) -> None:
        if self.needs_calibration and x.numel() > 0:
            if self._bias_calibrator is not None:  # the amax of x minus the running bias, as ModelOpt
                x = x.detach().float() - self._bias_calibrator.collect(x)
            self._calibrator.collect(static_amax(x, self.spec, self._attrs.axis, self._attrs.backend))
            if self.static_blocks:
                self._block_calibrator.collect(blocks_amax(x.detach(), self.spec.block, backend=self._attrs.backend))

    def load_calib_amax(self) -> None:
        """Make the calibrated amax the quantizer's; NaN/Inf raise, naming the quantizer."""
        amax = self._calibrator.compute_amax()
        if amax is None:
            return
        if not amax.is_meta and not bool(torch.isfinite(amax).all()):  # meta: shapes only, no values
            bad = "NaN" if bool(torch.isnan(amax).any()) else "Inf"
            raise CalibrationError(f"{self._qname}: calibration saw {bad} values (amax {amax.flatten()[:4].tolist()}...); check the "
                                   "model's activations or disable this quantizer")
        self.amax = amax
        self._calibrator.reset()
        if self.static_blocks and self._block_calibrator.compute_amax() is not None:
            self.block_amax = self._block_calibrator.compute_amax()  # finite: its max is the checked global amax
            self._block_calibrator.reset()
        if self._bias_calibrator is not None and self._bias_calibrator.compute_bias() is not None:
            self.bias_value = self._bias_calibrator.compute_bias()
            self._bias_calibrator.reset()

    def calibrate(self, x: torch.Tensor) -> None:
        """Calibrate on one tensor (a weight): the amax becomes this tensor's."""
        self._calibrator.reset()
        self._block_calibrator.reset()
        try:
            self.collect(x)
        except Exception as exc:
            _raise_named(exc, self._qname)
        self.load_calib_amax()

    @property
    def num_calib_batches(self) -> int:
        return self._calibrator.num_batches

    def _amax_for(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The amax the op uses: static (calibrated, or from ``x`` if never calibrated or ``type`` is
        "dynamic") or None where the op computes it (per block, per row, NVFP4's global amax)."""
        spec = self.spec
        if not spec.calibrated_amax:
            return None
        amax = self.amax if self.needs_calibration else None
        if amax is None and not spec.two_level:
            return static_amax(x, spec, self._attrs.axis, self._attrs.backend)
        return amax

    def _fake_quant(self, x: torch.Tensor, amax: Optional[torch.Tensor], block_amax: Optional[torch.Tensor]) -> torch.Tensor:
        """The op with this quantizer's spec, backend and straight-through rule (``pass_through_bwd``)."""
        return ops.fake_quant(x, self.spec, amax, self._attrs.backend, block_amax, not self._attrs.pass_through_bwd)

    def _block_amax_for(self) -> Optional[torch.Tensor]:
        """The stored block amax where the op uses it: static NVFP4 blocks with a calibrated global amax."""
        return self.block_amax if self.static_blocks and self.amax is not None else None

    def running_amax_quant(self, x: torch.Tensor) -> torch.Tensor:
        """Fake quant with the statistics collected so far (for chained calibration)."""
        try:
            if self._attrs.bias is not None:
                raise NotImplementedError(f"bias={self._attrs.bias}: a quantizer with a bias cannot be a member of a SequentialQuantizer")
            x = self.pre_scale(x)
            if self._calibrator.compute_amax() is not None:
                return self._fake_quant(x, self._calibrator.compute_amax(), self._block_calibrator.compute_amax())
            return self._fake_quant(x, self._amax_for(x), self._block_amax_for())
        except Exception as exc:
            _raise_named(exc, self._qname)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, row: Optional[Union[int, torch.Tensor]] = None) -> torch.Tensor:
        """Fake-quantize ``x``; ``row``: the expert whose tokens ``x`` holds (a 2-D ``pre_quant_scale``)."""
        x = self.pre_scale(x, row)
        if self._disabled or x.numel() == 0:
            return x
        # the try costs (next to) nothing until something raises; the name is formatted only then
        try:
            if self._if_calib:
                self._collect(x)  # x is already pre-scaled
            if not self._if_quant:
                return x
            if self._attrs.bias is not None:
                return self._affine_fake_quant(x)
            return self._fake_quant(x, self._amax_for(x), self._block_amax_for())
        except Exception as exc:
            _raise_named(exc, self._qname)

    def _affine_fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        """``fq(x - b) + b`` in fp32, cast to ``x``'s dtype (see :mod:`quantlib.nn.bias_collector`)."""
        bias = self._bias_for(x).to(x.device)
        shifted = x.float() - bias
        return (self._fake_quant(shifted, self._amax_for(shifted), self._block_amax_for()) + bias).to(x.dtype)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        # The amax buffer exists only once calibrated; a state dict that has one brings it along.
        for name in ("_amax", "_pre_quant_scale", "_bias_value", "_block_amax"):
            key = prefix + name
            if key in state_dict and name not in self._buffers:
                if name == "_bias_value" and self._attrs.bias is None:
                    error_msgs.append(f"{prefix}_bias_value: the state dict has a bias, but this quantizer's config has no 'bias'")
                    continue
                fp32 = name in ("_amax", "_bias_value", "_block_amax")
                self.register_buffer(name, torch.empty_like(state_dict[key], dtype=torch.float32 if fp32 else state_dict[key].dtype))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        self._bump()

    def extra_repr(self) -> str:
        if self._disabled:
            return "disabled"
        s = self.spec
        fmt = s.kind.value + (f"{s.num_bits}" if s.element is None else f"e{s.element[0]}m{s.element[1]}")
        parts = [fmt]
        if self._attrs.axis is not None:
            parts.append(f"axis={self._attrs.axis}")
        if s.block is not None:
            parts.append(f"block={s.block}")
        if s.dynamic:
            parts.append("dynamic")
        elif self.static_blocks:
            parts.append("static blocks" + ("" if self.block_amax is None else f" [{tuple(self.block_amax.shape)}]"))
        amax = self.amax
        if amax is not None:
            parts.append(f"amax={amax.item():.4g}" if amax.numel() == 1 else f"amax=[{tuple(amax.shape)}]")
        if self.pre_quant_scale is not None:
            parts.append(f"pre_quant_scale={list(self.pre_quant_scale.shape)}")
        if self._attrs.bias is not None:
            parts.append("bias=" + ("uncalibrated" if self.bias_value is None else f"[{tuple(self.bias_value.shape)}]"))
        return " ".join(parts)
