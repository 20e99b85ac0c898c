"""``python -m hvd_compress.native``: load the kernels (the extension built at install, or
a run-time build into the cache, which warns) and print the library's path."""

from hvd_compress.native import installed_path, library, library_path

lib = library()
if lib is None:
    raise SystemExit("hvd_compress: the native kernels are unavailable (see the warning)")
print(lib._name if lib._name else installed_path() or library_path())
