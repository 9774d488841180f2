"""The optional engine integrations say how to install their engine when it is missing."""

import importlib
import subprocess
import sys

import pytest

MODULE = "twofour.integrations.torchtitan"


def test_missing_torchtitan_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchtitan.components.optimizer", None)  # an import of it fails
    for name in [m for m in sys.modules if m.startswith("twofour.integrations.")]:  # imported afresh
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match=r'pip install "twofour\[torchtitan\]"') as e:
        importlib.import_module(MODULE)
    assert "\n" not in str(e.value)


def test_import_twofour_does_not_import_the_integrations():
    code = ("import sys, twofour; "
            "sys.exit(any(m.startswith(('torchtitan', 'twofour.integrations')) for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], timeout=300).returncode == 0
