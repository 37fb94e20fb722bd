"""Reading videos: metadata without decoding, and the decoded frames at given indices.

A video is a container file (mp4, mkv, webm, avi, ... anything FFmpeg reads, through PyAV) or a
list of frame image files with a frame rate. `probe_video` reads only what sampling needs
(`VideoMeta`: frame count, native fps, frame size); `decode_frames` decodes the frames at the
sampled indices and nothing after the last one.

Frame count of a container: the video stream's own count (`stream.frames`, the container's
header) when it has one; containers that store none (Matroska/WebM, raw H.264 report 0) have
their video packets counted by demuxing, which reads the file but decodes nothing (one packet
is one frame, what ffprobe's -count_packets reports). `VideoMeta.count_source` says which.

Native fps of a container: the stream's average frame rate; when the container has none, 24 is
assumed (as transformers' Qwen3-VL video processor does) and `VideoMeta.fps_source` says so. A
frame list's fps comes from the record (``"fps"``) or the job (`data.video.frame_list_fps`).

Frames are decoded in presentation order and counted from 0, the way transformers' PyAV reader
indexes them. Every problem is a `DataError` naming the sample's source ("file:line") and the
video.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import av
from PIL import Image

from vlmcp.data.image_size import header_size
from vlmcp.data.media_paths import is_file
from vlmcp.errors import DataError

#: Native fps assumed for a container that states none (transformers' choice).
ASSUMED_FPS = 24.0


@dataclass(frozen=True)
class VideoSource:
    """Where a video's frames come from: a container `path`, or the ordered image `frames` of a
    frame list with its native `fps` and where that fps was given (`fps_source`)."""

    path: Path | None = None
    frames: tuple[Path, ...] = ()
    fps: float | None = None
    fps_source: str = ""

    @property
    def label(self) -> str:
        """The video as messages name it: its path, or its first frame and frame count."""
        if self.path is not None:
            return str(self.path)
        return f"frame list {self.frames[0]} (+{len(self.frames) - 1} frames)" if self.frames \
            else "empty frame list"


@dataclass(frozen=True)
class VideoMeta:
    """What sampling needs of a video, read without decoding a frame.

    total_frames: frames the video holds; count_source: "stream.frames", "packets counted" or
    "frame list". native_fps: frames per second; fps_source: "stream average rate",
    "assumed 24 (the container states none)", or where a frame list's fps was given.
    width, height: frame size in pixels.
    """

    total_frames: int
    native_fps: float
    width: int
    height: int
    count_source: str
    fps_source: str


def _fail(source: str, video: VideoSource, message: str) -> DataError:
    return DataError(f"{source}: video {video.label}: {message}")


def _open(video: VideoSource, source: str) -> av.container.InputContainer:
    if not is_file(video.path):
        raise DataError(f"{source}: video not found: {video.path}")
    try:
        container = av.open(str(video.path))
    except (av.FFmpegError, OSError, ValueError) as e:
        raise _fail(source, video, f"cannot open ({e})") from e
    if not container.streams.video:
        container.close()
        raise _fail(source, video, "has no video stream")
    return container


def probe_video(video: VideoSource, source: str) -> VideoMeta:
    """The video's `VideoMeta`, from its container header (or, for a frame list, its first
    frame's image header); no frame is decoded. Raises DataError for a video that cannot be
    read or holds no frame."""
    if video.path is None:
        if not video.frames:
            raise _fail(source, video, "the frame list is empty")
        width, height = header_size(video.frames[0], source, "video frame")
        return VideoMeta(len(video.frames), float(video.fps), width, height, "frame list",
                         video.fps_source)
    with _open(video, source) as container:
        stream = container.streams.video[0]
        total, count_source = int(stream.frames or 0), "stream.frames"
        if total <= 0:
            try:
                total = sum(1 for packet in container.demux(stream) if packet.size)
            except (av.FFmpegError, OSError, ValueError) as e:
                raise _fail(source, video, f"cannot read its packets ({e})") from e
            count_source = "packets counted"
        rate = stream.average_rate
        fps, fps_source = (float(rate), "stream average rate") if rate else \
            (ASSUMED_FPS, "assumed 24 (the container states none)")
        width, height = stream.codec_context.width, stream.codec_context.height
    if total <= 0:
        raise _fail(source, video, "holds no frames")
    if width <= 0 or height <= 0:
        raise _fail(source, video, f"has no frame size ({width}x{height})")
    return VideoMeta(total, fps, width, height, count_source, fps_source)


def _frame_list_images(video: VideoSource, indices: list[int], size: tuple[int, int],
                       source: str) -> list[Image.Image]:
    images = []
    for index in indices:
        path = video.frames[index]
        try:
            with Image.open(path) as image:
                image.load()
                frame = image.convert("RGB")
        except FileNotFoundError as e:
            raise DataError(f"{source}: video frame not found: {path}") from e
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            raise DataError(f"{source}: cannot decode video frame {path}: {e}") from e
        if frame.size != size:
            raise DataError(f"{source}: video frame {path} is {frame.size[0]}x{frame.size[1]}, "
                            f"the frame list's first frame {size[0]}x{size[1]}")
        images.append(frame)
    return images


def decode_frames(video: VideoSource, meta: VideoMeta, indices: list[int], source: str
                  ) -> list[Image.Image]:
    """The RGB frames at `indices` (ascending, repeats allowed) of a video whose metadata is
    `meta`, in order; frames after the last index are not decoded. Raises DataError when the
    video cannot be decoded, ends before the last index, or has frames of another size than
    `meta` says."""
    size = (meta.width, meta.height)
    if video.path is None:
        return _frame_list_images(video, indices, size, source)
    wanted: dict[int, int] = {}
    for index in indices:
        wanted[index] = wanted.get(index, 0) + 1
    last = max(indices)
    frames: list[Image.Image] = []
    with _open(video, source) as container:
        decoded = container.decode(video=0)
        for count in range(last + 1):
            try:
                frame = next(decoded, None)
            except (av.FFmpegError, OSError, ValueError) as e:
                raise _fail(source, video, f"cannot decode frame {count} ({e})") from e
            if frame is None:
                raise _fail(source, video, f"ends after {count} decoded frames, before frame "
                                           f"{last}; its metadata ({meta.count_source}) says "
                                           f"{meta.total_frames}")
            if count in wanted:
                try:
                    image = frame.to_image()
                except (av.FFmpegError, OSError, ValueError) as e:
                    raise _fail(source, video, f"cannot convert frame {count} to RGB ({e})") from e
                if image.size != size:
                    raise _fail(source, video, f"frame {count} is {image.size[0]}x"
                                               f"{image.size[1]}, the stream says "
                                               f"{size[0]}x{size[1]}")
                frames += [image] * wanted[count]
    return frames
