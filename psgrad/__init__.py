"""psgrad: a parameter server over MPI whose every gradient travels through a codec."""

from . import wire
from .codecs import Codec, Message, available_codecs, make_codec
from .feedback import DGCMemory, ErrorFeedback, make_feedback
from .wire import WireError

__version__ = "0.1.0"
__all__ = [
    "Codec",
    "DGCMemory",
    "ErrorFeedback",
    "Message",
    "WireError",
    "available_codecs",
    "make_codec",
    "make_feedback",
    "wire",
]
