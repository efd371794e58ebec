"""One tenant's flood does not evict another tenant's cached prefixes (the prefix cache's fair eviction,
deployments/engine/block_manager.py), through the real engine: the quiet tenant's repeated prompt is still
served from the cache after the flood streamed more distinct prompts than the cache holds."""

from deployments.engine.interface import EngineRequest, SamplingParams
from tests.engine.helpers import drain, make_engine
from tests.model_fixtures import TinySetup

PARAMS = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)


def test_a_flood_of_new_prompts_leaves_another_tenants_prefix_cached(llama: TinySetup) -> None:
    engine = make_engine(llama, num_kv_blocks=40, block_size=16, max_num_seqs=4)
    prompt = [(7 * k) % 900 + 5 for k in range(65)]  # 4 full blocks are cacheable
    engine.add_request(EngineRequest("quiet-1", prompt, PARAMS, cache_salt="quiet", tenant="quiet"))
    drain(engine)
    for i in range(16):  # 16 x 5 blocks: twice the cache, every prompt new
        flood = [(11 * k + 131 * i) % 900 + 3 for k in range(65)]
        engine.add_request(EngineRequest(f"flood-{i}", flood, PARAMS, cache_salt="flood", tenant="flood"))
    drain(engine)
    engine.add_request(EngineRequest("quiet-2", prompt, PARAMS, cache_salt="quiet", tenant="quiet"))
    again = drain(engine)["quiet-2"][-1]
    engine.close()
    assert again.usage is not None and again.usage.cached_prompt_tokens == 64
