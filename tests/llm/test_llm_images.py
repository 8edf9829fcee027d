"""Images of multimodal requests (`tandem.llm.images`): data and http(s) URLs, the limits on bytes, pixels and
time, the refusal of non-public hosts (also behind a redirect or a name), and the cache by content."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from PIL import Image

from tandem.llm import images
from tandem.llm.images import ImageCache, ImageError, ImageLimits, ImageLoader
from tests.support.images import data_url
from tests.support.images import png as sample_png
from tests.support.ports import free_port


def png(color: str = "red", size: tuple[int, int] = (40, 30)) -> bytes:
    return sample_png(color, size)


Serve = Callable[[str, dict[str, Callable[[web.Request], Awaitable[web.StreamResponse]]]], Awaitable[str]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """serve(host, {path: handler}) -> the server's base URL, on a free port of `host`."""
    runners: list[web.AppRunner] = []

    async def start(host: str, routes: dict) -> str:
        app = web.Application()
        for path, handler in routes.items():
            app.router.add_get(path, handler)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, host, port).start()
        runners.append(runner)
        return f"http://{host}:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


def image_route(data: bytes, content_type: str = "image/png") -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=data, content_type=content_type)

    return handler


async def test_a_data_url_decodes_to_an_rgb_image_cached_by_content() -> None:
    loader = ImageLoader()
    first = await loader.load(data_url(png("blue")))
    assert first.image.mode == "RGB" and first.image.size == (40, 30)
    assert first.image.getpixel((0, 0)) == (0, 0, 255)
    again = await loader.load(data_url(png("blue"), "image/jpeg"))  # the media type does not decide the format
    assert again.digest == first.digest and again.image is first.image
    assert (loader.cache.hits, loader.cache.misses) == (1, 1)
    other = await loader.load(data_url(png("red")))
    assert other.digest != first.digest


@pytest.mark.parametrize(("url", "status", "message"), [
    ("data:image/png;base64,@@@not-base64", 400, "invalid base64"),
    ("data:text/plain;base64,aGVsbG8=", 400, "'text/plain' is not an image"),
    ("data:image/png,rawbytes", 400, "not base64-encoded"),
    (data_url(b"GIF89a but not really an image"), 400, "not an image in a supported format"),
    (data_url(png()[:60]), 400, "could not be decoded"),
    ("ftp://example.com/a.png", 400, "unsupported image URL"),
    ("file:///etc/passwd", 400, "unsupported image URL"),
])
async def test_bad_images_are_the_clients_error(url: str, status: int, message: str) -> None:
    with pytest.raises(ImageError, match=message) as caught:
        await ImageLoader().load(url)
    assert caught.value.status == status


async def test_size_limits_are_413_naming_the_limit() -> None:
    with pytest.raises(ImageError, match="over the limit of 10 bytes") as caught:
        await ImageLoader(ImageLimits(max_bytes=10)).load(data_url(png()))
    assert caught.value.status == 413
    with pytest.raises(ImageError, match="40x30 pixels is over the limit of 1000 pixels") as caught:
        await ImageLoader(ImageLimits(max_pixels=1000)).load(data_url(png()))
    assert caught.value.status == 413


async def test_an_http_image_within_the_limits(serve: Serve) -> None:
    big = png(size=(400, 400))
    async def missing(request: web.Request) -> web.Response:
        return web.Response(status=404)

    base = await serve("127.0.0.1", {"/a.png": image_route(png("green")), "/big.png": image_route(big),
                                     "/missing.png": missing})
    loader = ImageLoader(ImageLimits(allow_private=True, max_bytes=len(big) - 1))
    try:
        loaded = await loader.load(f"{base}/a.png")
        assert loaded.image.getpixel((1, 1)) == (0, 128, 0)
        with pytest.raises(ImageError, match="over the limit") as caught:
            await loader.load(f"{base}/big.png")
        assert caught.value.status == 413
        with pytest.raises(ImageError, match="returned HTTP 404"):
            await loader.load(f"{base}/missing.png")
        with pytest.raises(ImageError, match="^image 1: .*HTTP 404"):
            await loader.load_all([f"{base}/a.png", f"{base}/missing.png"])
        with pytest.raises(ImageError, match="could not fetch image"):
            await loader.load(f"http://127.0.0.1:{free_port()}/nothing-listens.png")
    finally:
        await loader.close()


async def test_a_slow_server_times_out(serve: Serve) -> None:
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        await release.wait()
        return web.Response(body=png(), content_type="image/png")

    base = await serve("127.0.0.1", {"/slow.png": slow})
    loader = ImageLoader(ImageLimits(allow_private=True, timeout_s=0.5))
    try:
        with pytest.raises(ImageError, match="timed out after 0.5 s"):
            await loader.load(f"{base}/slow.png")
    finally:
        release.set()
        await loader.close()


async def test_non_public_hosts_are_refused_unless_allowed(serve: Serve) -> None:
    base = await serve("127.0.0.1", {"/a.png": image_route(png())})
    port = base.rsplit(":", 1)[1]
    loader = ImageLoader()
    try:
        for url in (f"{base}/a.png", f"http://localhost:{port}/a.png", "http://[::1]/a.png",
                    "http://169.254.169.254/latest/meta-data", "http://10.0.0.1/a.png"):
            with pytest.raises(ImageError, match="non-public address") as caught:
                await loader.load(url)
            assert caught.value.status == 400
    finally:
        await loader.close()


async def test_every_redirect_hop_is_checked(serve: Serve, monkeypatch: pytest.MonkeyPatch) -> None:
    """127.0.0.2 stands in for a public host: a redirect from it to a private address is refused, a redirect
    to itself followed."""
    monkeypatch.setattr(images, "_is_public", lambda address: address == "127.0.0.2")
    private = await serve("127.0.0.1", {"/a.png": image_route(png("blue"))})

    def redirect(to: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            raise web.HTTPFound(to)

        return handler

    public = await serve("127.0.0.2", {"/a.png": image_route(png("red")), "/to-private": redirect(f"{private}/a.png"),
                                       "/to-self": redirect("/a.png"), "/loop": redirect("/loop")})
    loader = ImageLoader()
    try:
        assert (await loader.load(f"{public}/to-self")).image.getpixel((0, 0)) == (255, 0, 0)
        with pytest.raises(ImageError, match="non-public address"):
            await loader.load(f"{public}/to-private")
        with pytest.raises(ImageError, match="more than 5 redirects"):
            await loader.load(f"{public}/loop")
    finally:
        await loader.close()


def test_the_cache_keeps_the_recently_used_within_its_bytes() -> None:
    cache = ImageCache(capacity_bytes=3 * 100 * 2)  # two 10x10 RGB images
    a, b, c = (Image.new("RGB", (10, 10), color) for color in ("red", "green", "blue"))
    cache.put("a", a)
    cache.put("b", b)
    assert cache.get("a") is a  # a is now the most recent
    cache.put("c", c)
    assert cache.get("b") is None and cache.get("a") is a and cache.get("c") is c
    assert cache.size_bytes == 600
    cache.put("huge", Image.new("RGB", (100, 100)))  # larger than the whole cache: not kept
    assert cache.get("huge") is None
