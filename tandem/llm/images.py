"""The images of multimodal requests: fetched from `data:` and http(s) URLs within limits, decoded once, and
cached by content.

A URL is the client's, so fetching it is an SSRF surface: hosts that are (or resolve to) private, loopback,
link-local or otherwise non-global addresses are refused unless `allow_private` is set, and redirects are
followed by hand so that every hop is checked the same way. Bytes, pixels and time are bounded; an image over
a size limit is the client's 413, anything else wrong with it the client's 400, both naming the limit or the
problem.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import ipaddress
import socket
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast
from urllib.parse import urljoin, urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

FORMATS = frozenset({"JPEG", "PNG", "WEBP", "GIF", "BMP"})
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_OFF_LOOP_BYTES = 256 * 1024  # decode larger images in a thread: a big JPEG takes tens of milliseconds


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 32 * 1024 * 1024
    timeout_s: float = 30.0  # per image, the whole fetch including redirects
    max_redirects: int = 5
    allow_private: bool = False


class ImageError(ValueError):
    """An image the request cannot use; `status` is 413 for one over a size limit, else 400."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class LoadedImage:
    image: Any  # PIL.Image.Image in RGB
    digest: str  # sha256 of the encoded bytes: the cache key, and what makes two requests' images the same


class _PrivateAddress(OSError):
    pass


def _is_public(address: str) -> bool:
    return ipaddress.ip_address(address.split("%", 1)[0]).is_global


class _PublicResolver(AbstractResolver):
    """Resolves as aiohttp's default resolver does, and refuses a host with any non-global address (so a
    name that resolves both ways cannot be used to reach the private one)."""

    def __init__(self) -> None:
        self._inner = DefaultResolver()

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET,
                      ) -> list[ResolveResult]:  # fmt: skip
        results = await self._inner.resolve(host, port, family)
        private = [r["host"] for r in results if not _is_public(r["host"])]
        if private:
            raise _PrivateAddress(f"{host} resolves to a non-public address ({private[0]})")
        return results

    async def close(self) -> None:
        await self._inner.close()


def _check_host(url: str, limits: ImageLimits) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ImageError(f"unsupported image URL {_short(url)}: use an http(s) or data:image URL")
    if limits.allow_private:
        return
    try:
        ipaddress.ip_address(parts.hostname)
    except ValueError:
        return  # a name: checked when it is resolved
    if not _is_public(parts.hostname):
        raise ImageError(f"image URL {_short(url)} is a non-public address; the server does not fetch those")


def _short(url: str) -> str:
    return repr(url if len(url) <= 80 else url[:77] + "...")


def data_url_bytes(url: str, limits: ImageLimits) -> bytes:
    """The bytes of a `data:image/...;base64,...` URL."""
    header, sep, payload = url.partition(",")
    if not sep or not header.startswith("data:"):
        raise ImageError("malformed data URL: expected data:image/<type>;base64,<data>")
    media_type, *params = header[5:].split(";")
    if not media_type.startswith("image/"):
        raise ImageError(f"data URL of type {media_type or 'text/plain'!r} is not an image")
    if "base64" not in params:
        raise ImageError("data URL is not base64-encoded: expected data:image/<type>;base64,<data>")
    if len(payload) * 3 // 4 > limits.max_bytes:
        raise ImageError(f"image is over the limit of {limits.max_bytes} bytes", 413)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("data URL holds invalid base64") from None


def decode(data: bytes, limits: ImageLimits) -> Any:
    """Encoded image bytes -> a loaded RGB PIL image. The pixel limit is checked from the header, before
    any pixel is decoded."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise ImageError(f"image is over the limit of {limits.max_bytes} bytes", 413)
    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError):
        raise ImageError("the data is not an image in a supported format (JPEG, PNG, WEBP, GIF, BMP)") from None
    except Image.DecompressionBombError:
        raise ImageError(f"image is over the limit of {limits.max_pixels} pixels", 413) from None
    if image.format not in FORMATS:
        raise ImageError(f"image format {image.format} is not supported (JPEG, PNG, WEBP, GIF, BMP)")
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ImageError(f"image of {width}x{height} pixels is over the limit of {limits.max_pixels} pixels", 413)
    try:
        image.load()
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError) as e:
        raise ImageError(f"the image could not be decoded: {e}") from None


class ImageCache:
    """Decoded images by the digest of their bytes, least recently used out past `capacity_bytes` (counted
    as 3 bytes per pixel, the RGB image's size)."""

    def __init__(self, capacity_bytes: int = 256 * 1024 * 1024) -> None:
        self.capacity_bytes = capacity_bytes
        self.size_bytes = 0
        self.hits = 0
        self.misses = 0
        self._items: OrderedDict[str, Any] = OrderedDict()

    def get(self, digest: str) -> Any:
        image = self._items.get(digest)
        if image is None:
            self.misses += 1
            return None
        self.hits += 1
        self._items.move_to_end(digest)
        return image

    def put(self, digest: str, image: Any) -> None:
        size = _image_bytes(image)
        if digest in self._items or size > self.capacity_bytes:
            return
        self._items[digest] = image
        self.size_bytes += size
        while self.size_bytes > self.capacity_bytes:
            _, old = self._items.popitem(last=False)
            self.size_bytes -= _image_bytes(old)


def _image_bytes(image: Any) -> int:
    width, height = image.size
    return 3 * width * height


T = TypeVar("T")


async def _each(step: Callable[[str], Awaitable[T]], urls: list[str]) -> list[T]:
    results = await asyncio.gather(*(step(url) for url in urls), return_exceptions=True)
    for index, result in enumerate(results):
        if isinstance(result, ImageError):
            raise ImageError(f"image {index}: {result}", result.status)
        if isinstance(result, BaseException):
            raise result
    return cast(list[T], results)


class ImageLoader:
    """Loads the images of requests: `await load(url)`; one HTTP session, made on first use, and one cache."""

    def __init__(self, limits: ImageLimits | None = None, cache: ImageCache | None = None) -> None:
        self.limits = limits or ImageLimits()
        self.cache = cache if cache is not None else ImageCache()
        self._session: aiohttp.ClientSession | None = None

    async def load(self, url: str) -> LoadedImage:
        data = await self.read(url)
        digest = hashlib.sha256(data).hexdigest()
        image = self.cache.get(digest)
        if image is None:
            image = (await asyncio.to_thread(decode, data, self.limits) if len(data) > _OFF_LOOP_BYTES
                     else decode(data, self.limits))
            self.cache.put(digest, image)
        return LoadedImage(image, digest)

    async def load_all(self, urls: list[str]) -> list[LoadedImage]:
        """Every image, fetched concurrently; the first failure (in order) raises, naming its index."""
        return await _each(self.load, urls)

    async def read(self, url: str) -> bytes:
        """The image's encoded bytes, from a data URL or fetched (not decoded)."""
        if url.startswith("data:"):
            return data_url_bytes(url, self.limits)
        try:
            async with asyncio.timeout(self.limits.timeout_s):
                return await self._fetch(url)
        except TimeoutError:
            raise ImageError(f"fetching image {_short(url)} timed out after {self.limits.timeout_s:g} s") from None

    async def read_all(self, urls: list[str]) -> list[bytes]:
        """Every image's bytes, fetched concurrently; the first failure (in order) raises, naming its index."""
        return await _each(self.read, urls)

    async def _fetch(self, url: str) -> bytes:
        session = self._session_for_fetching()
        for _ in range(self.limits.max_redirects + 1):
            _check_host(url, self.limits)
            try:
                async with session.get(url, allow_redirects=False) as response:
                    if response.status in _REDIRECTS and "Location" in response.headers:
                        url = urljoin(url, response.headers["Location"])
                        continue
                    if response.status != 200:
                        raise ImageError(f"fetching image {_short(url)} returned HTTP {response.status}")
                    return await self._read(response)
            except aiohttp.ClientConnectorError as e:
                if isinstance(e.os_error, _PrivateAddress):
                    raise ImageError(f"image URL {_short(url)}: {e.os_error}; the server does not fetch those") from None
                raise ImageError(f"could not fetch image {_short(url)}: {e.os_error}") from None
            except aiohttp.ClientError as e:
                raise ImageError(f"could not fetch image {_short(url)}: {e}") from None
        raise ImageError(f"fetching image {_short(url)}: more than {self.limits.max_redirects} redirects")

    async def _read(self, response: aiohttp.ClientResponse) -> bytes:
        limit = self.limits.max_bytes
        if response.content_length is not None and response.content_length > limit:
            raise ImageError(f"image is over the limit of {limit} bytes", 413)
        chunks = bytearray()
        async for chunk in response.content.iter_chunked(64 * 1024):
            chunks += chunk
            if len(chunks) > limit:
                raise ImageError(f"image is over the limit of {limit} bytes", 413)
        return bytes(chunks)

    def _session_for_fetching(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            resolver = None if self.limits.allow_private else _PublicResolver()
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(resolver=resolver),
                                                  headers={"User-Agent": "tandem"})
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
