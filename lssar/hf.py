"""Compatibility import: ``lssar.hf`` is :mod:`lssar.integrations.hf` (``lssar.hf.register()``)."""

from lssar.integrations.hf import *  # noqa: F403
from lssar.integrations.hf import __all__  # noqa: F401
