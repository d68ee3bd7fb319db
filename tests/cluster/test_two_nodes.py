"""The multi-node rehearsal on one host (CPU, gloo): two Ray nodes (``ray.cluster_utils.Cluster``, one CPU each,
as two machines would be), a TP=2 replica with a separate drafter that cannot fit one node, so placement packs it
across both (PACK); its outputs equal the single-process engine's. The GPU recipe (``ray start`` per node with
disjoint ``CUDA_VISIBLE_DEVICES``) is ``benchmarks/two_node_rehearsal.sh``."""

import pytest
import ray
from ray.cluster_utils import Cluster

from cluster import LLM
from configs import DSparkDecodingConfig
from runtime import LLM as LocalLLM
from runtime import SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [100, 3]]
ENGINE = dict(dtype="float32", device="cpu", num_pages=96, page_size=4)


@pytest.fixture(scope="module")
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_a_replica_spanning_two_nodes_equals_the_single_process_engine(two_nodes, near_bigram_target, make_drafter):
    spec = DSparkDecodingConfig(speculative_model=str(make_drafter(near_bigram_target, 3, oracle=True)))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in LocalLLM(str(near_bigram_target), speculative_config=spec, **ENGINE).generate(
        PROMPTS, params)]
    with LLM(str(near_bigram_target), speculative_config=spec, tensor_parallel_size=2, drafter="separate",
             **ENGINE) as llm:  # three processes, two nodes of 2 + 1 CPUs: STRICT_PACK cannot hold it
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
        nodes = {info["node"] for info in llm.rank_info()}
        assert len(nodes) == 2 and llm.get_metrics()["num_drafts"] > 0


def test_the_rehearsal_check_measures_crossing_nodes_against_one_node(two_nodes, tmp_path):
    """benchmarks/two_node_check.py's record on this two-node cluster: a TP=2 replica spread over both nodes and the
    same replica packed on the head node (2 CPUs) both equal the single-process engine; the record has the cost of
    crossing nodes. A replica no node can hold records why it has no one-node figure."""
    from benchmarks.two_node_check import check

    record = check(tmp_path / "a", "cpu", 2, "colocated", None)
    assert record["outputs_equal"] and record["one_node_outputs_equal"]
    assert record["nodes"] == 2 and len({r["node"] for r in record["one_node_ranks"]}) == 1
    assert record["crossing_vs_one_node"] > 0
    spread = check(tmp_path / "b", "cpu", 2, "separate", None)  # three processes: no node holds them
    assert spread["outputs_equal"] and spread["one_node"].startswith("not measured: placement_strategy STRICT_PACK")
