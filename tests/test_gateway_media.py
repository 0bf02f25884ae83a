"""Images in prompts, the gateway's side (gateway/media.py, gateway/image_check.py, gateway/image_parts.py).

Unit tests read real files and fetch from a real loopback HTTP server; the service tests start the
real engine (ignis-tiny, no vision tower) and gateway and check that every bad image is a 400 naming
its field, that a good one reaches the engine (which answers that it takes no images), and that the
services keep serving.
"""

from __future__ import annotations

import base64
import io
import struct
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from gateway.__main__ import parse_args
from gateway.body import Fields
from gateway.errors import OpenAIError
from gateway.image_check import PILLOW_MAX_PIXELS, image_problem
from gateway.image_parts import ImageSource, attach_images
from gateway.items import responses_chat
from gateway.media import MediaPolicy, data_url_bytes, read_image
from gateway.messages import chat_input
from ignis.v1 import engine_pb2
from services import RunningService, start_gateway

MODEL = "ignis-tiny"
FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None, print_blob=False)


# ---------------------------------------------------------------- images, as files

def encoded(fmt: str = "PNG", size: tuple[int, int] = (8, 6), noise: bool = False) -> bytes:
    """A real image file; `noise`: random pixels, so PNG cannot compress it."""
    if noise:
        image = Image.frombytes("RGB", size, bytes(_noise(size[0] * size[1] * 3)))
    else:
        image = Image.new("RGB", size, (200, 30, 90))
    out = io.BytesIO()
    image.save(out, fmt)
    return out.getvalue()


def _noise(n: int) -> bytes:
    import random
    return random.Random(n).randbytes(n)


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_claiming(width: int, height: int) -> bytes:
    """A well-formed PNG head that claims `width` x `height` (its one IDAT row would not fill it)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\0" * 7))
            + _chunk(b"IEND", b""))


def corrupt_png() -> bytes:
    """`PNG` with its pixel data (the first IDAT's payload) overwritten: its head still reads well."""
    length = struct.unpack(">I", PNG[33:37])[0]
    assert PNG[37:41] == b"IDAT"
    return PNG[:41] + b"\xa5" * length + PNG[41 + length:]


PNG = encoded("PNG")
NOISY = encoded("PNG", (64, 64), noise=True)  # pixel data that cannot compress: a cut goes through it
TRUNCATED = NOISY[: len(NOISY) // 2]


# ---------------------------------------------------------------- a loopback HTTP server

class _Handler(BaseHTTPRequestHandler):
    stop: threading.Event  # set by the fixture: the endless bodies end

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/ok.png":
            self._send(200, PNG)
        elif self.path == "/broken.png":
            self._send(200, TRUNCATED)
        elif self.path == "/missing.png":
            self._send(404, b"not here")
        elif self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/ok.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/declared-huge":
            self.send_response(200)
            self.send_header("Content-Length", str(1 << 30))
            self.end_headers()
        elif self.path == "/endless":  # no length: the body ends when the connection does
            self.send_response(200)
            self.end_headers()
            self._write_until_stopped(b"\0" * 65536, pause=0.0)
        elif self.path == "/gzipped-bomb":  # 1 KB of gzip that inflates to 64 MB
            body = zlib.compress(bytes(64 << 20), 9)
            self.send_response(200)
            self.send_header("Content-Encoding", "deflate")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path == "/slow":
            self.send_response(200)
            self.end_headers()
            self._write_until_stopped(b"\0", pause=0.05)
        else:
            self._send(404, b"?")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _write_until_stopped(self, piece: bytes, pause: float) -> None:
        try:
            while not self.stop.wait(pause):
                self.wfile.write(piece)
                self.wfile.flush()
        except OSError:  # the gateway hung up: what these tests want
            pass

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass


@pytest.fixture(scope="module")
def media_server() -> Iterator[str]:
    """`http://127.0.0.1:PORT` of a threaded stdlib server with the paths of `_Handler`."""
    stop = threading.Event()
    handler = type("Handler", (_Handler,), {"stop": stop})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    stop.set()
    server.shutdown()
    server.server_close()
    thread.join(timeout=30)


def policy(**kw: Any) -> MediaPolicy:
    return MediaPolicy(**kw)


async def refused(url: str, pol: MediaPolicy, *words: str) -> str:
    """The 400's message for reading `url` under `pol`; it names its param and holds `words`."""
    with pytest.raises(OpenAIError) as caught:
        await read_image(url, "messages[0].content[0].image_url.url", pol)
    err = caught.value
    assert err.status_code == 400 and err.param == "messages[0].content[0].image_url.url", err.body()
    for word in words:
        assert word in err.message, err.message
    return err.message


# ---------------------------------------------------------------- data URLs

@pytest.mark.parametrize("media, fmt", [("image/png", "PNG"), ("image/jpeg", "JPEG"), ("image/webp", "WEBP"),
                                        ("IMAGE/JPG", "JPEG")])
async def test_a_data_url_of_each_served_type_is_read_and_checked(media: str, fmt: str) -> None:
    data = encoded(fmt)
    assert await read_image(data_url(data, media), "p", policy()) == data
    assert image_problem(data, 1000) is None


async def test_bad_data_urls_are_400s() -> None:
    pol = policy()
    await refused(data_url(encoded("GIF"), "image/gif"), pol, "image/gif", "not supported")
    await refused("data:text/plain;base64,aGk=", pol, "not supported")
    await refused("data:image/png," + PNG.hex(), pol, "base64")
    await refused("data:image/png;base64,@@@notbase64", pol, "not valid base64")
    await refused("data:image/png;base64,aGk", pol, "not valid base64")  # bad padding
    await refused("data:image/png;base64", pol, "no ','")
    await refused("data:image/png;base64,", pol, "no image")
    await refused(data_url(encoded("PNG", (64, 64), noise=True)), policy(max_image_bytes=1000), "--max-image-bytes")


@FUZZ
@given(st.text(max_size=80))
def test_the_data_url_parser_answers_bytes_or_a_400(text: str) -> None:
    try:
        data = data_url_bytes("data:" + text, "p", 1 << 10)
    except OpenAIError as err:
        assert err.status_code == 400 and err.param == "p"
    else:
        assert 0 < len(data) <= 1 << 10


@FUZZ
@given(st.binary(min_size=1, max_size=300), st.sampled_from(["image/png", "image/jpeg", "image/webp"]))
def test_a_data_url_gives_back_its_bytes(data: bytes, media: str) -> None:
    assert data_url_bytes(data_url(data, media), "p", 300) == data


async def test_other_schemes_are_400s() -> None:
    for url in ("ftp://127.0.0.1/x.png", "/etc/passwd", "x.png", "", "javascript:alert(1)"):
        await refused(url, policy(), "data:image")


# ---------------------------------------------------------------- remote URLs

async def test_remote_urls_need_their_host_allowed(media_server: str) -> None:
    await refused(f"{media_server}/ok.png", policy(), "--allowed-media-domains")
    only_other = policy(allowed_domains=frozenset({"images.example.com"}))
    message = await refused(f"{media_server}/ok.png", only_other, "--allowed-media-domains", "'127.0.0.1'")
    assert "images.example.com" not in message
    # What the fetcher would connect to decides, not what a URL seems to say.
    allowed = policy(allowed_domains=frozenset({"127.0.0.1"}))
    await refused("http://127.0.0.1@evil.invalid/ok.png", allowed, "'evil.invalid'", "--allowed-media-domains")
    await refused("http://127.0.0.1.evil.invalid/ok.png", allowed, "--allowed-media-domains")
    await refused("http://[::1/ok.png", allowed, "not a valid URL")


async def test_an_allowed_host_is_fetched(media_server: str) -> None:
    allowed = MediaPolicy.of(["127.0.0.1"], "")
    assert await read_image(f"{media_server}/ok.png", "p", allowed) == PNG


async def test_remote_failures_are_400s(media_server: str) -> None:
    allowed = policy(allowed_domains=frozenset({"127.0.0.1"}), max_image_bytes=1 << 20, fetch_timeout=1.0)
    await refused(f"{media_server}/missing.png", allowed, "HTTP 404")
    await refused(f"{media_server}/redirect", allowed, "HTTP 302", "redirects are not followed")
    await refused(f"{media_server}/declared-huge", allowed, "--max-image-bytes")
    # No length declared and no end: only a cap counted while it streams ends this (not the timeout).
    await refused(f"{media_server}/endless", policy(allowed_domains=frozenset({"127.0.0.1"}),
                                                    max_image_bytes=1 << 20, fetch_timeout=120.0),
                  "--max-image-bytes")
    await refused(f"{media_server}/slow", allowed, "took longer than 1 s")
    await refused(f"{media_server}/gzipped-bomb", allowed, "Content-Encoding 'deflate'")  # never inflated
    closed = policy(allowed_domains=frozenset({"127.0.0.1"}))
    await refused("http://127.0.0.1:1/ok.png", closed, "could not be fetched")


# ---------------------------------------------------------------- local files

@pytest.fixture
def media_root(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    root.mkdir()
    (root / "a.png").write_bytes(PNG)
    (root / "sub").mkdir()
    (root / "sub" / "b.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    (root / "inside-link.png").symlink_to(root / "sub" / "b.png")
    (root / "escape.png").symlink_to(tmp_path / "secret.png")
    (root / "escape-dir").symlink_to(tmp_path)
    return root


async def test_local_files_are_read_only_under_the_allowed_folder(media_root: Path) -> None:
    local = MediaPolicy.of([], str(media_root))
    for name in ("a.png", "sub/b.png", "inside-link.png", "sub/../a.png"):
        assert await read_image(f"file://{media_root}/{name}", "p", local) == PNG
    assert await read_image(f"file://localhost{media_root}/a%2Epng", "p", local) == PNG
    for name in ("../secret.png", "sub/../../secret.png", "escape.png", "escape-dir/secret.png",
                 "../missing.png", "escape-dir/missing.png"):
        await refused(f"file://{media_root}/{name}", local, "outside --allowed-local-media-path")
    await refused(f"file://{media_root}/missing.png", local, "no such file")
    await refused(f"file://{media_root}/sub", local, "not a regular file")
    await refused(f"file://otherhost{media_root}/a.png", local, "names no host")
    await refused(f"file://{media_root}/a.png", policy(), "--allowed-local-media-path")
    await refused(f"file://{media_root}/a.png", MediaPolicy.of([], str(media_root), max_image_bytes=10),
                  "--max-image-bytes")


# ---------------------------------------------------------------- what the bytes hold

def test_corrupt_truncated_huge_and_unserved_images_are_problems() -> None:
    assert image_problem(PNG, 48) is None
    assert "could not be decoded" in (image_problem(corrupt_png(), 1000) or "")
    assert "header is corrupt" in (image_problem(PNG[:40] + bytes(len(PNG) - 40), 1000) or "")
    assert image_problem(NOISY, 64 * 64) is None
    assert "could not be decoded" in (image_problem(TRUNCATED, 64 * 64) or "")
    assert "could not be decoded" in (image_problem(NOISY[:-100], 64 * 64) or "")
    jpeg = encoded("JPEG", (64, 64), noise=True)
    assert "could not be decoded" in (image_problem(jpeg[: len(jpeg) // 2], 10000) or "")
    assert "not a PNG, JPEG or WebP" in (image_problem(b"hello", 1000) or "")
    for fmt in ("GIF", "BMP", "TIFF"):
        assert "not a PNG, JPEG or WebP" in (image_problem(encoded(fmt), 1000) or "")
    assert "--max-image-pixels" in (image_problem(PNG, 47) or "")
    # Headers alone: our bound, then Pillow's (a decompression bomb), both before a pixel is decoded.
    assert "8000x5000" in (image_problem(png_claiming(8000, 5000), 7680 * 4320) or "")
    assert "--max-image-pixels" in (image_problem(png_claiming(100000, 100000), PILLOW_MAX_PIXELS) or "")


async def test_check_runs_off_the_loop_and_names_the_param() -> None:
    from gateway.image_check import check_image
    await check_image(PNG, "p", 1000)
    with pytest.raises(OpenAIError) as caught:
        await check_image(png_claiming(100000, 100000), "input[0].content[1].image_url", 33177600)
    assert caught.value.status_code == 400 and caught.value.param == "input[0].content[1].image_url"


async def test_an_image_that_passed_is_not_decoded_again_under_the_same_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway import image_check
    image = NOISY[:-1] + b"\0"  # bytes no other test checks
    await image_check.check_image(image, "p", 64 * 64)
    calls: list[int] = []
    real = image_check.image_problem

    def counted(data: bytes, limit: int) -> str | None:
        calls.append(limit)
        return real(data, limit)

    monkeypatch.setattr(image_check, "image_problem", counted)
    await image_check.check_image(image, "p", 64 * 64)
    assert calls == []  # known good
    with pytest.raises(OpenAIError):
        await image_check.check_image(image, "p", 100)  # another limit: checked again, and over it
    assert calls == [100]


# ---------------------------------------------------------------- parts, in their places

def test_image_parts_take_their_place_among_the_text_parts() -> None:
    images: list[ImageSource] = []
    chat = chat_input(Fields({"messages": [
        {"role": "system", "content": "Look."},
        {"role": "user", "content": [{"type": "text", "text": "a"},
                                     {"type": "image_url", "image_url": {"url": "data:1", "detail": "low"}},
                                     {"type": "image_url", "image_url": "data:2"},
                                     {"type": "text", "text": "b"}]}]}), images)
    assert [(p.type, p.text, p.detail) for p in chat.messages[1].content_parts] == [
        ("text", "a", ""), ("image", "", "low"), ("image", "", "auto"), ("text", "b", "")]
    assert images == [ImageSource("data:1", "messages[1].content[1].image_url.url"),
                      ImageSource("data:2", "messages[1].content[2].image_url")]


def test_responses_input_images() -> None:
    images: list[ImageSource] = []
    prior = [{"role": "user", "content": [{"type": "input_image", "image_url": "data:0"}]}]
    chat = responses_chat(Fields({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is it?"},
        {"type": "input_image", "image_url": "data:1", "detail": "high"}]}]}), images, prior)
    assert [p.type for m in chat.messages for p in m.content_parts] == ["image", "text", "image"]
    assert images == [ImageSource("data:0", "previous_response_id[0].content[0].image_url"),
                      ImageSource("data:1", "input[0].content[1].image_url")]
    with pytest.raises(OpenAIError) as caught:
        responses_chat(Fields({"input": [{"role": "user", "content": [
            {"type": "input_image", "file_id": "file-123"}]}]}), [])
    assert caught.value.param == "input[0].content[0].file_id" and "file ids are not supported" in caught.value.message


@pytest.mark.parametrize("part, param", [
    ({"type": "image_url"}, "messages[0].content[0].image_url"),
    ({"type": "image_url", "image_url": {}}, "messages[0].content[0].image_url.url"),
    ({"type": "image_url", "image_url": {"url": 5}}, "messages[0].content[0].image_url.url"),
    ({"type": "image_url", "image_url": {"url": "data:", "detail": "max"}}, "messages[0].content[0].image_url.detail"),
    ({"type": "input_image", "image_url": "data:", "detail": "huge"}, "messages[0].content[0].detail"),
    ({"type": "input_audio", "input_audio": {}}, "messages[0].content[0].type"),
])
def test_malformed_parts_name_their_field(part: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as caught:
        chat_input(Fields({"messages": [{"role": "user", "content": [part]}]}), [])
    assert caught.value.status_code == 400 and caught.value.param == param


async def test_attach_fills_the_parts_in_order_and_counts_them(media_root: Path) -> None:
    jpeg = encoded("JPEG")
    images: list[ImageSource] = []
    chat = chat_input(Fields({"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(jpeg, "image/jpeg")}}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "and"},
                                     {"type": "image_url", "image_url": f"file://{media_root}/a.png"}]}]}), images)
    await attach_images(chat, images, MediaPolicy.of([], str(media_root), max_images=2))
    assert chat.messages[0].content_parts[0].image_data == jpeg
    assert chat.messages[2].content_parts[1].image_data == PNG
    with pytest.raises(OpenAIError) as caught:
        await attach_images(chat, images, MediaPolicy.of([], str(media_root), max_images=1))
    assert caught.value.param == "messages[2].content[1].image_url" and "--max-images-per-request" in caught.value.message
    await attach_images(engine_pb2.ChatInput(), [], policy(max_images=0))  # no images: nothing to do


async def test_a_requests_images_are_bounded_together(monkeypatch: pytest.MonkeyPatch) -> None:
    import gateway.image_parts
    monkeypatch.setattr(gateway.image_parts, "MAX_REQUEST_IMAGE_BYTES", len(PNG) + len(NOISY) - 1)
    images: list[ImageSource] = []
    chat = chat_input(Fields({"messages": [{"role": "user", "content": [
        image(data_url(PNG)), image(data_url(NOISY))]}]}), images)
    with pytest.raises(OpenAIError) as caught:
        await attach_images(chat, images, policy())
    assert caught.value.param == "messages[0].content[1].image_url.url" and "together" in caught.value.message


async def test_a_corrupt_image_stops_at_the_gateway() -> None:
    images: list[ImageSource] = []
    chat = chat_input(Fields({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(PNG)}},
        {"type": "image_url", "image_url": {"url": data_url(TRUNCATED)}}]}]}), images)
    with pytest.raises(OpenAIError) as caught:
        await attach_images(chat, images, policy())
    assert caught.value.param == "messages[0].content[1].image_url.url" and caught.value.code == "invalid_image"


# ---------------------------------------------------------------- flags

def test_the_media_flags(tmp_path: Path) -> None:
    _, config = parse_args(["--engine", "e:1"])
    assert (config.allowed_media_domains, config.allowed_local_media_path, config.max_images_per_request,
            config.max_image_bytes, config.max_image_pixels) == ([], "", 16, 20 << 20, 7680 * 4320)
    _, config = parse_args(["--engine", "e:1", "--allowed-media-domains", "Images.Example.com",
                            "--allowed-media-domains", "127.0.0.1", "--allowed-local-media-path", str(tmp_path),
                            "--max-images-per-request", "4", "--max-image-bytes", "5MiB",
                            "--max-image-pixels", "1000000"])
    media = config.media_policy()
    assert media == MediaPolicy(frozenset({"images.example.com", "127.0.0.1"}), tmp_path.resolve(), 4, 5 << 20,
                                1000000)
    for bad in (["--max-image-bytes", "lots"], ["--max-image-pixels", str(PILLOW_MAX_PIXELS + 1)],
                ["--max-images-per-request", "-1"], ["--allowed-local-media-path", str(tmp_path / "nope")],
                ["--allowed-media-domains", "http://x.com/"], ["--max-image-bytes", "0"]):
        with pytest.raises(SystemExit):
            parse_args(["--engine", "e:1", *bad])


# ---------------------------------------------------------------- the services

@pytest.fixture(scope="module")
def gateway(engine: RunningService, media_server: str, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[RunningService, Path]]:
    root = tmp_path_factory.mktemp("media")
    (root / "a.png").write_bytes(PNG)
    (root / "broken.png").write_bytes(TRUNCATED)
    (root.parent / "outside.png").write_bytes(PNG)
    service = start_gateway(tmp_path_factory.mktemp("gateway"), [engine.address], [
        "--allowed-media-domains", "127.0.0.1", "--allowed-local-media-path", str(root),
        "--max-images-per-request", "3", "--max-image-bytes", "4MiB"])
    yield service, root
    assert service.stop() == 0, service.log()
    assert "Traceback" not in service.log(), service.log()


@pytest.fixture(scope="module")
def http(gateway: tuple[RunningService, Path]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{gateway[0].address}", timeout=120) as c:
        yield c


def chat_with(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "system", "content": "Describe."},
        {"role": "user", "content": [{"type": "text", "text": "this:"}, *parts]}]}


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def assert_400(response: httpx.Response, param: str | None, *words: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return str(error["message"])


def still_serves(http: httpx.Client) -> None:
    reply = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 200, reply.text


def test_bad_images_are_400s_naming_the_field(http: httpx.Client, gateway: tuple[RunningService, Path],
                                              media_server: str) -> None:
    root = gateway[1]
    url = "messages[1].content[1].image_url.url"
    post = lambda body: http.post("/v1/chat/completions", json=body)  # noqa: E731
    cases = [
        (image(data_url(encoded("GIF"), "image/gif")), url, "image/gif"),
        (image("data:image/png;base64,%%%"), url, "base64"),
        (image(data_url(TRUNCATED)), url, "decoded"),
        (image(data_url(corrupt_png())), url, "decoded"),
        (image(data_url(b"\x89PNG\r\n\x1a\n" + bytes(64))), url, "header is corrupt"),
        (image(data_url(encoded("BMP"), "image/png")), url, "not a PNG, JPEG or WebP"),
        (image(data_url(png_claiming(100000, 100000))), url, "--max-image-pixels"),
        (image(data_url(png_claiming(8000, 5000))), url, "8000x5000"),
        (image(data_url(encoded("PNG", (1400, 1100), noise=True))), url, "--max-image-bytes"),  # ~4.6 MB
        (image("https://images.example.com/cat.png"), url, "--allowed-media-domains"),
        (image(f"{media_server}/missing.png"), url, "HTTP 404"),
        (image(f"{media_server}/redirect"), url, "redirects are not followed"),
        (image(f"{media_server}/broken.png"), url, "decoded"),
        (image(f"{media_server}/endless"), url, "--max-image-bytes"),
        (image(f"file://{root}/../outside.png"), url, "outside --allowed-local-media-path"),
        (image(f"file://{root}/missing.png"), url, "no such file"),
        (image(f"file://{root}/broken.png"), url, "decoded"),
        ({"type": "image_url", "image_url": {"url": data_url(PNG), "detail": "ultra"}},
         "messages[1].content[1].image_url.detail", "detail"),
        ({"type": "image_url"}, "messages[1].content[1].image_url", "required"),
    ]
    for part, param, word in cases:
        assert_400(post(chat_with(part)), param, word)
    four = chat_with(*[image(data_url(PNG))] * 4)
    assert_400(post(four), "messages[1].content[4].image_url.url", "--max-images-per-request")
    # /tokenize reads a chat's images the same way (the engine counts their tokens).
    tokenize = {"model": MODEL, "messages": chat_with(image(data_url(TRUNCATED)))["messages"]}
    assert_400(http.post("/tokenize", json=tokenize), url, "decoded")
    still_serves(http)


def test_bad_images_on_the_responses_api(http: httpx.Client) -> None:
    def responses(part: dict[str, Any]) -> httpx.Response:
        return http.post("/v1/responses", json={"model": MODEL, "max_output_tokens": 2, "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "this:"}, part]}]})

    assert_400(responses({"type": "input_image", "file_id": "file-abc"}), "input[0].content[1].file_id",
               "file ids are not supported")
    assert_400(responses({"type": "input_image", "image_url": data_url(TRUNCATED)}), "input[0].content[1].image_url",
               "decoded")
    assert_400(responses({"type": "input_image", "image_url": "http://10.0.0.1/x.png"}),
               "input[0].content[1].image_url", "--allowed-media-domains")
    still_serves(http)


def test_a_good_image_reaches_the_engine(http: httpx.Client, gateway: tuple[RunningService, Path],
                                         media_server: str) -> None:
    """ignis-tiny has no vision tower: the engine's 400 says so (whatever its words, it is about images)."""
    root = gateway[1]
    big = data_url(encoded("PNG", (1000, 1000), noise=True))  # ~3 MB of PNG, ~4 MB of data URL
    assert len(big) > 3 << 20
    for url in (data_url(PNG), data_url(encoded("JPEG"), "image/jpeg"), data_url(encoded("WEBP"), "image/webp"),
                big, f"{media_server}/ok.png", f"file://{root}/a.png"):
        response = http.post("/v1/chat/completions", json=chat_with(image(url)))
        assert "image" in assert_400(response, None).lower()
        # The engine's words: the gateway names the URL of an image it refuses.
        assert response.json()["error"]["param"] in ("messages[1]", "messages[1].content[1]"), response.text
    reply = http.post("/v1/responses", json={"model": MODEL, "max_output_tokens": 2, "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(PNG), "detail": "low"}]}]})
    assert "image" in assert_400(reply, None).lower()
    still_serves(http)


def test_the_openai_sdk_sends_an_image(gateway: tuple[RunningService, Path]) -> None:
    with openai.OpenAI(base_url=f"http://{gateway[0].address}/v1", api_key="unused", max_retries=0,
                       timeout=120) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": data_url(PNG), "detail": "high"}}]}])
        assert "image" in str(caught.value).lower()
        reply = client.chat.completions.create(model=MODEL, max_tokens=2,
                                               messages=[{"role": "user", "content": "still there?"}])
        assert reply.choices[0].message.content is not None
