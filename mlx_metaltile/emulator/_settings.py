"""How launches run: ``configure()`` and the MLX_METALTILE_EMULATOR_* environment settings,
both checked by the same rules."""

from __future__ import annotations

import os
from dataclasses import dataclass


def _check_strict(value) -> bool:
    return bool(value)


def _check_shuffle_seed(value) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise TypeError(f"[emulator] shuffle_seed must be an int or None, "
                        f"got {type(value).__name__}")
    return value


def _check_workers(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 16:
        raise ValueError(f"[emulator] workers must be an int in [1, 16], got {value!r}")
    return value


def _check_stack_kb(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 16:
        raise ValueError(f"[emulator] stack_kb must be an int >= 16, got {value!r}")
    return value


def _check_timeout_s(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"[emulator] timeout_s must be a number >= 0, got {value!r}")
    return float(value)


# setting: (its check, its environment variable, how the variable's text is read)
_RULES = {
    "strict": (_check_strict, "MLX_METALTILE_EMULATOR_STRICT", int),
    "shuffle_seed": (_check_shuffle_seed, "MLX_METALTILE_EMULATOR_SHUFFLE_SEED", int),
    "workers": (_check_workers, "MLX_METALTILE_EMULATOR_WORKERS", int),
    "stack_kb": (_check_stack_kb, "MLX_METALTILE_EMULATOR_STACK_KB", int),
    "timeout_s": (_check_timeout_s, "MLX_METALTILE_EMULATOR_TIMEOUT_S", float),
}


def _from_env(name: str, default):
    check, var, parse = _RULES[name]
    text = os.environ.get(var)
    if text is None or text == "":
        return default
    try:
        value = parse(text)
    except ValueError:
        kind = "an integer" if parse is int else "a number"
        raise ValueError(f"[emulator] {var} must be {kind}, got {text!r}") from None
    try:
        return check(value)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{e} (from the environment variable {var}={text!r})") from None


@dataclass
class Settings:
    """How launches run. Defaults come from the environment:
    MLX_METALTILE_EMULATOR_STRICT=1, MLX_METALTILE_EMULATOR_SHUFFLE_SEED=<int>,
    MLX_METALTILE_EMULATOR_WORKERS=<n>, MLX_METALTILE_EMULATOR_STACK_KB=<kib>,
    MLX_METALTILE_EMULATOR_TIMEOUT_S=<seconds> (0: no limit), each checked as configure()
    checks the same setting."""

    strict: bool = False
    shuffle_seed: int | None = None
    workers: int = 4
    stack_kb: int = 128
    timeout_s: float = 120.0

    @classmethod
    def from_environment(cls) -> Settings:
        return cls(strict=_from_env("strict", False),
                   shuffle_seed=_from_env("shuffle_seed", None),
                   workers=_from_env("workers", min(4, os.cpu_count() or 1)),
                   stack_kb=_from_env("stack_kb", 128),
                   timeout_s=_from_env("timeout_s", 120.0))


current = Settings.from_environment()
_UNSET = object()


def configure(*, strict=_UNSET, shuffle_seed=_UNSET, workers=_UNSET, stack_kb=_UNSET,
              timeout_s=_UNSET) -> Settings:
    """Change how later launches run; returns the previous settings.

    strict: also report reads of threadgroup memory never written since the threadgroup
      started, and shuffles that read an inactive lane.
    shuffle_seed: None for the natural order; an int permutes (deterministically) the order in
      which the threads of each threadgroup run and the order of the threadgroups, to expose
      kernels whose result depends on it.
    workers: threads running threadgroups concurrently. stack_kb: stack per kernel thread.
    timeout_s: a launch running longer raises KernelTimeout (an endless loop or a spin-wait);
      0 disables the limit.
    """
    previous = Settings(**vars(current))
    given = {"strict": strict, "shuffle_seed": shuffle_seed, "workers": workers,
             "stack_kb": stack_kb, "timeout_s": timeout_s}
    checked = {name: _RULES[name][0](value) for name, value in given.items()
               if value is not _UNSET}
    for name, value in checked.items():
        setattr(current, name, value)
    return previous


def settings() -> Settings:
    return Settings(**vars(current))
