"""transformers' attention functions are wrapped only while a press needs it or a compact layer exists, and restored
as they were afterwards, whatever the nesting or the threads."""

import gc
import threading

import torch
from helpers import tiny_model
from kvpress import KnormPress, SnapKVPress
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvpress_critical import ChunkedPrefillPress, CompactCachePress, CriticalAdaKVPress
from kvpress_critical.cache import CompactLayer, attention_wrapping
from kvpress_critical.cache.attention import attention_wrapping_installed


def functions() -> dict:
    return dict(ALL_ATTENTION_FUNCTIONS.items())


def wrapped(table: dict) -> bool:
    return all(getattr(func, "_kvpress_critical_compact", False) for func in table.values())


def test_a_press_block_without_a_surviving_compact_layer_leaves_the_functions_as_they_were():
    gc.collect()
    before = functions()
    assert not attention_wrapping_installed()
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(0))
    press = ChunkedPrefillPress(CriticalAdaKVPress(SnapKVPress(0.5, window_size=8)), chunk_size=32)
    seen = []
    hook = model.model.layers[0].self_attn.register_forward_hook(lambda *args: seen.append(wrapped(functions())))
    with press(model):
        model.model(input_ids=ids, past_key_values=DynamicCache())  # masking layout: no compact layer
    hook.remove()
    assert seen == [True, True, True]  # three chunks, attended exactly over the masked entries
    assert functions() == before


def test_a_compact_cache_keeps_the_wrapper_for_its_lifetime():
    gc.collect()
    before = functions()
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache()
    with CompactCachePress(CriticalAdaKVPress(KnormPress(0.5)))(model):
        model.model(input_ids=ids, past_key_values=cache)
    assert isinstance(cache.layers[0], CompactLayer) and wrapped(functions())
    out = model(input_ids=ids[:, :1], past_key_values=cache, position_ids=torch.tensor([[60]]))  # after the block
    assert torch.isfinite(out.logits).all()
    del cache, out
    gc.collect()
    assert functions() == before


def test_nested_and_concurrent_holders_restore_the_functions_once():
    gc.collect()
    before = functions()
    errors = []

    def hold(n):
        try:
            for _ in range(n):
                with attention_wrapping():
                    with attention_wrapping(exact_masking=True):
                        assert wrapped(functions())
                    assert wrapped(functions())
        except BaseException as error:  # noqa: BLE001  (reported below)
            errors.append(error)

    threads = [threading.Thread(target=hold, args=(200,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert functions() == before


def test_a_function_registered_meanwhile_is_wrapped_by_the_next_holder_and_restored():
    gc.collect()
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ALL_ATTENTION_FUNCTIONS["test_attention"] = sdpa
    try:
        with attention_wrapping():
            assert getattr(ALL_ATTENTION_FUNCTIONS["test_attention"], "_kvpress_critical_compact", False)
        assert ALL_ATTENTION_FUNCTIONS["test_attention"] is sdpa
    finally:
        del ALL_ATTENTION_FUNCTIONS["test_attention"]
