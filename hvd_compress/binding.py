"""What the PyTorch and TensorFlow bindings check and resolve alike, written once.

Every wrapper of either binding (``hvd_compress.torch.DistributedOptimizer``,
``hvd_compress.tensorflow.DistributedGradientTape``,
``hvd_compress.tensorflow.keras.DistributedOptimizer``) takes Horovod's arguments and
checks them here, at construction, before any collective or connection, with the same
messages: each names the argument, the value given and what to pass instead.

- :func:`check_horovod_arguments`: ``op``, ``gradient_predivide_factor``,
  ``groups``/``num_groups`` and ``backward_passes_per_step``;
- :func:`resolve_ps`: ``ps=`` and its default ``$HVD_COMPRESS_PS``
  (:data:`~hvd_compress.ps_protocol.PS_ENV`);
- :func:`resolve_compression`: ``compression=`` as a scheme, including Horovod's own
  ``hvd.Compression.none``/``hvd.Compression.fp16`` of the binding's framework;
- :func:`check_wrappable`: the wrapped optimizer is not one that exchanges by itself (the
  1-bit Adam family).

(``init(ps="mpi")`` of both bindings is :func:`hvd_compress.mpmd.init`, and
``connect_timeout=`` is checked by
:func:`hvd_compress.comm.ps_transport.base.check_timeout`.)

Importing this module imports neither torch, TensorFlow nor Horovod. The Horovod module
of the binding is passed in where its constants are needed, and Horovod's compressors are
recognised by the module and name of their class (:data:`HOROVOD_COMPRESSORS`), so
neither framework's Horovod library is imported to recognise the other's. The schemes and
the servers' syntax check need torch; :func:`resolve_compression` and :func:`resolve_ps`
import them when called, which only a binding does.
"""

from __future__ import annotations

import os
from typing import Any

from hvd_compress.ps_protocol import PS_ENV as PS_ENV  # re-exported: older imports

FRAMEWORKS = ("torch", "tensorflow")
"""The bindings' frameworks, as named by Horovod's packages (``horovod.torch``,
``horovod.tensorflow``)."""

HOROVOD_COMPRESSORS: dict[str, dict[str, str]] = {
    framework: {f"horovod.{framework}.compression.NoneCompressor": "none",
                f"horovod.{framework}.compression.FP16Compressor": "fp16"}
    for framework in FRAMEWORKS
}
"""Per framework, Horovod's own compressor classes (``module.ClassName``: Horovod 0.28's
``hvd.Compression.none`` and ``hvd.Compression.fp16`` are these classes, not instances)
and the name of the :class:`hvd_compress.Compression` scheme each means (``none``: the
plain all-reduce; ``fp16``: the same cast to float16 and back)."""


def _horovod_op_name(horovod: Any, op: Any) -> str:
    for name in ("Average", "Sum", "Adasum"):
        if op == getattr(horovod, name, object()):
            return f"hvd.{name}"
    return repr(op)


def check_horovod_arguments(horovod: Any, *, op: Any, gradient_predivide_factor: float,
                            groups: Any, num_groups: int, backward_passes_per_step: int = 1,
                            average_aggregated_gradients: bool = False,
                            accumulation: str | None = None) -> None:
    """Check the arguments that both bindings take from Horovod's wrappers.

    ``horovod`` is the binding's Horovod module (``horovod.torch`` or
    ``horovod.tensorflow``), read for ``Average``, ``Sum`` and ``Adasum``. Raises
    ``ValueError`` for:

    - ``op`` other than ``hvd.Average`` or ``hvd.Sum`` (``hvd.Adasum`` combines gradients
      by their directions, which a compressed exchange does not carry);
    - ``gradient_predivide_factor`` other than 1.0 without ``op=hvd.Average`` (as in
      Horovod: the factor divides before the sum and multiplies back after the average);
    - ``groups`` given or ``num_groups`` non-zero (Horovod's explicit fusion groups; its
      tensor fusion still batches small tensors without them);
    - ``backward_passes_per_step`` that is not an integer >= 1; and, when ``accumulation``
      is given (a wrapper that leaves local accumulation to its framework; the string says
      what to use instead), ``backward_passes_per_step`` other than 1 or
      ``average_aggregated_gradients`` (Horovod Keras' option for that accumulation) true.
    """
    op_name = _horovod_op_name(horovod, op)
    if op != horovod.Average and op != horovod.Sum:
        raise ValueError(f"op must be hvd.Average or hvd.Sum, got op={op_name}: Adasum does "
                         "not compose with gradient compression; pass op=hvd.Average (the "
                         "default) or op=hvd.Sum")
    if gradient_predivide_factor != 1.0 and op != horovod.Average:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor!r} is only "
                         f"supported with op=hvd.Average, got op={op_name}; pass "
                         "op=hvd.Average or leave gradient_predivide_factor at 1.0")
    if groups is not None or num_groups:
        given = f"groups={groups!r}" if groups is not None else f"num_groups={num_groups!r}"
        raise ValueError(f"groups/num_groups are not supported by hvd_compress, got {given}; "
                         "omit them (Horovod's tensor fusion still batches small tensors)")
    passes = backward_passes_per_step
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {passes!r}")
    if accumulation is not None and passes != 1:
        raise ValueError(f"backward_passes_per_step must be 1 here, got {passes!r}: "
                         f"{accumulation}")
    if accumulation is not None and average_aggregated_gradients:
        raise ValueError("average_aggregated_gradients must be False here, got "
                         f"{average_aggregated_gradients!r}: {accumulation}")


def resolve_ps(ps: str | None) -> str | None:
    """The servers' spec for ``ps=``: ``ps`` itself, or ``$HVD_COMPRESS_PS`` when it is
    ``None``; ``None`` for no servers (``ps=""``, or neither given: ``ps=""`` turns the
    environment's servers off).

    Checked for syntax only by its transport, nothing is contacted
    (:func:`~hvd_compress.comm.ps_transport.check_spec`): ``ValueError`` naming the bad
    address, where it came from (``ps=`` or ``$HVD_COMPRESS_PS``) and the accepted forms;
    ``TypeError`` for a ``ps`` that is not a string. Returned stripped, ``"mpi"`` in lower
    case.
    """
    from hvd_compress.comm.ps_transport import check_spec  # needs torch

    origin = "ps"
    if ps is None:
        ps, origin = os.environ.get(PS_ENV, ""), f"${PS_ENV}"
    if isinstance(ps, str) and not ps.strip():
        return None
    return check_spec(ps, origin)


def horovod_compressor(compression: Any) -> tuple[str, str] | None:
    """``(framework, scheme name)`` when ``compression`` is one of Horovod's own compressors
    of :data:`HOROVOD_COMPRESSORS` (the class, as ``hvd.Compression.fp16`` is, or an
    instance of it), else ``None``. Recognised by its class's module and name, so
    neither framework is imported."""
    kind = compression if isinstance(compression, type) else type(compression)
    qualified = f"{kind.__module__}.{kind.__qualname__}"
    for framework, compressors in HOROVOD_COMPRESSORS.items():
        if qualified in compressors:
            return framework, compressors[qualified]
    return None


AVERAGES_ITSELF = "averages_across_ranks"
"""A class attribute, true on optimizers that run their own exchange across ranks in
``step()`` (``OneBitAdam``, ``OneBitLamb``, ``ZeroOneAdam``, Keras ``OneBitAdam``)."""


def check_wrappable(optimizer: Any) -> None:
    """Refuse (``TypeError``) to wrap an optimizer that averages across ranks by itself:
    wrapped, every step would exchange twice, the second time its already averaged
    gradients, with the wrapper's scheme on top of its own."""
    if getattr(optimizer, AVERAGES_ITSELF, False):
        name = type(optimizer).__name__
        raise TypeError(f"{name} averages across ranks by itself (its own compressed "
                        f"exchange in each step): use it as it is, without "
                        f"DistributedOptimizer, on every rank; its compression= and policy= "
                        f"arguments choose what it sends")


def resolve_compression(compression: Any, framework: str) -> Any:
    """The scheme for ``compression=`` of a wrapper of the ``framework`` binding
    (``"torch"`` or ``"tensorflow"``).

    A scheme of :class:`hvd_compress.Compression` is returned as it is; ``None`` is
    ``Compression.none``; Horovod's own ``hvd.Compression.none``/``hvd.Compression.fp16``
    of that framework's Horovod (``horovod.torch`` or ``horovod.tensorflow``; the class or
    an instance) are ``Compression.none``/``Compression.fp16``. Anything else raises
    ``TypeError`` saying what is accepted and what to do with the value given: a string
    goes through ``Compression.parse``, a scheme class is called with its options, the
    other framework's Horovod compressor is replaced by this one's.
    """
    if framework not in HOROVOD_COMPRESSORS:
        raise ValueError(f"framework must be one of {FRAMEWORKS}, got {framework!r}")
    from hvd_compress.compression import Compression  # the schemes need torch
    from hvd_compress.policy import Auto
    from hvd_compress.schemes.base import Scheme

    if compression is None:
        return Compression.none
    if isinstance(compression, (Scheme, Auto)):
        return compression
    horovods = horovod_compressor(compression)
    if horovods is not None and horovods[0] == framework:
        return getattr(Compression, horovods[1])
    accepted = ("compression must be a scheme of hvd_compress.Compression (Compression.none, "
                "Compression.fp16, Compression.qsgd(bits=4), Compression.parse('topk:ratio="
                "0.01'), ...) or Horovod's own hvd.Compression.none or hvd.Compression.fp16 "
                f"(hvd = horovod.{framework})")
    if horovods is not None:
        other, name = horovods
        raise TypeError(f"{accepted}; got horovod.{other}.Compression.{name}, the compressor "
                        f"of Horovod's {other} library: pass horovod.{framework}.Compression."
                        f"{name} or Compression.{name}")
    if isinstance(compression, type) and issubclass(compression, Scheme):
        raise TypeError(f"{accepted}; got the class {compression.__name__} itself: call it "
                        f"with its options, e.g. Compression.{compression.name}()")
    if isinstance(compression, str):
        raise TypeError(f"{accepted}; got the string {compression!r}: use "
                        f"Compression.parse({compression!r})")
    kind = compression if isinstance(compression, type) else type(compression)
    what = "the class" if isinstance(compression, type) else "an instance of"
    raise TypeError(f"{accepted}; got {what} {kind.__module__}.{kind.__qualname__}")
