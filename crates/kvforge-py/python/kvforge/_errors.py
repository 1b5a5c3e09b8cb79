"""The one exception kvforge raises."""


class KvforgeError(ValueError, RuntimeError):
    """Any kvforge failure: a bad argument (wrong dtype, device, shape, a non-contiguous
    tensor, an unknown tier), a missing GPU / driver / NVRTC, a full cache, a corrupt page.

    It is both a ``ValueError`` and a ``RuntimeError`` so callers catching either see it.
    ``kind`` names the runtime's error variant (``"BadInput"``, ``"ShapeMismatch"``,
    ``"NonFinite"``, ``"Duplicate"``, ``"WrongState"``, ``"NotInSpec"``, ``"NoDriver"``,
    ``"OutOfPages"``, ``"KernelFault"``, ``"Spec"``, ...); the message says what to do.
    """

    def __init__(self, message: str, kind: str = "Error"):
        super().__init__(message)
        self.kind = kind

    def __reduce__(self):
        return (type(self), (str(self), self.kind))
