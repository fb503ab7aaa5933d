"""The servers' event loop (transport/event_loop.py): uvloop unless
switched off (DISTORE_UVLOOP=0) or not installed, asyncio's loop then."""

from __future__ import annotations

import asyncio
import sys

import pytest

from distore_ucx.config import uvloop_enabled
from distore_ucx.errors import ConfigError
from distore_ucx.transport import event_loop


async def _which() -> tuple[str, str]:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(0)  # it runs coroutines, not only starts them
    return event_loop.loop_name(), type(loop).__module__


def test_servers_run_on_uvloop_when_it_is_installed():
    uvloop = pytest.importorskip("uvloop")
    name, module = event_loop.run(_which(), use_uvloop=True)
    assert name == f"uvloop {uvloop.__version__}"
    assert module.startswith("uvloop")


def test_switched_off_they_run_on_asyncios_loop():
    name, module = event_loop.run(_which(), use_uvloop=False)
    assert name == "asyncio"
    assert module.startswith("asyncio")


def test_without_uvloop_installed_they_fall_back_to_asyncios_loop(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    name, _ = event_loop.run(_which(), use_uvloop=True)
    assert name == "asyncio"


def test_run_returns_the_result_and_raises_the_error_of_its_coroutine():
    async def fails():
        raise ValueError("from the server")

    for use in (True, False):
        assert event_loop.run(asyncio.sleep(0, result=7), use_uvloop=use) == 7
        with pytest.raises(ValueError, match="from the server"):
            event_loop.run(fails(), use_uvloop=use)


def test_the_switch_is_on_by_default_and_says_what_it_takes(monkeypatch):
    monkeypatch.delenv("DISTORE_UVLOOP", raising=False)
    assert uvloop_enabled()
    monkeypatch.setenv("DISTORE_UVLOOP", "0")
    assert not uvloop_enabled()
    monkeypatch.setenv("DISTORE_UVLOOP", "maybe")
    with pytest.raises(ConfigError, match="DISTORE_UVLOOP must be 0 or 1"):
        uvloop_enabled()
