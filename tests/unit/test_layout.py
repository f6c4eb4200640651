import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_operator_is_the_standard_library():
    module = importlib.import_module("operator")
    assert module.__name__ == "operator"
    assert hasattr(module, "itemgetter")
    # the standard library's module lives outside the repository
    assert ROOT not in Path(module.__file__ or sys.base_prefix).resolve().parents


def test_operator_folder_is_not_a_package():
    assert not (ROOT / "operator" / "__init__.py").exists()
