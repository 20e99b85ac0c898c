"""Collectives: the Communicator protocol, its implementations, the compressed all-reduce."""
