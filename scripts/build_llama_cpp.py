"""Build llama-cpp-python (the `gguf` drafter's engine) once per CPU kind and cache the wheel.

llama-cpp-python ships as a source package here: a cmake + C++ build of llama.cpp that takes 9-25 minutes on two
cores. `make setup-gguf` runs this script; it builds a wheel with flags chosen from this CPU's `/proc/cpuinfo` and
keeps it in `~/.cache/pipespec/wheels/`, keyed by the version and the flags, so the next set-up on the same kind
of machine installs in seconds.

Why explicit flags and not `GGML_NATIVE`: on the AMX host a native build died with a general protection fault in
`libggml-cpu` at its first forward (AMX tiles advertised by the KVM guest but unusable), while the same source with
`GGML_NATIVE=OFF`, AVX2 / AVX-512 / AVX-512-bf16 on and AMX off ran. So AMX stays off everywhere, and every other
extension is turned on only when this CPU reports it (an AVX-512 build would die with SIGILL on the AVX2-only host).

The source is pinned by its SHA-256 (:data:`SDIST_SHA256`: the sdist is downloaded into a temporary folder and
checked before pip builds from that file), a built wheel's SHA-256 is stored beside it (``<wheel>.sha256``) and
checked before it is installed again, and a cache folder that another user owns or that is writable by group or
others is refused (whoever could write there could swap the wheel this script installs).

    python scripts/build_llama_cpp.py            # build (or reuse) and install into this interpreter's env
    python scripts/build_llama_cpp.py --print-flags
    python scripts/build_llama_cpp.py --tools    # also llama-server / llama-speculative (benchmarks), into
                                                 # ~/.cache/pipespec/llama.cpp (--tools DIR: elsewhere)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

VERSION = "0.3.36"
PACKAGE = f"llama-cpp-python=={VERSION}"
#: SHA-256 of llama_cpp_python-0.3.36.tar.gz as the package index serves it (computed from a download, 2026-12-07).
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"

# ggml's x86 options and the /proc/cpuinfo flags each needs (all of them). AMX is deliberately absent.
GGML_OPTIONS: dict[str, tuple[str, ...]] = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_BMI2": ("bmi2",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512f", "avx512vbmi"),
    "GGML_AVX512_VNNI": ("avx512f", "avx512_vnni"),
    "GGML_AVX512_BF16": ("avx512f", "avx512_bf16"),
}
ALWAYS_OFF = ("GGML_NATIVE", "GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The instruction-set flags of this CPU (empty where /proc/cpuinfo is missing: a portable build)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def ggml_options(flags: set[str]) -> dict[str, bool]:
    """Every ggml CPU option this build sets, on or off, for a CPU with these flags."""
    options = {name: all(f in flags for f in needs) for name, needs in GGML_OPTIONS.items()}
    options.update(dict.fromkeys(ALWAYS_OFF, False))
    return options


def flag_tag(options: dict[str, bool]) -> str:
    """A short, stable name of the enabled extensions: the cache key's second half."""
    on = [name.removeprefix("GGML_").lower() for name, value in options.items() if value]
    return "-".join(on) or "generic"


def ggml_defines(options: dict[str, bool]) -> list[str]:
    """The ``-D`` flags of ``options``: the same CPU flags for the wheel and for the tools."""
    return [f"-D{name}={'ON' if value else 'OFF'}" for name, value in options.items()]


def cmake_args(options: dict[str, bool]) -> str:
    # The Python package needs neither the multimodal library nor curl; skipping mtmd saves minutes.
    return " ".join([*ggml_defines(options), "-DLLAVA_BUILD=OFF", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release"])


def cache_dir() -> Path:
    """Where the wheels are cached: ``wheels/`` of pipespec's cache (``$PIPESPEC_CACHE``, else ~/.cache/pipespec)."""
    from shared.named_models import cache_root

    return cache_root() / "wheels"


def run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)


def sha256_of(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def private_dir_problem(path: Path) -> str | None:
    """Why ``path`` (a folder) may not hold what this script installs: owned by another user, or writable by group
    or others; None where it is this user's alone."""
    st = path.stat()
    if st.st_uid != os.geteuid():
        return f"{path} is owned by another user (uid {st.st_uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): chmod go-w {path}"
    return None


def private_dir(path: Path) -> Path:
    """``path`` made (mode 0700) where missing, or a SystemExit where it or the folder above is not private."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    for folder in (path.parent, path):
        problem = private_dir_problem(folder)
        if problem is not None:
            raise SystemExit(f"error: refusing the build cache: {problem}")
    return path


def fetch_sdist(into: Path) -> Path:
    """llama-cpp-python's sdist downloaded into ``into`` and checked against :data:`SDIST_SHA256` (a SystemExit where
    it differs: the package index served another file under this version)."""
    run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(into), PACKAGE])
    sdist = next(into.glob("llama_cpp_python-*.tar.gz"))
    got = sha256_of(sdist)
    if got != SDIST_SHA256:
        raise SystemExit(f"error: {sdist.name} has SHA-256 {got}, not the pinned {SDIST_SHA256}: refusing to build it")
    print(f"{sdist.name}: SHA-256 matches the pin", flush=True)
    return sdist


def record_wheel(wheel: Path) -> None:
    """Store ``wheel``'s SHA-256 beside it (``<wheel>.sha256``), checked before each later install."""
    wheel.with_name(wheel.name + ".sha256").write_text(f"{sha256_of(wheel)}  {wheel.name}\n")


def trusted_wheel(wheel: Path) -> bool:
    """Whether ``wheel`` is the file this script built: its SHA-256 is the one stored beside it. A missing record
    is False (built elsewhere or before records: rebuilt); a record that differs is a SystemExit (altered)."""
    record = wheel.with_name(wheel.name + ".sha256")
    if not record.exists():
        return False
    expected = record.read_text().split()[0] if record.read_text().split() else ""
    if sha256_of(wheel) != expected:
        raise SystemExit(f"error: {wheel} does not match the SHA-256 stored beside it ({record.name}): it was "
                         f"altered after it was built; remove {wheel.parent} and build again")
    return True


def build_wheel(options: dict[str, bool]) -> Path:
    """The cached wheel for these options (its stored SHA-256 checked), built from the pinned sdist when missing."""
    private_dir(cache_dir())
    target = private_dir(cache_dir() / f"llama-cpp-python-{VERSION}-{flag_tag(options)}")
    wheels = sorted(target.glob("llama_cpp_python-*.whl"))
    if wheels and trusted_wheel(wheels[-1]):
        print(f"llama-cpp-python {VERSION}: cached wheel {wheels[-1]} (SHA-256 checked)", flush=True)
        return wheels[-1]
    for stale in wheels:  # no record of its hash: not known to be ours, built again
        print(f"{stale.name} has no stored SHA-256: building it again", flush=True)
        stale.unlink()
    env = dict(os.environ, CMAKE_ARGS=cmake_args(options), CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    print(
        f"building llama-cpp-python {VERSION} from source ({flag_tag(options)}); "
        "this takes 9-25 minutes on two cores, once per machine kind",
        flush=True,
    )
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pipespec-llama-sdist-") as tmp:
        sdist = fetch_sdist(Path(tmp))
        # --no-cache-dir: pip's own wheel cache is keyed by the source, not by CMAKE_ARGS, and would hand back a
        # wheel built earlier with other flags (a native build, say) instead of building this one
        run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-w", str(target), str(sdist)],
            env=env)
    print(f"built in {time.monotonic() - start:.0f} s", flush=True)
    wheel = sorted(target.glob("llama_cpp_python-*.whl"))[-1]
    record_wheel(wheel)
    return wheel


def build_tools(options: dict[str, bool], out: Path) -> None:
    """llama.cpp's own `llama-speculative`, `llama-server` and `llama-bench` from the same source and flags.

    Only the benchmarks need them (the CPU user's alternative, measured side by side); `make setup` does not.
    """
    private_dir(out)
    src_dir = out / "src"
    if not src_dir.exists():
        sdist = fetch_sdist(out)
        with tarfile.open(sdist) as tar:
            tar.extractall(out, filter="data")
        (out / sdist.name.removesuffix(".tar.gz") / "vendor" / "llama.cpp").rename(src_dir)
    build = out / "build"
    run(["cmake", "-S", str(src_dir), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
         "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF", *ggml_defines(options)])
    run(["cmake", "--build", str(build), "--target", "llama-speculative", "llama-server", "llama-bench",
         "-j", str(os.cpu_count() or 2)])
    print(f"tools in {build / 'bin'}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print-flags", action="store_true", help="print the cmake flags for this CPU and stop")
    parser.add_argument("--no-install", action="store_true", help="build / find the wheel but do not install it")
    parser.add_argument("--tools", type=Path, metavar="DIR", nargs="?", const=cache_dir().parent / "llama.cpp",
                        help="also build llama.cpp's tools (llama-server, llama-speculative, llama-bench) into DIR "
                             "(default ~/.cache/pipespec/llama.cpp; the benchmarks look there)")
    parser.add_argument("--probe", action="store_true",
                        help="after installing, run one forward of a tiny GGUF in a child process (a build this CPU "
                             "cannot run fails here, with the signal)")
    args = parser.parse_args(argv)
    options = ggml_options(cpu_flags())
    if args.print_flags:
        print(cmake_args(options))
        return 0
    wheel = build_wheel(options)
    if not args.no_install:
        trusted_wheel(wheel)  # checked again right before pip reads it
        run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)])
        # llama-cpp-python's own light dependencies (numpy, typing-extensions, diskcache, jinja2)
        run([sys.executable, "-m", "pip", "install", "-q", "diskcache>=5.6.1", "jinja2>=2.11.3",
             "typing-extensions>=4.5.0", "numpy>=1.20.0"])
    if args.probe and not args.no_install:
        probe()
    if args.tools:
        build_tools(options, args.tools)
    return 0


def probe() -> None:
    """One forward of a tiny Qwen2 written as GGUF, in a child process (a crash is reported with its signal instead
    of taking this script down); the outcome is recorded for ``drafter.type: auto`` (drafter_node/type_choice.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from drafter_node.type_choice import probe_llama_cpp

    ok, message = probe_llama_cpp()
    print(message.strip(), flush=True)
    if not ok:
        raise SystemExit(f"error: llama.cpp cannot run on this CPU: {message.strip().splitlines()[0]}")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.CalledProcessError as exc:
        print(f"error: {' '.join(map(str, exc.cmd))} failed (exit {exc.returncode}); see its output above",
              file=sys.stderr)
        sys.exit(1)
