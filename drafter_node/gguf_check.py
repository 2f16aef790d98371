"""The parent side of llama.cpp's probe: run a probe command in a child process and say what happened.

Light on purpose (no torch, no llama.cpp): the config loader (``drafter_node.type_choice``) and
``scripts/build_llama_cpp.py`` use it before either is imported.
"""

from __future__ import annotations


def run_probe(command: list[str], timeout_s: float = 300.0) -> tuple[bool, str]:
    """Run ``command`` (a probe of llama.cpp) in a child process: (True, its output) when it exits 0, else
    (False, what happened and what to do). A build whose CPU code this machine cannot run dies with a signal
    (SIGILL: instructions the CPU lacks; SIGSEGV: a general protection fault, as AMX code on a guest without AMX
    state), which would otherwise take the drafter node down at its first forward."""
    import signal
    import subprocess

    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"the llama.cpp probe did not finish in {timeout_s:.0f} s"
    if done.returncode == 0:
        return True, done.stdout
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        what = f"llama.cpp died with {name} at its first forward"
    else:
        what = f"the llama.cpp probe failed (exit {done.returncode}): {done.stderr.strip()[-500:]}"
    return False, (f"{what}; this llama-cpp-python build cannot run on this CPU: rebuild it for this machine with "
                   f"make setup-gguf (scripts/build_llama_cpp.py chooses the CPU flags)")
