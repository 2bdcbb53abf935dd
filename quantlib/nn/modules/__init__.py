"""Quantized versions of torch.nn modules; importing registers them."""

from . import conv, linear  # noqa: F401  (registration)
