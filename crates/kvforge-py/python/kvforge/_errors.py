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

    def __str__(self):
        # An argument error of the native module carries PyO3's note "while processing
        # '<argument>'": name the argument in the message itself.
        msg = super().__str__()
        for note in getattr(self, "__notes__", ()):
            prefix = "while processing '"
            if isinstance(note, str) and note.startswith(prefix) and note.endswith("'"):
                return f"{note[len(prefix):-1]}: {msg}"
        return msg

    def __reduce__(self):
        return (type(self), (str(self), self.kind))
