"""PyTorch binding: a drop-in for ``horovod.torch.DistributedOptimizer`` taking any scheme."""

from hvd_compress.torch.optimizer import DistributedOptimizer, broadcast_optimizer_state, init

__all__ = ["DistributedOptimizer", "broadcast_optimizer_state", "init"]
