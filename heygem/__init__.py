"""heygem: a face (video or photo) plus speech in, a lip-synced talking-head MP4 out.

The public entry point is :func:`heygem.pipeline.generate`; it is imported lazily
so that ``import heygem`` stays cheap (no torch, no mediapipe).
"""

from heygem.errors import HeygemError

__all__ = ["HeygemError", "generate"]
__version__ = "0.1.0"


def generate(*args, **kwargs):
    """Shortcut for :func:`heygem.pipeline.generate` (see its documentation)."""
    from heygem.pipeline import generate as _generate

    return _generate(*args, **kwargs)
