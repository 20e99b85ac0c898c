"""``python -m hvd_compress.native``: build the kernels (if not cached) and print the path."""

from hvd_compress.native import build

print(build())
