"""Build llama-cpp-python (the `gguf` drafter's engine) once per CPU kind and cache the wheel.

llama-cpp-python ships as a source package here: a cmake + C++ build of llama.cpp that takes 9-25 minutes on two
cores. `make setup-gguf` runs this script; it builds a wheel with flags chosen from this CPU's `/proc/cpuinfo` and
keeps it in `~/.cache/pipespec/wheels/`, keyed by the version and the flags, so the next set-up on the same kind
of machine installs in seconds.

Why explicit flags and not `GGML_NATIVE`: on the AMX host a native build died with a general protection fault in
`libggml-cpu` at its first forward (AMX tiles advertised by the KVM guest but unusable), while the same source with
`GGML_NATIVE=OFF`, AVX2 / AVX-512 / AVX-512-bf16 on and AMX off ran. So AMX stays off everywhere, and every other
extension is turned on only when this CPU reports it (an AVX-512 build would die with SIGILL on the AVX2-only host).

    python scripts/build_llama_cpp.py            # build (or reuse) and install into this interpreter's env
    python scripts/build_llama_cpp.py --print-flags
    python scripts/build_llama_cpp.py --tools    # also llama-server / llama-speculative (benchmarks), into
                                                 # ~/.cache/pipespec/llama.cpp (--tools DIR: elsewhere)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

VERSION = "0.3.36"
PACKAGE = f"llama-cpp-python=={VERSION}"

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


def build_wheel(options: dict[str, bool]) -> Path:
    """The cached wheel for these options, built first when missing."""
    target = cache_dir() / f"llama-cpp-python-{VERSION}-{flag_tag(options)}"
    wheels = sorted(target.glob("llama_cpp_python-*.whl"))
    if wheels:
        print(f"llama-cpp-python {VERSION}: cached wheel {wheels[-1]}", flush=True)
        return wheels[-1]
    target.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CMAKE_ARGS=cmake_args(options), CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    print(
        f"building llama-cpp-python {VERSION} from source ({flag_tag(options)}); "
        "this takes 9-25 minutes on two cores, once per machine kind",
        flush=True,
    )
    start = time.monotonic()
    # --no-cache-dir: pip's own wheel cache is keyed by the source, not by CMAKE_ARGS, and would hand back a wheel
    # built earlier with other flags (a native build, say) instead of building this one
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "--no-binary", "llama-cpp-python",
         "-w", str(target), PACKAGE], env=env)
    print(f"built in {time.monotonic() - start:.0f} s", flush=True)
    return sorted(target.glob("llama_cpp_python-*.whl"))[-1]


def build_tools(options: dict[str, bool], out: Path) -> None:
    """llama.cpp's own `llama-speculative`, `llama-server` and `llama-bench` from the same source and flags.

    Only the benchmarks need them (the CPU user's alternative, measured side by side); `make setup` does not.
    """
    out.mkdir(parents=True, exist_ok=True)
    src_dir = out / "src"
    if not src_dir.exists():
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(out), PACKAGE])
        sdist = next(out.glob("llama_cpp_python-*.tar.gz"))
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
