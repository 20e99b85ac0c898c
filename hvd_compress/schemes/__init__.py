"""One file per compression scheme; see hvd_compress.Compression."""
