"""The client of a vLLM publisher's replay socket: the batches its ROUTER still buffers from a sequence number on.

    DEALER -> [b"", start (8 bytes, big-endian)]
    ROUTER -> [b"", topic, sequence, payload] per buffered batch with sequence >= start, then the end marker

A fresh DEALER per request, so a late answer to an abandoned request is never read as the next one's. What
comes back is cut at the first number it skips: vLLM buffers a batch only after its PUB send returned, so a
batch whose send raised is missing from the replay for good, and applying what follows it would skip it
silently.
"""

from __future__ import annotations

import zmq
import zmq.asyncio

from kvservice.external.frames import decode_replay_frame

Frames = list[tuple[int, bytes]]  # (sequence, payload), in the order they came


async def fetch_replay(context: zmq.asyncio.Context, endpoint: str, start: int, timeout_s: float) -> Frames | None:
    """The publisher's buffered batches from `start` on; None when a frame did not come within `timeout_s`.
    Raises FrameError on a frame that is not a replay frame."""
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVHWM, 0)
    out: Frames = []
    try:
        dealer.connect(endpoint)
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            if not await dealer.poll(int(timeout_s * 1000)):
                return None
            frame = decode_replay_frame(await dealer.recv_multipart())
            if frame is None:
                return out
            out.append(frame)
    finally:
        dealer.close(0)


def consecutive(frames: Frames) -> tuple[Frames, tuple[int, int] | None]:
    """(the frames up to the first break in their numbering, (the number expected there, the one found));
    the second is None when there is no break."""
    for i in range(1, len(frames)):
        expected = frames[i - 1][0] + 1
        if frames[i][0] != expected:
            return frames[:i], (expected, frames[i][0])
    return frames, None
