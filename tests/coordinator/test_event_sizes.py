"""A job whose events could not go out in one message is refused at submit (`too_large`, naming the limit),
never failed at its end: `coordinator.admission.largest_event` bounds each event's packed size, checked here
against real packed events, and `check_event_sizes` refuses with what fits."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.admission import check_event_sizes, largest_event
from coordinator.scheduler import Rejected
from schemas import DoneEvent, ErrorCode, FrameEvent, JobRequest, pack
from schemas.limits import MAX_PAYLOAD_BYTES

K = 4


def _events(request: JobRequest, sample: tuple, image: tuple, latent: bool):
    """The largest frame and the done a job of `request` publishes, as the coordinator builds them."""
    n = request.n_images
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, *sample)).astype(np.float16)
    frame = FrameEvent(
        job_id="j" * 64,
        step=40,
        steps=40,
        t=1.0,
        x=x,
        experts=[K - 1] * n,
        weights=rng.random((n, K)),
        x1=x if request.frame_x1 else None,
        preview=rng.standard_normal((n, *image)).astype(np.float16) if latent and request.preview_every else None,
        notes=["row 2: expert 1 unavailable, fell back to 0"] * 4,
    )
    done = DoneEvent(
        job_id="j" * 64,
        digits=[9] * n,
        images=rng.uniform(-1, 1, (n, *image)).astype(np.float32),
        usage=rng.random((n, K)),
        latents=rng.standard_normal((n, *sample)).astype(np.float32) if latent and request.return_latents else None,
        steps=40,
        strategy="topk",
        elapsed_s=12.5,
        notes=["row 2: expert 1 unavailable, fell back to 0"] * 4,
        epoch=2**63 - 1,
    )
    return frame, done


@pytest.mark.parametrize(
    "n, extra, sample, image, latent",
    [
        (256, {}, (1, 32, 32), (1, 32, 32), False),
        (64, {"frame_x1": True}, (3, 32, 32), (3, 32, 32), False),
        (8, {"frame_x1": True, "preview_every": 1, "return_latents": True}, (4, 32, 32), (3, 128, 128), True),
    ],
)
def test_the_bound_holds_for_real_packed_events(n, extra, sample, image, latent):
    request = JobRequest(digits=[9] * n, steps=40, **extra)
    frame, done = _events(request, sample, image, latent)
    frame_bytes, done_bytes = len(pack(frame)), len(pack(done))
    kind, bound = largest_event(request, sample, image, K, latent)
    assert bound >= max(frame_bytes, done_bytes), (kind, bound, frame_bytes, done_bytes)
    assert bound <= 1.2 * max(frame_bytes, done_bytes) + 64 * 1024  # close, so jobs that fit are not refused


def test_a_256px_job_that_cannot_fit_is_refused_naming_the_limit_and_what_fits():
    sample, image = (4, 32, 32), (3, 256, 256)  # a 256px latent fleet: 786 KB per float32 image
    four = JobRequest(digits=[1, 2, 3, 4], steps=40)
    check_event_sizes(four, sample, image, K, True, MAX_PAYLOAD_BYTES)  # the seeds' call: 3 MiB, fits
    with pytest.raises(Rejected) as refused:
        check_event_sizes(JobRequest(count=16, steps=40), sample, image, K, True, MAX_PAYLOAD_BYTES)
    err = refused.value
    assert err.code == ErrorCode.TOO_LARGE and err.limit == "max_message_bytes"
    assert "done event would be 12.1 MiB (16 images of 3x256x256) over the 8 MiB message limit" in err.reason
    most = int(err.reason.rsplit("at most ", 1)[1].split()[0])
    check_event_sizes(JobRequest(count=most, steps=40), sample, image, K, True, MAX_PAYLOAD_BYTES)
    with pytest.raises(Rejected):
        check_event_sizes(JobRequest(count=most + 1, steps=40), sample, image, K, True, MAX_PAYLOAD_BYTES)
    # a pixel fleet's frames with x1 carry as many bytes as its done: either refuses, streaming or not
    x1 = JobRequest(digits=[1] * 16, steps=40, frame_x1=True)
    with pytest.raises(Rejected, match="event would be"):
        check_event_sizes(x1, (3, 256, 256), (3, 256, 256), K, False, MAX_PAYLOAD_BYTES)
    with pytest.raises(Rejected, match="done event would be"):
        check_event_sizes(
            x1.model_copy(update={"stream": False}), (3, 256, 256), (3, 256, 256), K, False, MAX_PAYLOAD_BYTES
        )
    # a latent fleet whose decoder has not said its image shape yet: the parts made of images are left out
    check_event_sizes(JobRequest(count=16, steps=40), sample, None, K, True, MAX_PAYLOAD_BYTES)
