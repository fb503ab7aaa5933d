"""Transport: ucxx owns UCX objects; `_native` does the batched data path."""

from .runtime import UcxRuntime

__all__ = ["UcxRuntime"]
