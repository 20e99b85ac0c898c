"""No import cycles among the modules of ``hvd_compress`` and ``ps_server``
(``scripts/check_imports.py``, read statically: nothing is imported)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_imports", ROOT / "scripts" /
                                                  "check_imports.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


checker = _checker()

def _cycles_text(cycles: list[list[str]]) -> str:
    return "\n".join(checker.describe(c) for c in cycles)


def test_no_import_cycle_at_import_time() -> None:
    cycles = checker.find_cycles(checker.import_graph(ROOT))
    assert not cycles, f"import cycles:\n{_cycles_text(cycles)}"


def test_no_new_cycle_through_imports_in_functions() -> None:
    cycles = checker.find_cycles(checker.import_graph(ROOT, deferred=True))
    assert not cycles, f"import cycles (counting imports in functions):\n{_cycles_text(cycles)}"


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def test_the_checker_finds_a_cycle_and_prints_it(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    root = _package(tmp_path, {
        "hvd_compress/__init__.py": "",
        "hvd_compress/a.py": "from hvd_compress import b\n",
        "hvd_compress/b.py": "from . import c\n",
        "hvd_compress/c.py": "import hvd_compress.a\n",
        "hvd_compress/d.py": "from hvd_compress.a import name\n",
        "ps_server/__init__.py": "from .server import serve\n",
        "ps_server/server.py": "try:\n    from ps_server import serve\nexcept ImportError:\n"
                               "    pass\n",
    })
    assert checker.find_cycles(checker.import_graph(root)) == [
        ["hvd_compress.a", "hvd_compress.b", "hvd_compress.c", "hvd_compress.a"],
        ["ps_server", "ps_server.server", "ps_server"]]
    assert checker.main([str(root)]) == 1
    printed = capsys.readouterr().out
    assert "import cycle: hvd_compress.a -> hvd_compress.b -> hvd_compress.c -> " \
        "hvd_compress.a" in printed


def test_imports_in_functions_and_under_type_checking_close_no_cycle_at_import_time(
        tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "hvd_compress/__init__.py": "",
        "hvd_compress/a.py": "from hvd_compress.b import f\n",
        "hvd_compress/b.py": """\
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from hvd_compress.a import A
            else:
                from hvd_compress import c
            def f():
                from hvd_compress import a
            class K:
                import hvd_compress.c
            """,
        "hvd_compress/c.py": "",
        "ps_server/__init__.py": "",
    })
    graph = checker.import_graph(root)
    assert graph["hvd_compress.b"] == {"hvd_compress.c"}
    assert checker.find_cycles(graph) == []
    assert checker.main([str(root)]) == 0
    assert checker.find_cycles(checker.import_graph(root, deferred=True)) == [
        ["hvd_compress.a", "hvd_compress.b", "hvd_compress.a"]]


def test_names_moved_to_break_cycles_still_import_with_a_deprecation_warning() -> None:
    from hvd_compress import policy
    from hvd_compress.schemes import base, packed

    with pytest.warns(DeprecationWarning, match="moved to hvd_compress.schemes.packed"):
        assert base.PackedScheme is packed.PackedScheme
    with pytest.warns(DeprecationWarning, match="moved to hvd_compress.schemes.packed"):
        assert base.bucket_view is packed.bucket_view
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = base.nothing
    for name, target in (("hvd_compress.comm.compressed_allreduce", packed),
                         ("hvd_compress.schemes.auto", policy)):
        sys.modules.pop(name, None)
        with pytest.warns(DeprecationWarning, match="moved to"):
            module = importlib.import_module(name)
        if target is policy:
            assert module is policy
        else:
            assert module.chunk_sizes is packed.chunk_sizes
            assert module.compressed_allreduce is packed.compressed_allreduce
