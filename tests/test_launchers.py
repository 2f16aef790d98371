"""The launcher registry and the ``inproc`` launcher: every ``launch.backend`` has a registered class, one start
path serves them all, and the in-process launcher runs both nodes as threads over ``inproc://`` — greedy output
token-identical to transformers' ``generate``, test objects handed to the nodes directly, and a stop that leaves
no thread behind.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from conftest import tiny_config

from runtime.config import ConfigError, load_config
from runtime.launchers import LAUNCHERS, LaunchOptions, cluster, launcher_class
from runtime.launchers.inproc import InprocLauncher, inproc_cluster
from runtime.launchers.process import ProcessLauncher
from runtime.node_setup import LaunchError
from shared.config_sections import LAUNCH_BACKENDS
from testkit.tiny_models import reference_greedy

PROMPTS = [[5, 17, 33, 2, 60], [100, 101, 7]]


def _node_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("pipespec-")]


@pytest.mark.unit
def test_every_backend_is_registered_and_unknown_ones_are_refused(tiny):
    assert set(LAUNCHERS) == set(LAUNCH_BACKENDS)
    assert launcher_class("process") is ProcessLauncher and launcher_class("inproc") is InprocLauncher
    with pytest.raises(LaunchError, match="unknown launcher 'nope'"):
        launcher_class("nope")
    with pytest.raises(ConfigError, match=r"launch\.backend"):
        load_config(tiny_config(tiny("llama"), None), {"launch.backend": "threads"})


@pytest.mark.unit
def test_options_a_launcher_cannot_honour_are_refused(tiny):
    config = load_config(tiny_config(tiny("llama"), None), {"launch.backend": "inproc"})
    with pytest.raises(LaunchError, match="process prefix or entry"):
        InprocLauncher(config, LaunchOptions(entry={"verifier": ["x.py"]}))
    with pytest.raises(LaunchError, match="hooks"):
        ProcessLauncher(load_config(tiny_config(tiny("llama"), None)), LaunchOptions(hooks={"verifier": {}}))


@pytest.mark.unit
def test_inproc_greedy_matches_transformers_and_stops_clean(tiny):
    target, drafter = tiny("llama", "target"), tiny("llama", "random")
    expected = [reference_greedy(target, p, 16) for p in PROMPTS]
    config = tiny_config(target, drafter, num_draft_tokens=3)

    before = set(threading.enumerate())

    async def main():
        async with inproc_cluster(config) as client:
            assert client.address.startswith("inproc://")
            assert {n.role for n in client.cluster.nodes().values()} == {"verifier", "drafter"}
            assert _node_threads(), "the nodes run as threads of this process"
            results = await asyncio.gather(*(client.generate(token_ids=p, max_new_tokens=16, eos_token_ids=[])
                                             for p in PROMPTS))
        return results

    results = asyncio.run(main())
    assert [r.token_ids for r in results] == expected
    assert results[0].metrics["drafts"] > 0, "the drafter never contributed a block"
    assert _node_threads() == [], "stop() joined every node thread"
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert left == [], f"threads the nodes started are still running: {left}"


@pytest.mark.unit
def test_inproc_hands_objects_to_the_nodes_and_reports_a_failed_node(tiny):
    """A hook reaches the node as an object (here an acceptance rule that counts its calls); a node that cannot
    start is reported with its error, and its thread is gone after the stop."""
    target = tiny("llama", "target")
    calls: list[int] = []

    def accept_all(scores, draft, q, generator):
        from shared.sampling import sample

        calls.append(len(draft))
        return [*draft, sample(scores[len(draft)].softmax(-1), generator)]

    async def run(hooks):
        async with inproc_cluster(tiny_config(target, target), hooks=hooks) as client:
            return await client.generate(token_ids=PROMPTS[0], max_new_tokens=8, eos_token_ids=[], do_sample=True,
                                         seed=1)

    asyncio.run(run({"verifier": {"accept": accept_all}}))
    assert calls, "the verifier used the rule handed to it"
    with pytest.raises(LaunchError, match="verifier node failed: TypeError"):
        asyncio.run(run({"verifier": {"no_such_argument": 1}}))
    assert _node_threads() == []


@pytest.mark.unit
def test_cluster_picks_the_launcher_from_the_config(tiny):
    """``runtime.launchers.cluster`` with ``launch.backend: inproc`` (no branching in the caller)."""
    target = tiny("llama", "target")

    async def main():
        async with cluster(tiny_config(target, target), {"launch.backend": "inproc"}) as client:
            assert isinstance(client.cluster, InprocLauncher)
            return await client.generate(token_ids=PROMPTS[1], max_new_tokens=6, eos_token_ids=[])

    assert asyncio.run(main()).token_ids == reference_greedy(target, PROMPTS[1], 6)


@pytest.mark.unit
def test_the_command_runs_one_generation_in_process(tiny, tmp_path, capsys):
    """``python -m runtime.launch --launcher inproc --prompt ... --json``: the CLI picks the launcher by flag."""
    import json

    import yaml

    from runtime.launch import main

    target = tiny("llama", "target")
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config(target, target)))
    assert main(["--config", str(path), "--launcher", "inproc", "--prompt", "hello", "--json",
                 "--max-new-tokens", "5"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 5 and out["metrics"]["new_tokens"] == 5
    assert _node_threads() == []
    assert main(["--config", str(path), "--launcher", "inproc", "--role", "verifier"]) == 2  # one node: no launcher
    assert main(["--config", str(path), "--launcher", "process", "--ray"]) == 2


@pytest.mark.unit
def test_inproc_runs_several_drafters_in_one_pool(tiny):
    """``launch.drafters: 2`` in one process: two drafter threads join the pool under their own ids and share the
    requests; the output stays the target's greedy output."""
    target = tiny("llama", "target")
    prompts = [[5, i, 7] for i in range(4)]

    async def main():
        async with inproc_cluster(tiny_config(target, target), {"launch.drafters": 2}) as client:
            ids = sorted(d["id"] for d in (await client.ping())["drafters"])
            results = await asyncio.gather(*(client.generate(token_ids=p, max_new_tokens=8, eos_token_ids=[])
                                             for p in prompts))
        return ids, results

    ids, results = asyncio.run(main())
    assert len(ids) == 2 and len(set(ids)) == 2
    assert [r.token_ids for r in results] == [reference_greedy(target, p, 8) for p in prompts]
    assert {d for r in results for d in r.metrics["drafter_ids"]} == set(ids)
    assert _node_threads() == []
