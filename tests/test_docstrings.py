"""Every public name has a docstring a reader of the API reference can use."""

from __future__ import annotations

import importlib
import inspect

import pytest

pytestmark = pytest.mark.timeout(60)

PUBLIC = ["paraloom", "paraloom.sync", "paraloom.spark", "paraloom.serving",
          "paraloom.inference"]


def _undocumented(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    missing = []
    for name in module.__all__:
        obj = getattr(module, name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue  # constants: documented where they are defined
        doc = inspect.getdoc(obj) or ""
        if len(doc) < 40:
            missing.append(f"{name}: {doc!r}")
        if inspect.isclass(obj):
            for attr, value in vars(obj).items():
                public = not attr.startswith("_")
                if public and (inspect.isfunction(value) or isinstance(value, property)) \
                        and not inspect.getdoc(value):
                    missing.append(f"{name}.{attr}")
    return missing


@pytest.mark.parametrize("module_name", PUBLIC)
def test_every_public_class_function_method_and_property_has_a_docstring(module_name):
    if module_name == "paraloom.spark":
        pytest.importorskip("pyspark")
    assert _undocumented(module_name) == []
