"""configure() and the MLX_METALTILE_EMULATOR_* environment settings follow the same rules."""

from __future__ import annotations

import re

import pytest

from mlx_metaltile import emulator as em
from mlx_metaltile.emulator._settings import Settings

BAD = [
    ("timeout_s", "MLX_METALTILE_EMULATOR_TIMEOUT_S", -5, "-5",
     "timeout_s must be a number >= 0"),
    ("timeout_s", "MLX_METALTILE_EMULATOR_TIMEOUT_S", float("nan"), "nan",
     "timeout_s must be a number >= 0"),
    ("workers", "MLX_METALTILE_EMULATOR_WORKERS", 0, "0", "workers must be an int in [1, 16]"),
    ("workers", "MLX_METALTILE_EMULATOR_WORKERS", 17, "17", "workers must be an int in [1, 16]"),
    ("stack_kb", "MLX_METALTILE_EMULATOR_STACK_KB", 8, "8", "stack_kb must be an int >= 16"),
]


@pytest.mark.parametrize(("name", "var", "value", "text", "message"), BAD)
def test_a_bad_setting_is_refused_alike_by_configure_and_the_environment(
        monkeypatch, name, var, value, text, message):
    before = em.settings()
    with pytest.raises(ValueError, match=rf"^\[emulator\] {re.escape(message)}"):
        em.configure(**{name: value})
    assert em.settings() == before
    monkeypatch.setenv(var, text)
    with pytest.raises(ValueError, match=rf"^\[emulator\] {re.escape(message)}.*{var}='{text}'"):
        Settings.from_environment()


def test_environment_text_that_is_no_number_is_refused(monkeypatch):
    monkeypatch.setenv("MLX_METALTILE_EMULATOR_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="MLX_METALTILE_EMULATOR_TIMEOUT_S must be a number, "
                                         "got 'soon'"):
        Settings.from_environment()


def test_good_environment_settings_are_read(monkeypatch):
    for var, text in (("STRICT", "1"), ("SHUFFLE_SEED", "7"), ("WORKERS", "2"),
                      ("STACK_KB", "64"), ("TIMEOUT_S", "0")):
        monkeypatch.setenv(f"MLX_METALTILE_EMULATOR_{var}", text)
    assert Settings.from_environment() == Settings(strict=True, shuffle_seed=7, workers=2,
                                                   stack_kb=64, timeout_s=0.0)
