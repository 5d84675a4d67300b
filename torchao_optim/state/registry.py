"""Registry of optimizer-state formats by name: optimizers ask for ``state_format="dtq8"`` and never import a format."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["register_state_format", "get_state_format", "list_state_formats"]

_FORMATS: dict[str, type] = {}


def register_state_format(name: str) -> Callable[[type], type]:
    """Class decorator: make a :class:`~torchao_optim.state.QuantizedState` subclass available as ``name``."""
    if not isinstance(name, str) or not name or name == "none":
        raise ValueError(f"a state format name must be a non-empty string other than 'none', got {name!r}")

    def decorator(cls: type) -> type:
        from torchao_optim.state.base import QuantizedState

        if not (isinstance(cls, type) and issubclass(cls, QuantizedState)):
            raise TypeError(f"register_state_format({name!r}) expects a QuantizedState subclass, got {cls!r}")
        if name in _FORMATS and _FORMATS[name] is not cls:
            raise ValueError(f"state format {name!r} is already registered by {_FORMATS[name].__qualname__}")
        _FORMATS[name] = cls
        cls.format_name = name
        return cls

    return decorator


def get_state_format(name: str) -> type:
    """The format class registered as ``name``."""
    try:
        return _FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown state format {name!r}; registered formats: {list_state_formats()}") from None


def list_state_formats() -> list[str]:
    """Names of the registered formats, sorted."""
    return sorted(_FORMATS)
