"""psgrad: a parameter server over MPI whose every gradient travels through a codec."""

from .codecs import Codec, Message, available_codecs, make_codec
from .comm import wire
from .comm.wire import WireError
from .feedback import DGCMemory, ErrorFeedback, make_feedback

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
