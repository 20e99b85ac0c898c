"""``python -m hvd_compress.native``: load the kernels (the extension built at install, or
a run-time build into the cache, which warns) and print the library's path.

``python -m hvd_compress.native build``: compile the installed extension again, in place,
for this machine's CPU (or for ``$HVD_COMPRESS_MARCH``, e.g. ``x86-64-v2`` for an
environment shared by several CPU types), with the record of the CPU features it needs;
print its path and those features."""

import argparse

from hvd_compress.native import cpu, installed_path, library, library_path, loader

parser = argparse.ArgumentParser(prog="python -m hvd_compress.native",
                                 description=__doc__.split("\n\n")[0])
parser.add_argument("command", nargs="?", choices=["load", "build"], default="load",
                    help="load (default): load the kernels and print the path; build: "
                         "rebuild the installed extension for this CPU or "
                         "$HVD_COMPRESS_MARCH")
args = parser.parse_args()
if args.command == "build":
    try:
        path = loader.rebuild_extension()
    except (OSError, RuntimeError) as err:
        raise SystemExit(f"hvd_compress: building the native kernels failed: {err}") from None
    record = cpu.read_record(path) or {}
    print(f"{path} (-march={loader.march()}; CPU features: "
          f"{' '.join(record.get('features', [])) or 'none'})")
    refused = loader.refusal(path)
    if refused is not None:
        raise SystemExit(f"hvd_compress: built, but not usable on this machine: {refused}")
else:
    lib = library()
    if lib is None:
        raise SystemExit("hvd_compress: the native kernels are unavailable (see the warning)")
    print(lib._name if lib._name else installed_path() or library_path())
