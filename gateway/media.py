"""Reading an image part's bytes: from a data URL, an allowed remote host, or an allowed local folder.

The server must not fetch arbitrary URLs for a client (it would reach hosts and files the client
cannot), so by default only ``data:image/png|jpeg|webp;base64,...`` URLs are read. ``http(s)://``
URLs are fetched only from the hosts of ``--allowed-media-domains``, and ``file://`` paths only
under ``--allowed-local-media-path`` (vLLM's flags of the same names). Every refusal is a 400
whose ``param`` is the URL's JSON path. What the bytes hold is checked next (gateway/image_check.py).
"""

from __future__ import annotations

import asyncio
import base64
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import anyio.to_thread
import httpx

from gateway.errors import OpenAIError, invalid
from gateway.image_check import PILLOW_MAX_PIXELS

DEFAULT_MAX_IMAGES = 16
DEFAULT_MAX_IMAGE_BYTES = 20 << 20  # OpenAI's own limit per image
DEFAULT_MAX_IMAGE_PIXELS = 7680 * 4320  # 8K UHD: well past any screenshot, far below a decompression bomb
DEFAULT_FETCH_TIMEOUT = 10.0  # seconds for one remote image, connect to last byte
# image/jpg is not a registered type, but clients send it for JPEG files.
DATA_URL_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp")
_CHUNK = 64 << 10


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """Where images may come from and how large they may be (the gateway's media flags)."""

    allowed_domains: frozenset[str] = frozenset()  # lower-case host names; empty: no remote fetch
    local_root: Path | None = None  # a resolved folder; None: no file:// paths
    max_images: int = DEFAULT_MAX_IMAGES  # per request; 0: images refused
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # the encoded file
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # width * height, read from the header before decoding
    fetch_timeout: float = DEFAULT_FETCH_TIMEOUT

    def __post_init__(self) -> None:
        if self.max_images < 0:
            raise ValueError(f"max_images_per_request must be >= 0, got {self.max_images}")
        if self.max_image_bytes < 1:
            raise ValueError(f"max_image_bytes must be >= 1, got {self.max_image_bytes}")
        # Above Pillow's own bound, Pillow would warn or refuse before our check: one limit, ours.
        if not 1 <= self.max_pixels <= PILLOW_MAX_PIXELS:
            raise ValueError(f"max_image_pixels must be between 1 and {PILLOW_MAX_PIXELS} (Pillow's "
                             f"decompression-bomb bound), got {self.max_pixels}")
        if not self.fetch_timeout > 0:
            raise ValueError(f"the media fetch timeout must be > 0 seconds, got {self.fetch_timeout}")
        if self.local_root is not None and not self.local_root.is_absolute():
            raise ValueError(f"the local media root must be resolved, got {self.local_root}; this is a bug")

    @classmethod
    def of(cls, domains: list[str], local_path: str, max_images: int = DEFAULT_MAX_IMAGES,
           max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
           fetch_timeout: float = DEFAULT_FETCH_TIMEOUT) -> MediaPolicy:
        """From the flags' values: host names checked and lower-cased, the folder resolved."""
        hosts = set()
        for domain in domains:
            host = domain.strip().lower().removeprefix("[").removesuffix("]")
            if not host or "/" in host or "@" in host or any(c.isspace() for c in host):
                raise ValueError(f"allowed media domain {domain!r} is not a host name (e.g. images.example.com)")
            hosts.add(host)
        root = None
        if local_path:
            root = Path(local_path).expanduser().resolve()
            if not root.is_dir():
                raise ValueError(f"allowed local media path {local_path!r} is not a folder")
        return cls(frozenset(hosts), root, max_images, max_image_bytes, max_pixels, fetch_timeout)


async def read_image(url: str, param: str, policy: MediaPolicy) -> bytes:
    """The encoded image at `url` (a data, http(s) or file URL), at most `policy.max_image_bytes`."""
    colon = url.find(":", 0, 8)  # never a copy of a 20 MB URL to read its scheme
    scheme = url[:colon].lower() if colon > 0 else ""
    if scheme == "data":  # on a worker thread: decoding 20 MB of base64 takes tens of ms
        return await anyio.to_thread.run_sync(data_url_bytes, url, param, policy.max_image_bytes)
    if scheme in ("http", "https"):
        return await _fetch(url, param, policy)
    if scheme == "file":
        return await anyio.to_thread.run_sync(_read_local, url, param, policy)
    raise invalid(f"'{param}' must be a data:image/...;base64 URL (or an http(s) or file URL the server "
                  f"allows), got {_shown(url)!r}", param=param)


def data_url_bytes(url: str, param: str, max_bytes: int) -> bytes:
    """``data:image/png;base64,...`` decoded (RFC 2397; only base64 image payloads of the served types)."""
    comma = url.find(",")
    if comma < 0:
        raise invalid(f"'{param}' is not a data URL: no ',' after its media type", param=param)
    header, payload = url[len("data:"):comma], url[comma + 1:]
    media, *params = [p.strip().lower() for p in header.split(";")]
    if media not in DATA_URL_TYPES:
        raise invalid(f"'{param}': the data URL's media type {_shown(media)!r} is not supported: send "
                      "image/png, image/jpeg or image/webp", param=param)
    if not params or params[-1] != "base64":
        raise invalid(f"'{param}': the data URL must be base64 (data:{media};base64,...)", param=param)
    if len(payload) // 4 * 3 > max_bytes + 3:  # before decoding it: base64 is 4 characters per 3 bytes
        raise _too_large(param, max_bytes)
    try:
        data = base64.b64decode(payload, validate=True)
    except ValueError:  # binascii.Error, and non-ASCII text
        raise invalid(f"'{param}': the data URL's payload is not valid base64", param=param) from None
    if len(data) > max_bytes:
        raise _too_large(param, max_bytes)
    if not data:
        raise invalid(f"'{param}': the data URL holds no image", param=param)
    return data


async def _fetch(url: str, param: str, policy: MediaPolicy) -> bytes:
    try:  # the fetcher's own parser decides the host: no parser differential to slip past the check
        host = httpx.URL(url).host.lower()
    except (httpx.InvalidURL, ValueError) as exc:
        raise invalid(f"'{param}' is not a valid URL: {exc}", param=param) from None
    if host not in policy.allowed_domains:
        why = ("no remote host is" if not policy.allowed_domains else f"the host {host!r} is not")
        raise invalid(f"'{param}': {why} allowed for images: send the image as a data URL, or start the gateway "
                      f"with --allowed-media-domains {host or 'HOST'}", param=param)
    max_bytes = policy.max_image_bytes
    try:
        async with asyncio.timeout(policy.fetch_timeout):  # the whole fetch, not each read: no slow drip
            # Made on a worker thread: its TLS setup reads the CA bundle (~20 ms).
            client = await anyio.to_thread.run_sync(_client, policy.fetch_timeout)
            async with client:
                async with client.stream("GET", url, headers={"Accept-Encoding": "identity"}) as response:
                    if not response.is_success:
                        where = response.headers.get("location") if response.is_redirect else None
                        hint = f" (a redirect to {_shown(where)!r}: redirects are not followed)" if where else ""
                        raise invalid(f"'{param}': fetching the image answered HTTP {response.status_code}{hint}",
                                      param=param)
                    encoding = response.headers.get("content-encoding", "identity").strip().lower()
                    if encoding not in ("", "identity"):  # decoded whole before a size check: a bomb's way in
                        raise invalid(f"'{param}': the image was sent with Content-Encoding {encoding!r}; only "
                                      "identity is taken", param=param)
                    declared = response.headers.get("content-length", "")
                    if declared.isdigit() and int(declared) > max_bytes:
                        raise _too_large(param, max_bytes)
                    chunks: list[bytes] = []
                    size = 0
                    async for chunk in response.aiter_raw(_CHUNK):
                        size += len(chunk)
                        if size > max_bytes:  # while it streams: a large image is never held whole
                            raise _too_large(param, max_bytes)
                        chunks.append(chunk)
    except TimeoutError:
        raise invalid(f"'{param}': fetching the image took longer than {policy.fetch_timeout:g} s",
                      param=param) from None
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise invalid(f"'{param}': the image could not be fetched: {type(exc).__name__}: {exc}",
                      param=param) from None
    data = b"".join(chunks)
    if not data:
        raise invalid(f"'{param}': the image URL answered an empty body", param=param)
    return data


def _client(timeout: float) -> httpx.AsyncClient:
    # Redirects are not followed: one could lead to a host that is not allowed.
    return httpx.AsyncClient(follow_redirects=False, timeout=timeout)


def _read_local(url: str, param: str, policy: MediaPolicy) -> bytes:
    """A ``file://`` URL's file, when it resolves (symlinks followed) inside the allowed folder."""
    root = policy.local_root
    if root is None:
        raise invalid(f"'{param}': local files are not read for images: send the image as a data URL, or start "
                      "the gateway with --allowed-local-media-path DIR", param=param)
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise invalid(f"'{param}': a file URL names no host (file:///path), got {parts.netloc!r}", param=param)
    path = Path(unquote(parts.path))
    if not path.is_absolute() or "\0" in parts.path:
        raise invalid(f"'{param}': a file URL needs an absolute path (file:///path)", param=param)
    # Resolved before anything is checked: a missing file outside the folder says "outside", as an
    # existing one does, so nothing is learned about the rest of the disk.
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError):  # a symlink loop (RuntimeError before Python 3.13)
        raise invalid(f"'{param}': the path cannot be resolved", param=param) from None
    if not resolved.is_relative_to(root):
        raise invalid(f"'{param}': the path is outside --allowed-local-media-path", param=param)
    try:
        # O_NOFOLLOW: the last component cannot have become a symlink since; O_NONBLOCK: a FIFO does not hang.
        fd = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise invalid(f"'{param}': no such file under --allowed-local-media-path", param=param) from None
    except OSError as exc:
        raise invalid(f"'{param}': the file cannot be read: {exc.strerror}", param=param) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise invalid(f"'{param}': not a regular file", param=param)
        if info.st_size > policy.max_image_bytes:
            raise _too_large(param, policy.max_image_bytes)
        with os.fdopen(fd, "rb", closefd=False) as file:
            data = file.read(policy.max_image_bytes + 1)  # a file that grew meanwhile is still bounded
    finally:
        os.close(fd)
    if len(data) > policy.max_image_bytes:
        raise _too_large(param, policy.max_image_bytes)
    return data


def _too_large(param: str, max_bytes: int) -> OpenAIError:
    return invalid(f"'{param}': the image is larger than {max_bytes} bytes (--max-image-bytes)", param=param,
                   code="image_too_large")


def _shown(text: str) -> str:
    """At most 64 characters of a client's string, for a message."""
    return text if len(text) <= 64 else text[:61] + "..."
