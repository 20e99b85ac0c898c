"""Parameter server for sparse gradient aggregation (``python -m ps_server``).

Modules: :mod:`~ps_server.store` (the shard store, no I/O) on top of
:mod:`~ps_server.rounds` (a tensor's rounds and their aggregate),
:mod:`~ps_server.identity` (workers bound to processes), :mod:`~ps_server.durability`
(change records, snapshots, replay) and :mod:`~ps_server.errors` (refusals);
:mod:`~ps_server.service` (decoding, counting, logging and checkpointing around the store,
shared by the transports), :mod:`~ps_server.grpc_transport`,
:mod:`~ps_server.mpi_transport`, :mod:`~ps_server.checkpoint`, :mod:`~ps_server.metrics`
and the command line in :mod:`ps_server.__main__`. The frames are defined in
:mod:`hvd_compress.sparse_wire`; the client is :mod:`hvd_compress.comm.ps_client`.
"""
