"""Wire protocol shared by the frontend, scheduler and worker processes."""

from pagedserve.protocol.codec import MAX_FRAME_BYTES, PROTOCOL_VERSION, Decoder, ProtocolError, encode
from pagedserve.protocol.messages import *  # noqa: F401,F403

__all__ = ["MAX_FRAME_BYTES", "PROTOCOL_VERSION", "Decoder", "ProtocolError", "encode"]
