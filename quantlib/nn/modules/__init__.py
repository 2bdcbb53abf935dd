"""Quantized versions of torch.nn modules; importing registers them."""

from . import conv, linear, norm  # noqa: F401  (registration)
