"""Images in a prompt: decoding, content hashes, image keys and the encoder cache (docs/images.md).

An image's placeholder positions carry *image keys*, ``2**62 | image_id << 16 | k``: ids far
outside any vocabulary whose identity is the image's pixels, so the prompt cache's prefix matching
sees images without knowing about them. ``image_id`` is 46 bits of the pixels' BLAKE2b digest and
``k`` the row of the image's embeddings the position takes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

IMAGE_KEY_BASE = 1 << 62
_ID_BITS, _ROW_BITS = 46, 16
MAX_IMAGE_ROWS = 1 << _ROW_BITS
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
DEFAULT_IMAGE_CACHE_MB = 256.0
FORMATS = ("PNG", "JPEG", "WEBP")


class ImageError(ValueError):
    """A bad image in a request (the server answers 400)."""


# --- keys --------------------------------------------------------------------------------------

def image_key(image_id: int, k: int) -> int:
    if not 0 <= k < MAX_IMAGE_ROWS:
        raise ValueError(f"an image has at most {MAX_IMAGE_ROWS} placeholder rows")
    return IMAGE_KEY_BASE | (image_id << _ROW_BITS) | k


def is_key(token: int) -> bool:
    return token >= IMAGE_KEY_BASE


def split_key(token: int) -> tuple[int, int]:
    """(image_id, row) of an image key."""
    t = token - IMAGE_KEY_BASE
    return t >> _ROW_BITS, t & (MAX_IMAGE_ROWS - 1)


# --- decoding and hashing ------------------------------------------------------------------------

def parse_data_url(url: str) -> bytes:
    """The bytes of a ``data:image/...;base64,`` URL. http(s) URLs are refused: turnkv fetches
    nothing at run time."""
    if not isinstance(url, str):
        raise ImageError("image_url.url must be a string")
    low = url[:16].lower()
    if low.startswith(("http://", "https://")):
        raise ImageError("image URLs over http(s) are not fetched (no network at run time): send the image "
                         "inline as a data URL, data:image/png;base64,...")
    if not low.startswith("data:"):
        raise ImageError("image_url.url must be a data URL: data:image/png;base64,... (PNG, JPEG or WebP)")
    head, sep, payload = url.partition(",")
    if not sep or ";base64" not in head.lower():
        raise ImageError("an image data URL must be base64: data:image/png;base64,...")
    try:
        return base64.b64decode(payload, validate=False)
    except (binascii.Error, ValueError):
        raise ImageError("the image data URL is not valid base64") from None


def decode_image(data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
    """Decoded RGB PIL image of PNG / JPEG / WebP bytes; ImageError for anything else or too big."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data), formats=FORMATS)
        w, h = img.size
        if max_pixels and w * h > max_pixels:
            raise ImageError(f"the image has {w}x{h} = {w * h} pixels, more than --max-image-pixels {max_pixels}")
        img.load()
    except ImageError:
        raise
    except Image.DecompressionBombError:
        raise ImageError(f"the image has more pixels than --max-image-pixels {max_pixels}") from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise ImageError("the image could not be decoded (PNG, JPEG and WebP are supported)") from None
    return img.convert("RGB")


def content_digest(img, settings: bytes = b"") -> bytes:
    """BLAKE2b-128 of the decoded pixels (mode, size, bytes) and of the family's preprocessing
    ``settings`` (models/vision_settings.salt): the image's identity, hence its encoder cache entry
    and its image keys. Two settings make two tensors of one picture, so they never share either."""
    rgb = img.convert("RGB")
    h = hashlib.blake2b(b"turnkv-image2" + f"{rgb.mode}:{rgb.size[0]}x{rgb.size[1]}".encode(), digest_size=16)
    h.update(len(settings).to_bytes(2, "little") + settings)
    h.update(rgb.tobytes())
    return h.digest()


def image_id_of(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "little") & ((1 << _ID_BITS) - 1)


@dataclass(eq=False)
class ImageInput:
    """One preprocessed image of a request (the family's ``prepare_image`` builds it)."""

    digest: bytes                 # content + preprocessing hash (encoder cache key)
    image_id: int                 # 46 bits of it (image keys)
    pixel_values: torch.Tensor    # family-specific, e.g. [tiles, 3, H, W]
    pixel_mask: torch.Tensor | None
    n_rows: int                   # embeddings rows = placeholder positions
    grid: tuple[int, int] = (0, 0)   # (rows, cols) of tiles, (0, 0) = not split
    placeholder: int = 0          # the model's <image> token id
    extra: dict = field(default_factory=dict)   # family-specific (LFM2-VL: each tile's patch grid)

    def keys(self) -> list[int]:
        return [image_key(self.image_id, k) for k in range(self.n_rows)]


def model_ids(tokens: Iterable[int], placeholder: int | dict[int, int]) -> list[int]:
    """``tokens`` with every image key replaced by the placeholder id (what transformers' input_ids
    hold): ``placeholder`` one id, or image_id -> id."""
    out = []
    for t in tokens:
        t = int(t)
        if t >= IMAGE_KEY_BASE:
            t = placeholder if isinstance(placeholder, int) else placeholder[split_key(t)[0]]
        out.append(t)
    return out


def image_ids_in(tokens: Iterable[int]) -> list[int]:
    """The distinct image ids whose keys appear in ``tokens`` (first-seen order)."""
    seen: dict[int, None] = {}
    for t in tokens:
        if t >= IMAGE_KEY_BASE:
            seen.setdefault(split_key(int(t))[0], None)
    return list(seen)


def last_image_end(tokens: list[int]) -> int:
    """The position right after the last image key in ``tokens`` (0 when there is none): where a
    family that cannot truncate takes its media checkpoint."""
    for i in range(len(tokens) - 1, -1, -1):
        if tokens[i] >= IMAGE_KEY_BASE:
            return i + 1
    return 0


def image_run_cut(tokens: list[int], start: int, end: int) -> int:
    """``end`` moved so that ``tokens[start:end]`` does not split a run of image keys: back to the
    run's start when that is after ``start``, else forward to its end."""
    if end >= len(tokens) or tokens[end] < IMAGE_KEY_BASE or tokens[end - 1] < IMAGE_KEY_BASE:
        return end
    r = end - 1
    while r > start and tokens[r - 1] >= IMAGE_KEY_BASE:
        r -= 1
    if r > start:
        return r
    while end < len(tokens) and tokens[end] >= IMAGE_KEY_BASE:
        end += 1
    return end


def whole_images(tokens: list[int], images: dict) -> bool:
    """Every image's keys appear as whole runs ``0 .. n_rows - 1`` (``images``: image_id -> ImageInput)."""
    want = 0           # the next row expected of the current image (0: none open)
    current = None
    for t in tokens:
        t = int(t)
        if t < IMAGE_KEY_BASE:
            if want:
                return False
            continue
        image_id, k = split_key(t)
        if want and (image_id != current or k != want):
            return False
        if not want and k != 0:
            return False
        current, want = image_id, k + 1
        if want == images[image_id].n_rows:
            want = 0
    return want == 0


def merge_embeddings(tokens: torch.Tensor, embed, images: dict[int, torch.Tensor] | None) -> torch.Tensor:
    """Input embeddings [N, hidden]: ``embed(ids)`` for token rows, row ``k`` of image ``image_id``
    where a key stands (transformers' masked_scatter of image features over <image> rows)."""
    mask = tokens >= IMAGE_KEY_BASE
    if not bool(mask.any()):
        return embed(tokens)
    x = embed(torch.where(mask, torch.zeros_like(tokens), tokens))
    rows = mask.nonzero().flatten()
    local = tokens[rows] - IMAGE_KEY_BASE
    ids, ks = local >> _ROW_BITS, local & (MAX_IMAGE_ROWS - 1)
    for image_id in ids.unique().tolist():
        if images is None or image_id not in images:
            raise RuntimeError(f"image {image_id:x} has no embeddings in this step")
        sel = ids == image_id
        x[rows[sel]] = images[image_id][ks[sel]].to(x.dtype)
    return x


# --- encoder cache ---------------------------------------------------------------------------------

class EncoderCache:
    """Image embeddings by content digest under a byte budget (LRU); 0 = keep nothing."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = max(0, int(budget_bytes))
        self._lock = threading.Lock()
        self._items: OrderedDict[bytes, torch.Tensor] = OrderedDict()   # scope \0 digest -> [n, hidden]
        self._bytes = 0
        self.counts = {"hits": 0, "misses": 0, "encoded": 0, "evictions": 0}
        self.encode_ms = 0.0

    def get_or_encode(self, image: ImageInput, encode, scope: str = "") -> torch.Tensor:
        """The image's embeddings, encoding them with ``encode(image)`` on a miss. ``scope`` (the
        tenant key) keeps one tenant's images from being hits, hence timing signals, for another."""
        key = scope.encode() + b"\0" + image.digest
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
                self.counts["hits"] += 1
                return hit
            self.counts["misses"] += 1
        t0 = time.perf_counter()
        emb = encode(image)
        with self._lock:
            self.counts["encoded"] += 1
            self.encode_ms += (time.perf_counter() - t0) * 1000
            n = emb.numel() * emb.element_size()
            if 0 < n <= self.budget_bytes and key not in self._items:
                self._items[key] = emb
                self._bytes += n
                while self._bytes > self.budget_bytes:
                    _, old = self._items.popitem(last=False)
                    self._bytes -= old.numel() * old.element_size()
                    self.counts["evictions"] += 1
        return emb

    def clear(self) -> tuple[int, int]:
        with self._lock:
            n, b = len(self._items), self._bytes
            self._items.clear()
            self._bytes = 0
            return n, b

    def stats(self) -> dict:
        with self._lock:
            return {**self.counts, "entries": len(self._items), "bytes": self._bytes,
                    "budget_bytes": self.budget_bytes, "encode_ms": round(self.encode_ms, 3)}
