"""Finding the native kernels: the extension compiled at install, else (with a warning) a
run-time build; never a build of other sources, and never one made for CPU features the
running CPU lacks (checked from the record beside the library, before loading it)."""

from __future__ import annotations

import ctypes
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from hvd_compress import Compression, native
from hvd_compress.native import cpu, loader
from hvd_compress.native import sparse as native_sparse

X86_64_V2 = {"pni", "ssse3", "sse4_1", "sse4_2", "popcnt", "lahf_lm", "cx16"}
"""What ``-march=x86-64-v2`` records (asserted by the test that builds it)."""


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run-time build cache for the tests of this module: builds for the same CPU and
    flags are compiled once."""
    return tmp_path_factory.mktemp("hvdc-cache")


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The paths of the libraries opened (``ctypes.CDLL``) during the test."""
    paths: list[str] = []
    real = ctypes.CDLL

    def spy(name: str, *args: object, **kwargs: object) -> ctypes.CDLL:
        paths.append(str(name))
        return real(name, *args, **kwargs)

    monkeypatch.setattr(loader.ctypes, "CDLL", spy)
    yield paths


def fake_cpu(monkeypatch: pytest.MonkeyPatch, flags: set[str]) -> None:
    """Make the library see a CPU with exactly ``flags`` (the real model name)."""
    info = cpu.CpuInfo(cpu.cpu_info().model, frozenset(flags))
    monkeypatch.setattr(cpu, "cpu_info", lambda: info)


def recorded_features() -> list[str]:
    path = loader.installed_path()
    assert path is not None
    record = cpu.read_record(path)
    assert record is not None, f"{path} has no CPU record: reinstall (pip install -e .)"
    return record["features"]


def test_the_installed_extension_is_used_without_warning(recwarn):
    path = loader.installed_path()
    assert path is not None and path.name.startswith("_kernels"), path
    lib = loader._load()
    assert lib._name == str(path)
    assert loader._built_hash(lib) == loader.source_hash()
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_the_build_records_the_cpu_features_it_was_compiled_for():
    """The record beside the installed extension (written by setup.py) names what its
    compiler flags enabled, the library compiled the same list in, and this CPU has them."""
    path = loader.installed_path()
    record = cpu.read_record(path)
    assert record is not None and record["source_hash"] == loader.source_hash()
    assert record["march"] == loader.march()
    lib = ctypes.CDLL(str(path))
    assert loader._built_features(lib) == record["features"]
    assert not cpu.missing(record["features"])


def test_version_cpp_compiles_in_the_same_feature_table():
    text = (loader.HERE / "version.cpp").read_text()
    pairs = re.findall(r'#ifdef (\w+)\n\s+" (\w+)"\n#endif', text)
    assert dict(pairs) == cpu.FEATURE_MACROS and len(pairs) == len(cpu.FEATURE_MACROS)


def test_cpu_flags_are_those_every_core_has():
    text = ("processor\t: 0\nmodel name\t: A\nflags\t\t: sse2 avx2 avx512f\n\n"
            "processor\t: 1\nmodel name\t: B\nflags\t\t: sse2 avx2\n")
    info = cpu.parse_cpuinfo(text)
    assert info.flags == {"sse2", "avx2"} and info.model == "A / B" and info.known
    assert cpu.missing(["avx512f", "avx2"], info) == ["avx512f"]
    unknown = cpu.parse_cpuinfo("processor\t: 0\n")
    assert not unknown.known and cpu.missing(["avx2"], unknown) == []


def test_extension_built_for_missing_features_is_not_loaded_but_a_portable_build_is(
        monkeypatch, cache, opened):
    """A CPU without a feature the installed extension was compiled for: the extension is
    never opened, the warning names the feature and the fixes, and a run-time build for
    ``$HVD_COMPRESS_MARCH=x86-64-v2`` (which needs only what this CPU has) is used."""
    beyond_v2 = sorted(set(recorded_features()) - X86_64_V2)
    if not beyond_v2:
        pytest.skip("the installed extension needs nothing beyond x86-64-v2")
    lacking = beyond_v2[-1]
    installed = loader.installed_path()
    fake_cpu(monkeypatch, set(cpu.cpu_info().flags) - {lacking})
    monkeypatch.setenv("HVD_COMPRESS_CACHE", str(cache))
    monkeypatch.setenv("HVD_COMPRESS_MARCH", "x86-64-v2")
    with pytest.warns(RuntimeWarning, match=f"CPU features this CPU lacks: {lacking};") as got:
        lib = loader._load()
    message = str(got[0].message)
    assert "python -m hvd_compress.native build" in message
    assert "HVD_COMPRESS_MARCH=x86-64-v2" in message
    assert str(installed) not in opened and opened == [lib._name]
    assert Path(lib._name).parent == cache / "native"
    assert set(cpu.read_record(Path(lib._name))["features"]) == X86_64_V2
    assert loader._built_features(lib) == sorted(X86_64_V2)
    idx = np.array([3, 4, 900], np.int64)  # the portable build really codes
    out = np.empty(16, np.uint8)
    n = lib.hvdc_varint_encode(idx.ctypes.data, len(idx), out.ctypes.data)
    assert out[:n].tolist() == [3, 0, 0xFF, 0x06]


def test_without_a_usable_build_the_codecs_take_the_torch_route(monkeypatch, tmp_path,
                                                                 opened):
    """The same CPU mismatch where no run-time build can be made (the compiler fails):
    nothing is opened, the kernels are unavailable with a warning that names the missing
    feature, and the codecs run their torch code."""
    lacking = recorded_features()[-1]
    fake_cpu(monkeypatch, set(cpu.cpu_info().flags) - {lacking})
    monkeypatch.setenv("HVD_COMPRESS_CACHE", str(tmp_path))
    monkeypatch.setenv("HVD_COMPRESS_CXX", "false")
    monkeypatch.setattr(loader, "_library", None)
    monkeypatch.setattr(loader, "_failure", None)
    with pytest.warns(RuntimeWarning, match=f"native kernels unavailable.*lacks: {lacking}"):
        assert loader.library() is None
    assert opened == []
    assert not native.available() and not native.active(torch.zeros(1))
    scheme, x = Compression.onebit(bucket_size=64), torch.randn(1000)
    payload = scheme.encode(x, torch.Generator())
    with native.disabled():
        assert torch.equal(payload, scheme.encode(x, torch.Generator()))
        assert torch.equal(scheme.decode(payload, 1000), scheme.decode(payload, 1000))


def test_matching_flags_load_the_extension(monkeypatch, opened, recwarn):
    """A CPU with exactly the recorded features (nothing more) loads the extension."""
    installed = loader.installed_path()
    fake_cpu(monkeypatch, set(recorded_features()))
    lib = loader._load()
    assert lib._name == str(installed) and opened == [str(installed)]
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_extension_without_a_record_is_never_opened(monkeypatch, tmp_path, cache, opened):
    copy = tmp_path / "_kernels.norecord.so"
    shutil.copyfile(loader.installed_path(), copy)
    monkeypatch.setenv("HVD_COMPRESS_CACHE", str(cache))
    monkeypatch.setattr(loader, "installed_path", lambda: copy)
    with pytest.warns(RuntimeWarning, match="has no record of the CPU features") as got:
        lib = loader._load()
    assert "python -m hvd_compress.native build" in str(got[0].message)
    assert str(copy) not in opened and Path(lib._name).parent == cache / "native"


def test_a_record_that_is_not_the_librarys_own_is_caught(monkeypatch, tmp_path, cache):
    """A record listing fewer features than the library compiled in (the record of another
    build): the library is opened (the record allowed it) but none of its kernels runs."""
    copy = tmp_path / "_kernels.stale-record.so"
    shutil.copyfile(loader.installed_path(), copy)
    record = cpu.read_record(loader.installed_path())
    record["features"] = record["features"][:-1]
    cpu.record_path(copy).write_text(json.dumps(record))
    monkeypatch.setenv("HVD_COMPRESS_CACHE", str(cache))
    monkeypatch.setattr(loader, "installed_path", lambda: copy)
    with pytest.warns(RuntimeWarning, match="is not the build its record"):
        lib = loader._load()
    assert Path(lib._name).parent == cache / "native"


def test_missing_extension_falls_back_to_a_warned_run_time_build(monkeypatch, cache):
    monkeypatch.setenv("HVD_COMPRESS_CACHE", str(cache))
    monkeypatch.setattr(loader, "installed_path", lambda: None)
    with pytest.warns(RuntimeWarning, match="not compiled when hvd-compress was installed"):
        lib = loader._load()
    assert Path(lib._name).parent == cache / "native"
    assert loader._built_hash(lib) == loader.source_hash()
    assert cpu.read_record(Path(lib._name))["features"] == loader._built_features(lib)
    idx = np.array([3, 4, 900], np.int64)  # the fallback build really codes
    out = np.empty(16, np.uint8)
    n = lib.hvdc_varint_encode(idx.ctypes.data, len(idx), out.ctypes.data)
    assert out[:n].tolist() == [3, 0, 0xFF, 0x06]  # gaps 3, 0, 895 = 0x37F as LEB128


def test_extension_of_other_sources_is_never_used(monkeypatch, tmp_path, cache):
    stale = tmp_path / "_kernels.stale.so"
    command = ["g++", '-DHVDC_SOURCE_HASH="0000000000000000"']
    subprocess.run([*command, "-shared", "-fPIC", "-o", str(stale),
                    str(loader.HERE / "version.cpp")], check=True, timeout=120)
    cpu.write_record(stale, command, "default", "0000000000000000")
    monkeypatch.setenv("HVD_COMPRESS_CACHE", str(cache))
    monkeypatch.setattr(loader, "installed_path", lambda: stale)
    with pytest.warns(RuntimeWarning, match="built from other kernel sources"):
        lib = loader._load()
    assert lib._name != str(stale) and loader._built_hash(lib) == loader.source_hash()


def test_sparse_kernels_load_through_the_torch_free_loader():
    assert native_sparse.varint_index_nbytes(np.array([0, 1, 300], np.int64)) == 4
