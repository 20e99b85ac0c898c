"""Finding the native kernels: the extension compiled at install, else (with a warning) a
run-time build; never a build of other sources."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from hvd_compress.native import loader
from hvd_compress.native import sparse as native_sparse


def test_the_installed_extension_is_used_without_warning(recwarn):
    path = loader.installed_path()
    assert path is not None and path.name.startswith("_kernels"), path
    lib = loader._load()
    assert lib._name == str(path)
    assert loader._built_hash(lib) == loader.source_hash()
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_missing_extension_falls_back_to_a_warned_run_time_build(monkeypatch, tmp_path):
    monkeypatch.setenv("HVD_COMPRESS_CACHE", str(tmp_path))
    monkeypatch.setattr(loader, "installed_path", lambda: None)
    with pytest.warns(RuntimeWarning, match="not compiled when hvd-compress was installed"):
        lib = loader._load()
    assert Path(lib._name).parent == tmp_path / "native"
    assert loader._built_hash(lib) == loader.source_hash()
    idx = np.array([3, 4, 900], np.int64)  # the fallback build really codes
    out = np.empty(16, np.uint8)
    n = lib.hvdc_varint_encode(idx.ctypes.data, len(idx), out.ctypes.data)
    assert out[:n].tolist() == [3, 0, 0xFF, 0x06]  # gaps 3, 0, 895 = 0x37F as LEB128


def test_extension_of_other_sources_is_never_used(monkeypatch, tmp_path):
    stale = tmp_path / "_kernels.stale.so"
    subprocess.run(["g++", "-shared", "-fPIC", '-DHVDC_SOURCE_HASH="0000000000000000"', "-o",
                    str(stale), str(loader.HERE / "version.cpp")], check=True, timeout=120)
    monkeypatch.setenv("HVD_COMPRESS_CACHE", str(tmp_path))
    monkeypatch.setattr(loader, "installed_path", lambda: stale)
    with pytest.warns(RuntimeWarning, match="built from other kernel sources"):
        lib = loader._load()
    assert lib._name != str(stale) and loader._built_hash(lib) == loader.source_hash()


def test_sparse_kernels_load_through_the_torch_free_loader():
    assert native_sparse.varint_index_nbytes(np.array([0, 1, 300], np.int64)) == 4
