"""llama.cpp's llama-server as a benchmark peer: fetch, build, convert a checkpoint to GGUF, launch.

The sources are the llama.cpp vendored in the pinned llama-cpp-python sdist from
PyPI (the one registry this workplace reaches); everything lands under
bench/peers/build/ (git-ignored). Anything missing raises `PeerUnavailable`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from common.launch import ROOT, Service, free_port, http_healthy, launch_binary

# Newest llama-cpp-python whose vendored llama.cpp converts both Qwen3ForCausalLM and the
# Qwen3.5 hybrid Qwen3_5ForCausalLM (conversion/qwen.py registers both).
VERSION = "0.3.36"
BUILD = ROOT / "bench" / "peers" / "build"
SRC = BUILD / "src" / f"llama.cpp-{VERSION}"
CMAKE_DIR = BUILD / "cmake" / VERSION
GGUF_DIR = BUILD / "gguf"
MTP_ARCHS = {"Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM"}
# Only llama-server; no network at build time (no prebuilt web UI download, no HTTPS client).
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
]


class PeerUnavailable(RuntimeError):
    """The peer cannot be built or run here (no network to PyPI, no compiler, build failure)."""


def server_binary() -> Path:
    return CMAKE_DIR / "bin" / "llama-server"


def _stamp() -> str:
    return f"llama-cpp-python=={VERSION} {' '.join(CMAKE_FLAGS)}\n"


def is_built() -> bool:
    stamp = CMAKE_DIR / "ignis.stamp"
    return server_binary().is_file() and stamp.is_file() and stamp.read_text() == _stamp()


def _run(cmd: list[str], what: str, log: Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        out.write(f"\n$ {' '.join(cmd)}\n".encode())
        out.flush()
        code = subprocess.call(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise PeerUnavailable(f"{what} failed (exit {code}); log {log}:\n{tail}")


def fetch_sources() -> Path:
    """The vendored llama.cpp of the pinned llama-cpp-python sdist, extracted to build/src/."""
    if (SRC / "convert_hf_to_gguf.py").is_file() and (SRC / "CMakeLists.txt").is_file():
        return SRC
    download = BUILD / "download"
    sdist = download / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.is_file():
        # pip prepares the sdist's metadata, which needs its build backend from PyPI too.
        _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
              f"llama-cpp-python=={VERSION}", "-d", str(download)], "pip download llama-cpp-python",
             BUILD / "fetch.log")
    if not sdist.is_file():
        raise PeerUnavailable(f"pip download did not write {sdist}")
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    partial = SRC.with_name(SRC.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        members = []
        for member in tar.getmembers():
            # The sdist's `.git` is a submodule pointer to a checkout we do not have: leave it out.
            if member.name.startswith(prefix) and member.name[len(prefix):] not in ("", ".git"):
                member.name = member.name[len(prefix):]
                members.append(member)
        if not members:
            raise PeerUnavailable(f"{sdist} holds no {prefix}")
        tar.extractall(partial, members=members, filter="data")
    shutil.rmtree(SRC, ignore_errors=True)
    partial.rename(SRC)  # only a complete extraction takes the final name
    return SRC


def ensure_built() -> Path:
    """Path of a built llama-server; builds it (minutes on 2 cores) unless the stamped build exists."""
    if is_built():
        return server_binary()
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise PeerUnavailable(f"{tool} is not installed (apt-get install cmake g++)")
    src = fetch_sources()
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    log = BUILD / "build.log"
    _run(["cmake", "-S", str(src), "-B", str(CMAKE_DIR), *generator, *CMAKE_FLAGS], "cmake configure", log)
    jobs = os.environ.get("IGNIS_PEER_BUILD_JOBS", "2")
    _run(["cmake", "--build", str(CMAKE_DIR), "--target", "llama-server", "-j", jobs], "cmake build", log)
    if not server_binary().is_file():
        raise PeerUnavailable(f"the build finished but {server_binary()} is missing; log {log}")
    (CMAKE_DIR / "ignis.stamp").write_text(_stamp())
    return server_binary()


def _content_key(checkpoint: Path) -> str:
    """Names, sizes and mtimes of the files the converter reads, plus the converter's version."""
    files = sorted(p for p in checkpoint.iterdir() if p.suffix in (".json", ".safetensors") and p.is_file())
    if not any(p.suffix == ".safetensors" for p in files):
        raise FileNotFoundError(f"{checkpoint} holds no *.safetensors: not a checkpoint")
    lines = [f"llama-cpp-python=={VERSION}"] + [f"{p.name} {p.stat().st_size} {p.stat().st_mtime_ns}" for p in files]
    return "\n".join(lines) + "\n"


def convert_to_gguf(checkpoint: Path, outtype: str = "f32") -> Path:
    """build/gguf/<checkpoint-name>-<outtype>.gguf by llama.cpp's converter; cached by checkpoint content.

    The bench checkpoints are fp32, so "f32" keeps the peer on the same weights as ignis.
    """
    checkpoint = Path(checkpoint).resolve()
    out = GGUF_DIR / f"{checkpoint.name}-{outtype}.gguf"
    key_file = out.with_suffix(".key")
    key = _content_key(checkpoint)
    if out.is_file() and key_file.is_file() and key_file.read_text() == key:
        return out
    src = fetch_sources()
    GGUF_DIR.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(src / "gguf-py")])}
    log = GGUF_DIR / f"{out.stem}.log"
    log.unlink(missing_ok=True)
    args = ["--outtype", outtype, "--outfile", str(partial)]
    config = json.loads((checkpoint / "config.json").read_text())
    if set(config.get("architectures", [])) & MTP_ARCHS and not config.get("mtp_num_hidden_layers"):
        args.append("--no-mtp")  # these converters expect multi-token-prediction layers unless told
    _run([sys.executable, "-m", "bench.peers.convert_hf", str(src), str(checkpoint), *args],
         f"convert {checkpoint.name} to GGUF", log, cwd=ROOT, env=env)
    partial.rename(out)
    key_file.write_text(key)
    return out


def launch_llama_server(workdir: Path, gguf: Path, *, threads: int, parallel: int, ctx_size: int,
                        cache_ram_mib: int | None = None, extra: list[str] | None = None) -> Service:
    """llama-server on a free loopback port, ready once GET /health answers 200.

    `ctx_size` is one KV pool (in tokens) shared by the `parallel` slots (--kv-unified, like
    ignis' page pool), not a per-slot budget. Prompt caching is on, the chat template is the
    checkpoint's own (--jinja). `cache_ram_mib` sizes the host-RAM prompt cache (-1: no limit,
    0: off; None: llama-server's default). `extra` flags go last and win.
    """
    binary = ensure_built()
    port = free_port()
    cmd = [str(binary), "--model", str(Path(gguf).resolve()), "--alias", Path(gguf).stem,
           "--host", "127.0.0.1", "--port", str(port), "--threads", str(threads), "--threads-batch", str(threads),
           "--parallel", str(parallel), "--ctx-size", str(ctx_size), "--kv-unified", "--cache-prompt",
           "--jinja", "--metrics", "--no-webui"]
    if cache_ram_mib is not None:
        cmd += ["--cache-ram", str(cache_ram_mib)]
    return launch_binary("llama-server", [*cmd, *(extra or [])], port, Path(workdir), http_healthy)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peers.llama_cpp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build llama-server and print its path")
    convert = sub.add_parser("convert", help="convert a checkpoint to GGUF and print its path")
    convert.add_argument("checkpoint", type=Path)
    convert.add_argument("--outtype", default="f32")
    serve = sub.add_parser("serve", help="convert and serve a checkpoint until Ctrl-C")
    serve.add_argument("checkpoint", type=Path)
    serve.add_argument("--outtype", default="f32")
    serve.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    serve.add_argument("--parallel", type=int, default=4)
    serve.add_argument("--ctx-size", type=int, default=16384)
    serve.add_argument("--cache-ram", type=int, default=None, help="MiB of host-RAM prompt cache")
    serve.add_argument("--workdir", type=Path, default=BUILD / "serve")
    a = parser.parse_args(argv)
    try:
        if a.command == "build":
            print(ensure_built())
        elif a.command == "convert":
            print(convert_to_gguf(a.checkpoint, a.outtype))
        else:
            service = launch_llama_server(a.workdir, convert_to_gguf(a.checkpoint, a.outtype), threads=a.threads,
                                          parallel=a.parallel, ctx_size=a.ctx_size, cache_ram_mib=a.cache_ram)
            print(f"llama-server on http://{service.address} (log {service.log_path}); Ctrl-C stops it", flush=True)
            try:
                service.process.wait()
            except KeyboardInterrupt:
                pass
            return service.stop()
    except PeerUnavailable as e:
        print(f"llama.cpp peer unavailable: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
